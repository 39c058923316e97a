"""A worker's model versions, each from the registry to serving and back (docs/design.md, "The model
registry"; invariant 10).

The worker follows the registry (app.py); reconcile() gets the versions it should hold now and
takes each one through

    verifying -> loading -> golden -> ready -> draining -> (gone)

or ends it `failed` (a file that does not match its manifest, a signature the worker may not trust,
an engine that cannot load, goldens that depart from their recorded outputs), `refused` (it does not
fit the worker's memory budget: the others keep serving) or, once ready, `unhealthy` (a periodic
golden check departed: out of routing at once, then reloaded from verified weights, or rolled back
when it is a freshly promoted default). Heartbeats report every version held or tried
(`statuses()`); what happens goes to Topics.model_health as events.

Only a ready version's ModelServer reads its batch topic (Topics.batches(name@version), in the
version's own group), so a batch reaches a worker only for a version it verified, loaded and checked.
Nothing in flight is cut: a version that is no longer wanted drains (it reads its topic until nothing
runs and no batch came for WEIR_DRAIN_QUIET_MS), an unhealthy one finishes what it runs before its
engines are replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiokafka.errors import KafkaError

from schemas.messages import Cancellation, VersionState, VersionStatus, now_ms
from schemas.model_repo import ModelConfig
from schemas.registry import (
    GoldenCase,
    ModelManifest,
    ModelRoute,
    ModelVersionRecord,
    RegistryState,
    served_id_of,
    split_ref,
)
from services.worker.config import WorkerSettings
from services.worker.engine import EngineOutput
from services.worker.hosts.goldens import GOLDEN_MAX_TOKENS
from services.worker.hosts.runner import EngineHost, EngineProcess
from services.worker.kafka.consumers import ModelServer
from services.worker.loading import EngineLoader, OpenEngine
from weir.heap import freeze_new
from weir.models.manifest import ManifestError, verify_files
from weir.models.signing import signature_problem
from weir.registry import rollback

log = logging.getLogger(__name__)

Outputs = asyncio.Queue[list[EngineOutput]]  # a version's engines put their outputs on it; its server reads it
Wanted = dict[
    str, ModelVersionRecord | ModelConfig
]  # served_id -> its registry record, or a models.toml entry not registered yet
GOLDEN_TIMEOUT_S = 120.0  # a golden check is a few greedy tokens per case, beside the running requests
_SETTLED: frozenset[VersionState] = frozenset({"ready", "failed", "refused", "unhealthy", "draining"})


class RegistryAccess(Protocol):
    """The model registry as the version manager uses it (app.py's RegistryDesk): read, seed, write."""

    @property
    def state(self) -> RegistryState:
        """The registry as read so far (weir.registry.RegistryFollower)."""

    async def seed_manifest(self, config: ModelConfig) -> ModelManifest:
        """The manifest of a models.toml entry not registered yet: its directory built, packed, registered."""

    async def write(self, records: list) -> None:
        """Registry records, published (weir.registry.publish)."""


MakeServer = Callable[[ModelConfig, list[EngineHost], Outputs], Awaitable[ModelServer]]
Emit = Callable[[str, str, str], Awaitable[None]]  # served_id, event, detail


@dataclass(frozen=True)
class ManagerParts:
    """What the version manager is handed: parts the worker (app.py) built before it, none of which
    refers to the worker or to the manager (docs/worker.md, "Code layout")."""

    worker_id: str
    open_engine: OpenEngine  # one engine instance of a version, built and warmed up (loading.OpenEngine)
    make_server: MakeServer  # a ModelServer over the hosts, reading `outputs` (the queue the hosts were
    #                          opened with); its topic created, not consuming yet
    registry: RegistryAccess
    emit: Emit  # a ModelHealthEvent on Topics.model_health
    changed: Callable[[], None]  # a version's state changed: heartbeat now


class _Stop(Exception):
    """A version cannot go on: it ends in `state` for `reason`, with a health `event`."""

    def __init__(self, state: VersionState, reason: str, event: str) -> None:
        super().__init__(reason)
        self.state, self.reason, self.event = state, reason, event


@dataclass
class Version:
    """One version on this worker: where it is in its life, and what serves it."""

    served_id: str
    seed: ModelConfig | None  # a models.toml entry the registry did not hold when it was wanted
    record: ModelVersionRecord | None  # else its registry record
    state: VersionState = "verifying"
    reason: str | None = None
    digest: str = ""
    budget_bytes: int = 0  # the memory slice reserved for it (0 until it fits)
    need_bytes: int = 0  # what it asked for (a refused version is tried again once that fits)
    hosts: list[EngineHost] = field(default_factory=list)
    outputs: Outputs | None = None  # the queue its engines were opened with (one per load)
    loader: EngineLoader | None = None
    server: ModelServer | None = None
    serving: list[asyncio.Task] = field(default_factory=list)  # the server's consume and publish loops
    job: asyncio.Task | None = None  # bring-up, reload or drain in progress
    is_stopping: bool = False  # no longer wanted: being cancelled or drained
    golden_checked_ms: int | None = None
    local_goldens: list[GoldenCase] = field(default_factory=list)  # recorded here: its record has none
    golden_failures: int = 0
    reloads: int = 0

    @property
    def name(self) -> str:
        return split_ref(self.served_id)[0]

    @property
    def version(self) -> str | None:
        return split_ref(self.served_id)[1]

    @property
    def goldens(self) -> list[GoldenCase]:
        """Its record's goldens; else those this worker recorded when it first loaded it (_record_goldens)."""
        if self.record is not None and self.record.goldens:
            return self.record.goldens
        return self.local_goldens

    @property
    def golden_source(self) -> str:
        """Where its goldens come from: "registry", "local" (recorded on this worker) or "none"."""
        if self.record is not None and self.record.goldens:
            return "registry"
        return "local" if self.local_goldens else "none"

    def status(self) -> VersionStatus:
        engine = self.hosts[0].engine_label if self.hosts else ""
        used = sum(h.used_bytes() for h in self.hosts)
        return VersionStatus(
            state=self.state,
            reason=self.reason,
            digest=self.digest,
            engine=engine,
            budget_bytes=self.budget_bytes,
            used_bytes=used,
            golden_checked_ms=self.golden_checked_ms,
        )


class VersionManager:
    """Every version this worker holds or tried, moved by reconcile() and its own jobs."""

    def __init__(
        self,
        settings: WorkerSettings,
        parts: ManagerParts,
        budget_total: int,
        trusted_keys: dict,
        estimate: Callable[[ModelConfig], Awaitable[int]],
        device_bytes: int = 0,
    ) -> None:
        self.settings = settings
        self.parts = parts
        self.budget_total = budget_total
        self.device_bytes = device_bytes  # the device's memory: what a record's budget_fraction is a share of
        self.trusted_keys = trusted_keys
        self._estimate = estimate  # bytes a version takes here when its record names no budget
        self.versions: dict[str, Version] = {}
        self.servers: list[ModelServer] = []  # of ready, unhealthy and draining versions (cancels reach them)
        self._wanted: Wanted = {}
        self._fatal: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks: set[asyncio.Task] = set()

    # -- what the worker asks -------------------------------------------------------------------

    def reconcile(self, wanted: Wanted) -> None:
        """Start what is wanted and not held; drain or drop what is held and no longer wanted."""
        self._wanted = wanted
        for served_id, wants in wanted.items():
            version = self.versions.get(served_id)
            if version is None:
                if isinstance(wants, ModelVersionRecord):
                    version = Version(served_id, None, wants)
                else:
                    version = Version(served_id, wants, None)
                self.versions[served_id] = version
                version.job = self._spawn(self._bring_up(version))
            elif version.is_stopping:
                continue  # dropped once stopped; reconcile then starts it again
            elif version.state == "refused" and self.fits(version.need_bytes):
                version.state, version.reason = "verifying", None
                version.job = self._spawn(self._bring_up(version))
        for version in list(self.versions.values()):
            if version.served_id not in wanted and not version.is_stopping:
                version.is_stopping = True
                self._spawn(self._unwant(version))

    def is_settled(self) -> bool:
        """Every wanted version is ready, failed or refused (or past ready): what /readyz waits for."""
        return all(v.state in _SETTLED for v in self.versions.values() if v.served_id in self._wanted)

    def describe(self) -> dict[str, str]:
        """served_id -> its state, and for a loading one what its engines are doing (for /readyz)."""
        out = {}
        for served_id, v in sorted(self.versions.items()):
            doing = v.loader.describe() if v.state == "loading" and v.loader is not None else ""
            out[served_id] = f"{v.state}: {v.reason}" if v.reason else f"{v.state}{': ' + doing if doing else ''}"
        return out

    def statuses(self) -> dict[str, VersionStatus]:
        return {served_id: v.status() for served_id, v in self.versions.items()}

    def ready(self) -> list[Version]:
        return [v for v in self.versions.values() if v.state == "ready"]

    def routed(self) -> list[Version]:
        """Versions whose batch partitions heartbeats advertise: ready and draining ones."""
        return [v for v in self.versions.values() if v.state in ("ready", "draining") and v.server is not None]

    def on_cancel(self, cancel: Cancellation) -> None:
        """A cancel from the control topic, for every server (the request's may be any of them)."""
        for server in self.servers:
            server.on_cancel(cancel)

    def hosts_of(self, served_id: str) -> list[EngineHost]:
        version = self.versions.get(served_id)
        return list(version.hosts) if version is not None else []

    def reserved_bytes(self) -> int:
        return sum(v.budget_bytes for v in self.versions.values())

    def fits(self, need: int) -> bool:
        return need <= self.budget_total - self.reserved_bytes()

    async def run(self) -> None:
        """Check the goldens of every ready version every WEIR_GOLDEN_INTERVAL_S; raise when a
        version's engine failed (the worker stops, as it always did on an engine failure)."""
        interval = self.settings.golden_interval_s
        while True:
            if interval <= 0:
                await asyncio.shield(self._fatal)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._fatal), interval)
            if self._fatal.done():
                self._fatal.result()  # raises the engine's failure
            for version in self.ready():
                if version.goldens:
                    await self.check(version)

    async def check(self, version: Version) -> None:
        """Run the goldens of a ready version on each of its engines; on a departure: unhealthy,
        out of routing at once, rolled back when it is a fresh default, then reloaded."""
        problem = await self._run_goldens(version, version.hosts)
        if version.state != "ready" or problem is None:
            return
        version.golden_failures += 1
        # an engine that hangs (e.g. stalled by a compile) fails this check and is reloaded: say so
        log.error(
            "model version %s failed its golden check (%s): out of routing, its engines restarted",
            version.served_id,
            problem,
        )
        if version.server is not None:
            version.server.is_taking = False  # what runs finishes; nothing new starts on these weights
        self._set(version, "unhealthy", problem)
        await self.parts.emit(version.served_id, "golden_failed", problem)
        if self._roll_back_if_fresh(version, problem):
            return  # out of routing (unhealthy) until the rollback unloads it; then it drains
        if not version.is_stopping:
            version.job = self._spawn(self._reload(version))

    async def close(self) -> None:
        """Stop every job, server and engine (the worker is stopping)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for version in self.versions.values():
            await self._close_server(version)
            if version.loader is not None:
                await version.loader.discard()
            _stop_hosts(version.hosts)

    # -- the jobs -------------------------------------------------------------------------------

    async def _bring_up(self, version: Version) -> None:
        """verifying -> (budget) -> loading -> golden -> ready, or failed / refused."""

        async def steps() -> None:
            config = await self._verify(version)
            need = version.need_bytes = await self._need(version, config)
            if not self.fits(need):
                free = max(0, self.budget_total - self.reserved_bytes())
                raise _Stop(
                    "refused", f"needs {need} bytes, {free} of {self.budget_total} free on this worker", "refused"
                )
            version.budget_bytes = need
            await self._load(version, config)
            await self._serve(version, config)

        if await self._attempt(version, steps()):
            goldens = f"{len(version.goldens)} goldens ({version.golden_source})"
            await self.parts.emit(
                version.served_id, "loaded", f"digest {version.digest[:12]}, {version.budget_bytes} bytes, {goldens}"
            )
            # Its tokenizer and config are long-lived too; frozen while serving goes on (weir/heap.py).
            await freeze_new(f"{version.served_id} loaded")

    async def _reload(self, version: Version) -> None:
        """An unhealthy version: finish what runs (no new batches), close its server and engines,
        then verify its files again and load, check and serve them anew."""
        server = version.server
        if server is not None:
            server.is_taking = False
            while server.intake.in_flight:  # noqa: ASYNC110 - the intake sets no event; a poll per 50 ms is enough here
                await asyncio.sleep(0.05)
        await asyncio.shield(self._close_server(version))
        version.reloads += 1

        async def steps() -> None:
            config = await self._verify(version)
            await self._load(version, config)
            await self._serve(version, config)

        if await self._attempt(version, steps()):
            await self.parts.emit(version.served_id, "reloaded", f"reload {version.reloads}: goldens pass again")

    async def _attempt(self, version: Version, steps: Awaitable[None]) -> bool:
        """Run the steps of a (re)load; any failure ends the version failed (or refused) with its
        reason, its engines stopped: never half-loaded, never stuck in a state that settles nothing."""
        try:
            await steps
            return True
        except _Stop as stop:
            await self._fail(version, stop)
        except Exception as exc:  # the broker away while making its server, a bug
            log.exception("model version %s could not be brought up", version.served_id)
            await self._fail(version, _Stop("failed", f"{type(exc).__name__}: {exc}", "load_failed"))
        return False

    async def _unwant(self, version: Version) -> None:
        """A version no longer wanted: stop its job; drain its server when it has one; drop it."""
        was_loaded = version.server is not None or bool(version.hosts)
        job = version.job
        if job is not None and not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job
        if version.server is not None:
            await self._drain(version)
        if version.loader is not None:
            await version.loader.discard()
        _stop_hosts(version.hosts)
        del self.versions[version.served_id]
        self.parts.changed()
        if was_loaded:
            await self.parts.emit(version.served_id, "unloaded", "no longer wanted by the registry")
        self.reconcile(self._wanted)  # wanted again meanwhile, or a refused one that fits now

    async def _drain(self, version: Version) -> None:
        """docs/design.md, "The model registry": keep reading the batch topic until nothing is in
        flight, no batch came for WEIR_DRAIN_QUIET_MS and that long passed since draining began;
        then commit, leave the group (the consumer's stop) and stop the engines."""
        server = version.server
        assert server is not None
        if version.state != "unhealthy":  # an unhealthy one stays out of routing while it finishes
            self._set(version, "draining", version.reason)
        began, quiet = now_ms(), self.settings.drain_quiet_ms
        while True:
            now = now_ms()
            if not server.intake.in_flight and now - server.last_read_ms >= quiet and now - began >= quiet:
                break
            await asyncio.sleep(0.05)
        await self._close_server(version)

    # -- steps ----------------------------------------------------------------------------------

    async def _verify(self, version: Version) -> ModelConfig:
        """The version's files against its manifest, its signature against the trusted keys; the
        config to load. A models.toml entry not registered yet is packed (and registered) now: its
        manifest is what its directory holds, so there is nothing to check it against."""
        self._set(version, "verifying", None)
        record = version.record
        if record is None:
            assert version.seed is not None
            try:
                manifest = await self.parts.registry.seed_manifest(version.seed)
            except (OSError, ValueError) as exc:  # ManifestError, a GGUF or ONNX build that failed
                raise _Stop("failed", f"models.toml entry cannot be prepared: {exc}", "load_failed") from exc
            self._check_signature(
                ModelVersionRecord(manifest=manifest)
            )  # unsigned: loads unless signatures are required
        else:
            manifest = record.manifest
            self._check_signature(record)
            try:
                await asyncio.to_thread(verify_files, manifest)
            except ManifestError as exc:
                raise _Stop("failed", str(exc), "load_failed") from exc
        version.digest = manifest.digest()
        try:
            return manifest.config()
        except ValueError as exc:  # serving settings a models.toml entry could not have
            raise _Stop("failed", f"manifest serving settings: {exc}", "load_failed") from exc

    def _check_signature(self, record: ModelVersionRecord) -> None:
        problem = signature_problem(record, self.trusted_keys, self.settings.require_signed_models)
        if problem is not None:
            raise _Stop("failed", f"signature: {problem}", "load_failed")

    async def _need(self, version: Version, config: ModelConfig) -> int:
        record = version.record
        if record is not None and record.budget_bytes is not None:
            return record.budget_bytes
        if record is not None and record.budget_fraction is not None:
            return int(record.budget_fraction * self.device_bytes)
        try:
            return await self._estimate(config)
        except (OSError, ValueError) as exc:  # weights not where the manifest says
            raise _Stop("failed", f"cannot estimate its memory: {exc}", "load_failed") from exc

    async def _load(self, version: Version, config: ModelConfig) -> None:
        """loading: every engine instance opened and warmed up; golden: its goldens pass on each."""
        self._set(version, "loading", None)
        outputs = version.outputs = asyncio.Queue()  # read by the server built once the engines pass
        loader = version.loader = EngineLoader([config], self.parts.open_engine, {config.name: outputs.put_nowait})
        loader.start()
        try:
            version.hosts = (await loader.wait())[config.name]
        except Exception as exc:  # whatever the engine raised while it loaded, in its words
            await loader.discard()
            raise _Stop("failed", f"cannot load: {exc}", "load_failed") from exc
        for host in version.hosts:
            host.start()  # its engine loop runs now: goldens go through it (no request does before ready)
        self._set(version, "golden", None)
        if not version.goldens:
            await self._record_goldens(version, config)
        problem = await self._run_goldens(version, version.hosts)
        if problem is not None:
            _stop_hosts(version.hosts)
            version.hosts = []
            version.golden_failures += 1
            self._roll_back_if_fresh(version, problem)
            raise _Stop("failed", f"golden check failed: {problem}", "golden_failed")

    async def _record_goldens(self, version: Version, config: ModelConfig) -> None:
        """A version registered without goldens (a models.toml seed, a push without them): record
        them now, from the files just verified, in its first engine's own loop (greedy, its warmup
        prompts, as `weir models push` does). They stay on this worker (docs/design.md, "The model
        registry"): goldens are exact tokens of one device and dtype, and another worker's may differ.
        Kept across reloads, so a reload is checked against what the verified files produced first."""
        prompts = list(config.warmup)
        if not prompts:
            log.warning("model version %s has no goldens and no warmup prompts to record them with", version.served_id)
            return
        try:
            version.local_goldens = await asyncio.wait_for(
                version.hosts[0].record_goldens(prompts, GOLDEN_MAX_TOKENS), GOLDEN_TIMEOUT_S
            )
        except (RuntimeError, TimeoutError) as exc:  # the engine died, or a prompt did not complete
            raise _Stop("failed", f"goldens could not be recorded: {exc or 'timed out'}", "golden_failed") from exc

    async def _run_goldens(self, version: Version, hosts: list[EngineHost]) -> str | None:
        """The first departure of any engine from the version's goldens, or None."""
        if not version.goldens:
            return None
        try:
            for host in hosts:
                try:
                    problem = await asyncio.wait_for(host.check_goldens(version.goldens), GOLDEN_TIMEOUT_S)
                except RuntimeError as exc:  # the engine died meanwhile (its server's loop stops the worker)
                    problem = f"the golden check could not run: {exc}"
                except TimeoutError:  # an engine stopped under it (the version unloaded), or one that hangs
                    problem = f"the golden check did not answer within {GOLDEN_TIMEOUT_S:.0f} s"
                if problem is not None:
                    return problem
            return None
        finally:
            version.golden_checked_ms = now_ms()

    async def _serve(self, version: Version, config: ModelConfig) -> None:
        """ready: a ModelServer for the version joins its group and reads its topic."""
        assert version.outputs is not None
        server = await self.parts.make_server(config, version.hosts, version.outputs)
        version.server = server
        self.servers.append(server)
        version.serving = [self._spawn(server.consume(), fatal=True), self._spawn(server.publish(), fatal=True)]
        self._set(version, "ready", None)

    async def _close_server(self, version: Version) -> None:
        """Stop reading (the consumer commits what is durable and leaves the group), then the engines."""
        server = version.server
        for task in version.serving:
            task.cancel()
        await asyncio.gather(*version.serving, return_exceptions=True)
        version.serving = []
        if server is not None:
            self.servers.remove(server)
            version.server = None
        _stop_hosts(version.hosts)
        version.hosts = []

    async def _fail(self, version: Version, stop: _Stop) -> None:
        log.warning("model version %s %s: %s", version.served_id, stop.state, stop.reason)
        await self._close_server(version)
        if version.loader is not None:
            await version.loader.discard()
        version.budget_bytes = 0
        self._set(version, stop.state, stop.reason)
        await self.parts.emit(version.served_id, stop.event, stop.reason)

    def _roll_back_if_fresh(self, version: Version, why: str) -> bool:
        """shared protocol 5: the default version of its name, promoted within
        WEIR_ROLLBACK_WINDOW_S, failing its goldens is rolled back (weir.registry.rollback: the
        previous default loaded and routed to again, this one unloaded). True when a rollback
        started: it runs as a job of its own (_roll_back), the failing version out of routing."""
        state = self.parts.registry.state
        route = state.routes.get(version.name)
        if route is None or route.default_version != version.version or route.previous_version is None:
            return False
        if now_ms() - route.updated_ms > self.settings.rollback_window_s * 1000:
            return False
        records = rollback(state, version.served_id, why, by=f"worker {self.parts.worker_id}")
        if not records:
            return False
        self._spawn(self._roll_back(version, route.previous_version, records, why))
        return True

    async def _roll_back(self, version: Version, previous: str, records: list, why: str) -> None:
        """docs/design.md, "The model registry": the previous version wanted `loaded` first; the
        route switched back (and the failing version unloaded) only once this worker, which serves
        the name, has the previous one ready, or after WEIR_ROLLBACK_WARM_TIMEOUT_S anyway. So a
        rollback leaves no gap where the previous version can load. Not written (the broker away):
        the failing version is reloaded instead, like any departure."""
        back = served_id_of(version.name, previous)
        warm = [r for r in records if isinstance(r, ModelVersionRecord) and r.served_id == back]
        try:
            if warm:
                await self.parts.registry.write(warm)
            late = await self._wait_ready(back)
            # What the registry holds now: an operator may have routed the name elsewhere meanwhile.
            switch = [
                r
                for r in rollback(
                    self.parts.registry.state, version.served_id, why, by=f"worker {self.parts.worker_id}"
                )
                if not (isinstance(r, ModelVersionRecord) and r.served_id == back)
            ]
            if not any(isinstance(r, ModelRoute) and r.default_version == previous for r in switch):
                log.warning(
                    "rollback of %s not switched: the route of %s changed meanwhile", version.served_id, version.name
                )
                self._reload_if_unhealthy(version)
                return
            await self.parts.registry.write(switch)
        except (KafkaError, OSError, TimeoutError) as exc:
            log.error("rollback of %s not written (%r): reloaded instead", version.served_id, exc)
            self._reload_if_unhealthy(version)
            return
        note = f" ({late})" if late else f" ({back} ready here first)"
        await self.parts.emit(
            version.served_id, "rolled_back", f"default of {version.name} back to {previous}{note}: {why}"
        )

    def _reload_if_unhealthy(self, version: Version) -> None:
        """A rollback that did not happen: the failing version is reloaded, like any departure."""
        if version.state == "unhealthy" and not version.is_stopping and self.versions.get(version.served_id) is version:
            version.job = self._spawn(self._reload(version))

    async def _wait_ready(self, served_id: str) -> str | None:
        """Wait until `served_id` is ready on this worker: None, or why the route is switched without it
        (not ready within WEIR_ROLLBACK_WARM_TIMEOUT_S, or it failed or was refused here)."""
        limit = self.settings.rollback_warm_timeout_s
        deadline = asyncio.get_running_loop().time() + limit
        while True:
            held = self.versions.get(served_id)
            if held is not None and not held.is_stopping:
                if held.state == "ready":
                    return None
                if held.state in ("failed", "refused"):
                    return f"switched without {served_id}: it is {held.state} here: {held.reason}"
            if asyncio.get_running_loop().time() >= deadline:
                return f"switched without {served_id}: not ready here within WEIR_ROLLBACK_WARM_TIMEOUT_S={limit:g} s"
            await asyncio.sleep(0.05)

    def _set(self, version: Version, state: VersionState, reason: str | None) -> None:
        version.state, version.reason = state, reason
        self.parts.changed()

    def _spawn(self, coro, fatal: bool = False) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._on_done if fatal else _log_failure)
        return task

    def _on_done(self, task: asyncio.Task) -> None:
        """A server loop that raised (its engine died): the worker stops (run() raises it)."""
        failure = None if task.cancelled() else task.exception()
        if failure is not None and not self._fatal.done():
            self._fatal.set_exception(failure)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("model version job failed", exc_info=task.exception())


def _stop_hosts(hosts: list[EngineHost]) -> None:
    """Stop engine hosts with nothing in flight. A child process is told to stop and killed when it
    has not exited within 50 ms (nothing of it is kept), so the loop is never held long."""
    for host in hosts:
        with contextlib.suppress(RuntimeError):  # a thread host that never started
            host.stop(0.05 if isinstance(host, EngineProcess) else 1.0)
