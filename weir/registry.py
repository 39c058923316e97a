"""Following and writing the model registry (the compacted `<prefix>.models`, schemas/registry.py).

Every service that needs to know the models (the gateway: what exists and its bounds; the
batcher: where a name's requests go; the worker: what to load) runs a RegistryFollower: it reads
the topic from its beginning to its end before the service serves, then keeps following it, and
calls `on_change` after every change, on the loop. A record that is not a valid registry record
is skipped with a log line (the topic is written by `weir models` and the seeders; docs/design.md,
invariant 6): it changes nothing.

`seed_records` turns a models.toml into the records that register its entries: the local
deployment's registry seeds itself from the file (docs/design.md, "The model registry").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from aiokafka import ConsumerRecord
from pydantic import ValidationError

from schemas.codec import decode_registry_record, encode
from schemas.messages import now_ms
from schemas.model_repo import ModelRepository
from schemas.registry import (
    Desired,
    ModelManifest,
    ModelRoute,
    ModelVersionRecord,
    RegistryState,
    served_id_of,
    split_ref,
)
from weir.bus import BusSettings, TopicFollower, make_producer

log = logging.getLogger(__name__)


class RegistryFollower:
    """The registry's state, read to the end at start() and followed until stop() (a
    weir.bus.TopicFollower of the models topic)."""

    def __init__(
        self,
        settings: BusSettings,
        client_id: str,
        on_change: Callable[[], None] | None = None,
        seed: ModelRepository | None = None,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self.state = RegistryState(seed)
        self.on_change = on_change
        self.num_skipped = 0  # records that were not registry records
        self._changed = False
        self._follower = TopicFollower(settings, settings.topics.models, client_id, self._record, self._fetched)

    async def start(self) -> None:
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()

    def _record(self, key_bytes: bytes | None, value: bytes | None, message: ConsumerRecord) -> None:
        key = key_bytes.decode(errors="replace") if key_bytes else ""
        if value is None:
            self.state.apply(key, None)
            self._changed = True
            return
        try:
            record = decode_registry_record(value)
        except ValueError as exc:
            self.num_skipped += 1
            log.warning("registry record at %s/%d skipped: %s", message.topic, message.offset, exc)
            return
        if record.key != key:
            self.num_skipped += 1
            log.warning(
                "registry record at %s/%d skipped: its key %r is not %r", message.topic, message.offset, key, record.key
            )
            return
        self.state.apply(key, record)
        self._changed = True

    def _fetched(self) -> None:
        """After each fetch: on_change once, when it changed the state."""
        changed, self._changed = self._changed, False
        if changed and self.on_change is not None:
            self.on_change()


async def publish(
    settings: BusSettings, records: Iterable[ModelVersionRecord | ModelRoute], client_id: str = "weir-models"
) -> None:
    """Write registry records (acks=all), each under its key."""
    producer = make_producer(settings, client_id)
    await producer.start()
    try:
        for record in records:
            await producer.send_and_wait(settings.topics.models, encode(record), key=record.key.encode())
    finally:
        await producer.stop()


def seed_records(
    repo: ModelRepository, state: RegistryState, registered_by: str = "models.toml"
) -> list[ModelVersionRecord | ModelRoute]:
    """The records that register `repo`'s entries not yet in `state`: each as a loaded version
    (packed from its directory, which must exist: build GGUF imports and ONNX exports first),
    and a route to it for each name without one. An entry whose version is registered already is
    left as the registry has it (a registry version is immutable: a changed directory is a new
    version, `weir models push`)."""
    from weir.models.manifest import pack  # hashes files: only where seeding happens

    out: list[ModelVersionRecord | ModelRoute] = []
    for config in repo.models.values():
        if config.served_id not in state.versions:
            out.append(ModelVersionRecord(manifest=pack(config), desired="loaded", registered_by=registered_by))
        if config.name not in state.routes:
            out.append(
                ModelRoute(name=config.name, default_version=config.version, reason=f"seeded from {registered_by}")
            )
    return out


class RegistryError(ValueError):
    """An operation the registry's state does not allow; the message says why and what to do."""


def _version(state: RegistryState, served_id: str) -> ModelVersionRecord:
    _name, version = split_ref(served_id)
    if version is None:
        raise RegistryError(f"{served_id!r} names no version: use name@version")
    record = state.versions.get(served_id)
    if record is None:
        raise RegistryError(
            f"model version {served_id!r} is not registered (weir models push, or seed it from models.toml)"
        )
    return record


def set_desired(
    state: RegistryState, served_id: str, desired: Desired, by: str
) -> list[ModelVersionRecord | ModelRoute]:
    """The record that asks workers to load, unload or retire `served_id`. A retired version stays
    retired; the default version of a name cannot be unloaded or retired (promote another first)."""
    record = _version(state, served_id)
    if record.desired == "retired" and desired != "retired":
        raise RegistryError(f"{served_id} is retired; push it again under a new version")
    name, version = split_ref(served_id)
    if desired != "loaded" and state.default_version(name) == version:
        raise RegistryError(f"{served_id} is the default version of {name!r}; promote another version first")
    return [record.model_copy(update={"desired": desired, "registered_by": by, "updated_ms": now_ms()})]


