"""The models the gateway serves: the registry it follows, and what the workers report ready.

The registry (the compacted `<prefix>.models`, schemas/registry.py) is folded by a
RegistryFollower seeded with the gateway's models.toml (docs/design.md, "The model registry",
invariant 10): a request's `model` is `name` (the route's default version) or `name@version` (that
version, pinned), and is resolved here to the version's ModelConfig, whose bounds (max_model_len,
default_timeout_s...) validate the request; the gateway then produces it with `model` =
`name@version` (pinned), so the version is known when the response starts.

A bare name under a traffic policy (docs/design.md, "Traffic policies") is assigned here: the
route's default or one of its canaries, by schemas/traffic.py's sticky hash of the request's key
(its `user`, else the principal, else the request id); `name@version` is `pinned`.

What is *ready* is not registry state: it comes from the workers' heartbeats (fleet.py). GET
/v1/models lists the names whose default version is ready and every ready `name@version`; the
admin index shows every version with the states the live workers report.

Admin writes (load, unload, promote) go through weir.registry's pure operations and publish(), then
wait (a few seconds at most) until the follower has read them back, so a caller that writes and
then reads sees its own write.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

from schemas.messages import VersionStatus, now_ms
from schemas.model_repo import ModelConfig, ModelRepository
from schemas.registry import (
    ModelRoute,
    ModelVersionRecord,
    RegistryState,
    served_id_of,
    split_ref,
    version_problem,
)
from schemas.traffic import Assignment, assign
from services.gateway.fleet import Fleet
from services.gateway.openai_format import ApiError
from weir.bus import BusSettings
from weir.registry import RegistryFollower, publish

Record = ModelVersionRecord | ModelRoute
Publisher = Callable[[list[Record]], Awaitable[None]]

# How x-weir-model-version names a version whose manifest nobody has reported: a models.toml entry
# not registered yet, on no live worker (the worker packs it when it loads it and reports the digest).
UNREGISTERED = "unregistered"
# A version's state on the fleet, best first: the index shows the best any live worker reports.
_STATE_RANK = ("ready", "draining", "golden", "loading", "verifying", "unhealthy", "failed", "refused")
APPLY_WAIT_S = 5.0


def ref_problem(ref: str) -> str | None:
    """Why `ref` can name no model (`name` or `name@version`), or None when it can."""
    name, version = split_ref(ref)
    if not name or "@" in name or any(ch.isspace() for ch in ref):
        return "a model is `name` or `name@version`, without whitespace"
    if version is not None:
        return version_problem(version)
    return None


class Catalog:
    """The registry state (followed, or given for a unit test) and the fleet's version states."""

    def __init__(
        self,
        state: RegistryState,
        fleet: Fleet,
        publisher: Publisher | None = None,
        follower: RegistryFollower | None = None,
    ) -> None:
        self._state = state
        self.fleet = fleet
        self._publisher = publisher
        self._follower = follower

    @classmethod
    def following(cls, settings: BusSettings, client_id: str, seed: ModelRepository, fleet: Fleet) -> Catalog:
        """A catalog that follows the registry topic of `settings` (start() reads it to its end)."""
        follower = RegistryFollower(settings, client_id=client_id, seed=seed)

        async def publisher(records: list[Record]) -> None:
            await publish(settings, records, client_id=client_id)

        return cls(follower.state, fleet, publisher, follower)

    @property
    def state(self) -> RegistryState:
        return self._follower.state if self._follower is not None else self._state

    @property
    def num_skipped(self) -> int:
        """Registry records the follower skipped (not decodable, or under another key)."""
        return self._follower.num_skipped if self._follower is not None else 0

    async def start(self) -> None:
        """Read the registry to its end before the gateway serves (docs/design.md, invariant 10)."""
        if self._follower is not None:
            await self._follower.start()

    async def stop(self) -> None:
        if self._follower is not None:
            await self._follower.stop()

    # ---- requests ---------------------------------------------------------------------------

    def resolve(self, ref: object) -> ModelConfig:
        """The config of the version a body's `model` names: 400 when it is no model reference,
        404 (model_not_found) when the name, or that version, is unknown, unregistered or retired."""
        if not isinstance(ref, str) or (problem := ref_problem(ref)) is not None:
            shown = ref[:200] if isinstance(ref, str) else ref
            raise ApiError(
                400,
                f"model {shown!r} is not a model reference: "
                f"{problem if isinstance(ref, str) else 'it must be a string'}",
                param="model",
                code="invalid_value",
            )
        config, reason = self.state.resolve(ref)
        if config is None:
            raise ApiError(404, f"The model {ref!r} does not exist: {reason}", param="model", code="model_not_found")
        return config

    def assign(self, ref: object, key: str, may_use: Callable[[str], bool]) -> tuple[ModelConfig, Assignment]:
        """The version a request's `model` is served by, and how it was chosen: `name@version` is
        `pinned`; a bare name goes to its route's default or a canary (schemas/traffic.py: assign,
        sticky per `key`). A canary the caller may not use (`may_use`, its key's allowlist), no
        longer wanted loaded, or failed or refused on every live worker reporting it gives its
        share back to the default: an experiment never turns a request for the bare name into a
        refusal the default would not give. Errors as resolve()."""
        config = self.resolve(ref)
        name, version = split_ref(cast(str, ref))
        if version is not None:
            return config, "pinned"
        route = self.state.routes.get(name)
        if route is None or route.default_version != config.version or not route.canary:
            return config, "default"  # no policy, or a route disregarded for a dangling default
        chosen, how = assign(name, config.version, route.canary, key)
        record = self.state.versions.get(served_id_of(name, chosen))
        if how == "default" or record is None or record.desired != "loaded" or not may_use(record.served_id):
            return config, "default"
        if self.fleet.availability(record.served_id, record.desired, now_ms(), record.updated_ms).problem is not None:
            return config, "default"
        return record.manifest.config(), "canary"

    def version_tag(self, served_id: str) -> str:
        """`name@version:<first 12 hex of the manifest digest>` (x-weir-model-version). The digest is
        the registry record's; for a version the registry does not hold (a models.toml entry not
        seeded yet) the one a live worker reports for what it loaded; else `name@version:unregistered`."""
        record = self.state.versions.get(served_id)
        if record is not None:
            return f"{served_id}:{record.manifest.digest()[:12]}"
        reported = [s.digest for s in self.fleet.version_states(now_ms()).get(served_id, {}).values() if s.digest]
        return f"{served_id}:{min(reported)[:12]}" if reported else f"{served_id}:{UNREGISTERED}"

    # ---- GET /v1/models ---------------------------------------------------------------------

    def listing(self, created_s: int, may_use: Callable[[str], bool]) -> dict[str, Any]:
        """OpenAI's model list of what is ready and the caller may use: each name whose default
        version some live worker reports ready, then every ready `name@version` (not retired).
        `may_use` is asked with the version an entry serves (guard/auth.py: Identity.may_use)."""
        state, ready = self.state, self.fleet.ready_versions(now_ms())
        entries: list[tuple[str, str]] = []  # (id, served version)
        for name in state.names():
            default = state.default_version(name)
            if default is not None and served_id_of(name, default) in ready:
                entries.append((name, served_id_of(name, default)))
        entries += [(served_id, served_id) for served_id in sorted(ready)]
        data = [
            self._model_object(ref, served_id, created_s)
            for ref, served_id in entries
            if state.resolve(served_id)[0] is not None and may_use(served_id)
        ]
        return {"object": "list", "data": data}

    def model(self, model_id: str, created_s: int, may_use: Callable[[str], bool]) -> dict[str, Any]:
        """GET /v1/models/{model}: the entry of listing() with that id, the same object; 404
        (model_not_found, in OpenAI's words) for an id it does not list: unknown, not ready, or one
        the caller may not use (a key limited to some models does not learn of the others)."""
        found = next((m for m in self.listing(created_s, may_use)["data"] if m["id"] == model_id), None)
        if found is None:
            raise ApiError(
                404,
                f"The model '{model_id[:200]}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return found

    def _model_object(self, ref: str, served_id: str, created_s: int) -> dict[str, Any]:
        record = self.state.versions.get(served_id)
        return {
            "id": ref,
            "object": "model",
            "owned_by": "weir",
            "created": record.manifest.created_ms // 1000 if record is not None else created_s,
            "weir_version": split_ref(served_id)[1],
            "weir_state": "ready",
            "weir_quantization": record.manifest.serving.get("quantization", "none") if record is not None else "none",
        }

    # ---- the admin API ------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every version the registry (or the seed) knows, with its state on the fleet: the best
        state a live worker reports, `unavailable` when none reports it; `workers` has each's."""
        state = self.state
        by_version = self.fleet.version_states(now_ms())
        served_ids = sorted(set(state.versions) | set(state.servable()))
        out = [self._index_entry(served_id, by_version.get(served_id, {})) for served_id in served_ids]
        return [entry for entry in out if entry["state"] == "ready"] if ready_only else out

    def _index_entry(self, served_id: str, on_workers: dict[str, VersionStatus]) -> dict[str, Any]:
        name, version = split_ref(served_id)
        record = self.state.versions.get(served_id)
        best = min(on_workers.values(), key=lambda s: _STATE_RANK.index(s.state), default=None)
        return {
            "name": name,
            "version": version,
            "state": best.state if best is not None else "unavailable",
            "reason": (best.reason or "") if best is not None else "no live worker reports it",
            "desired": self.desired(served_id),
            "registered": record is not None,
            "default": self.state.default_version(name) == version,
            "workers": {worker: status.state for worker, status in sorted(on_workers.items())},
        }

    def desired(self, served_id: str) -> str:
        """What the registry wants of version `served_id`: its record's `desired`; `loaded` for a seed
        entry not registered yet (workers register and load it)."""
        record = self.state.versions.get(served_id)
        return record.desired if record is not None else "loaded"

    def wanted_since(self, served_id: str) -> int | None:
        """When the registry's record of version `served_id` was written (None: a seed entry not
        registered yet): how long workers have had to take it up (fleet.TAKE_UP_MS)."""
        record = self.state.versions.get(served_id)
        return record.updated_ms if record is not None else None

    def registered(self, name: str, version: object) -> str:
        """The served id of a registered version named by an admin call; 400 for a bad name or
        version, 404 (model_not_found) for one the registry does not hold."""
        _check_path_name(name)
        if (problem := version_problem(version)) is not None:
            raise ApiError(400, problem, param="version", code="invalid_value")
        served_id = served_id_of(name, str(version))
        if served_id not in self.state.versions:
            raise ApiError(
                404,
                f"model version {served_id!r} is not registered (weir models push, or seed it from models.toml)",
                param="version",
                code="model_not_found",
            )
        return served_id

    def known_name(self, name: str) -> None:
        """400 for a path that names no model (or names a version), 404 (model_not_found) for a name
        neither the registry nor the seed knows."""
        _check_path_name(name)
        if name not in self.state.names():
            raise ApiError(404, f"model {name!r} does not exist", param="name", code="model_not_found")

    async def write(self, records: list[Record]) -> bool:
        """Publish registry records, then wait until the follower has read them back; True when it
        has within APPLY_WAIT_S (False: written, but this gateway has not read them yet)."""
        if self._publisher is None:
            raise ApiError(503, "this gateway has no registry to write to", code="unavailable")
        await self._publisher(records)
        deadline = time.monotonic() + APPLY_WAIT_S
        while not self._holds(records):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _holds(self, records: Iterable[Record]) -> bool:
        state = self.state
        for record in records:
            held = (
                state.versions.get(record.served_id)
                if isinstance(record, ModelVersionRecord)
                else state.routes.get(record.name)
            )
            if held != record:
                return False
        return True


def _check_path_name(name: str) -> None:
    """400 unless the `{name}` of an admin path is a model name, without @version."""
    problem = ref_problem(name) if "@" not in name else "the path names a model, without @version"
    if problem is not None:
        raise ApiError(400, f"model {name[:200]!r}: {problem}", param="name", code="invalid_value")