def promote(
    state: RegistryState, served_id: str, by: str, reason: str = "promote"
) -> list[ModelVersionRecord | ModelRoute]:
    """Make `served_id` the default of its name: the route first (new requests go there at once), then
    the previous default asked to unload (workers drain it: docs/design.md, "The model registry")."""
    record = _version(state, served_id)
    if record.desired == "retired":
        raise RegistryError(f"{served_id} is retired; push it again under a new version")
    if record.desired != "loaded":
        raise RegistryError(f"{served_id} is {record.desired}; load it first (weir models load {served_id})")
    name, version = split_ref(served_id)
    previous = state.default_version(name)
    if previous == version:
        raise RegistryError(f"{served_id} is already the default version of {name!r}")
    route = state.routes.get(name)
    keep = (
        {}
        if route is None
        else {  # the rest of the traffic policy stays; the promoted version leaves it
            "canary": {v: s for v, s in route.canary.items() if v not in (version, previous)},
            "mirror": {v: s for v, s in route.mirror.items() if v not in (version, previous)},
        }
    )
    out: list[ModelVersionRecord | ModelRoute] = [
        ModelRoute(name=name, default_version=version, previous_version=previous, reason=f"{reason} by {by}", **keep)
    ]
    old = state.versions.get(served_id_of(name, previous)) if previous is not None else None
    if old is not None and old.desired == "loaded":
        out.append(old.model_copy(update={"desired": "unloaded", "registered_by": by, "updated_ms": now_ms()}))
    return out


def rollback(state: RegistryState, served_id: str, why: str, by: str) -> list[ModelVersionRecord | ModelRoute]:
    """Undo the promotion of `served_id`, the default of its name: the previous default loaded again and
    routed to, `served_id` unloaded. [] when `served_id` is not the default or there is nothing to roll back to."""
    name, version = split_ref(served_id)
    route = state.routes.get(name)
    if version is None or route is None or route.default_version != version or route.previous_version is None:
        return []
    back = served_id_of(name, route.previous_version)
    previous = state.versions.get(back)
    if previous is None or previous.desired == "retired":
        return []
    out: list[ModelVersionRecord | ModelRoute] = []
    if previous.desired != "loaded":
        out.append(previous.model_copy(update={"desired": "loaded", "registered_by": by, "updated_ms": now_ms()}))
    keep = {
        "canary": {v: s for v, s in route.canary.items() if v not in (version, route.previous_version)},
        "mirror": {v: s for v, s in route.mirror.items() if v not in (version, route.previous_version)},
    }
    out.append(
        ModelRoute(
            name=name,
            default_version=route.previous_version,
            previous_version=version,
            reason=f"rollback of {served_id}: {why}"[:1024],
            **keep,
        )
    )
    failed = state.versions.get(served_id)
    if failed is not None and failed.desired == "loaded":
        out.append(failed.model_copy(update={"desired": "unloaded", "registered_by": by, "updated_ms": now_ms()}))
    return out


def _content(manifest: ModelManifest) -> ModelManifest:
    """The manifest without the time it was packed: what makes two packings the same version."""
    return manifest.model_copy(update={"created_ms": 0})


def register(state: RegistryState, record: ModelVersionRecord) -> list[ModelVersionRecord | ModelRoute]:
    """The records that register a new version: itself, and a route to it when its name has none.
    A version is immutable: the same name@version with other files, format, location or serving
    settings is refused (the same ones packed again, at another time, are the same version)."""
    known = state.versions.get(record.served_id)
    if known is not None and _content(known.manifest) != _content(record.manifest):
        raise RegistryError(
            f"{record.served_id} is registered with other files (manifest "
            f"{known.manifest.digest()[:12]}); push it as a new version"
        )
    out: list[ModelVersionRecord | ModelRoute] = [record]
    name = record.manifest.name
    if name not in state.routes and state.default_version(name) is None:
        out.append(
            ModelRoute(
                name=name, default_version=record.manifest.version, reason=f"first version, by {record.registered_by}"
            )
        )
    return out


async def read_registry(settings: BusSettings, seed: ModelRepository | None = None) -> RegistryState:
    """The registry read once from its beginning to its end (for the CLI)."""
    follower = RegistryFollower(settings, client_id="weir-models", seed=seed)
    await follower.start()
    await follower.stop()
    return follower.state


def set_route(
    state: RegistryState,
    name: str,
    by: str,
    default: str | None = None,
    canary: dict[str, float] | None = None,
    mirror: dict[str, float] | None = None,
    reason: str = "route",
) -> list[ModelVersionRecord | ModelRoute]:
    """The route record that sets `name`'s traffic policy (docs/design.md, "Traffic policies"):
    its default (unchanged when None), canary and mirror shares (unchanged when None; {} clears).
    Every version it names must be registered and wanted loaded."""
    route = state.routes.get(name)
    current = state.default_version(name)
    default = default if default is not None else current
    if default is None:
        raise RegistryError(f"model {name!r} has no default version; give one")
    canary = dict(route.canary) if canary is None and route is not None else (canary or {})
    mirror = dict(route.mirror) if mirror is None and route is not None else (mirror or {})
    for version in {default, *canary, *mirror}:
        record = _version(state, served_id_of(name, version))
        if record.desired != "loaded":
            raise RegistryError(
                f"{record.served_id} is {record.desired}; load it first (weir models load {record.served_id})"
            )
    previous = route.previous_version if route is not None and default == current else current
    try:
        new = ModelRoute(
            name=name,
            default_version=default,
            previous_version=previous if previous != default else None,
            canary=canary,
            mirror=mirror,
            reason=f"{reason} by {by}"[:1024],
        )
    except ValidationError as exc:
        raise RegistryError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return [new]
