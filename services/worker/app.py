"""Worker wiring: follow the model registry, bring up the versions it wants here, serve their
batches from Kafka until stopped.

Started, stopped and served (/healthz, /readyz, /metrics) by weir/service.py like every service;
/readyz answers 503 until every version the worker should hold is ready, failed or refused.
The versions' lifecycle is versions.py's (docs/design.md, "The model registry").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from schemas.codec import encode
from schemas.messages import DeviceInfo, VersionState, WorkerHeartbeat
from schemas.model_repo import ModelConfig, ModelRepoError, ModelRepository, load_model_repo
from schemas.registry import ModelHealthEvent, ModelManifest, ModelVersionRecord, RegistryState
from services.worker.config import WorkerSettings
from services.worker.hosts.engine_factory import build_engine, warm_up
from services.worker.hosts.faults import FaultHookError
from services.worker.hosts.hardware import DeviceProbe, choose_device, cpu_device, cpu_threads
from services.worker.hosts.memory import estimate_bytes
from services.worker.hosts.mirror_pacing import LivePressure, Pacing
from services.worker.hosts.runner import EngineHost, EngineProcess, EngineRunner
from services.worker.kafka.consumers import ModelServer, consume_cancellations, open_cancellations
from services.worker.kafka.fingerprints import FingerprintBatcher
from services.worker.kafka.finish_rate import FinishRate
from services.worker.kafka.membership import Membership
from services.worker.kafka.serving_metrics import ServingMetrics, kv_cache_usage
from services.worker.loading import OnOutputs, OnStatus
from services.worker.versions import ManagerParts, Outputs, VersionManager
from weir.bus import instance_id, make_producer, wait_for_cluster
from weir.embedding.fingerprints import build_fingerprinter
from weir.embedding.onnx_export import ensure_export
from weir.kafka.admin import ensure_topics
from weir.metrics import ServiceMetrics
from weir.models.manifest import pack
from weir.models.signing import SigningError, load_trusted_keys
from weir.models.sources import ensure_model_dir
from weir.registry import RegistryFollower, publish, seed_records
from weir.service import ConfigError, bus_overrides, ops_app, run_service, service_parser
from weir.tracing import Tracing

log = logging.getLogger(__name__)


class WorkerService:
    """One worker process: follows the model registry, holds the versions it should (versions.py),
    and sends its heartbeat; its control-topic reader passes cancels to every model server."""

    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = instance_id("worker")
        repo = self.repo = load_model_repo(settings.model_repo)
        # The models.toml entries this worker serves: registered by it when the registry lacks them.
        self.seeds = [c for name, c in repo.models.items() if settings.serves(name)]
        self.device = choose_device(settings.device)
        self.audit_key = settings.hmac_key()  # read (or made) now: a bad key file is a configuration error
        self.trusted_keys = load_trusted_keys(Path(settings.model_trusted_keys)) if settings.model_trusted_keys else {}
        self._ready = False  # latched by is_ready
        self.is_serving = False  # the loops run
        self._assignment_changed = asyncio.Event()  # a heartbeat goes out at once when set
        self.producer: AIOKafkaProducer | None = None
        self.registry: RegistryFollower | None = None
        self.versions: VersionManager | None = None
        self._fingerprinter: asyncio.Task[FingerprintBatcher | None] | None = None
        self.devices = DeviceProbe()
        self.live_pressure = LivePressure(settings.mirror_idle_ms)  # mirror copies yield to it (mirror_pacing.py)
        self.finish_rate = FinishRate()  # heartbeats' finished_per_s, sampled per heartbeat
        self.clock: Callable[[], float] = time.monotonic
        self.metrics = self._metrics()
        self.tracing = Tracing("worker", self.worker_id, settings)
        # vLLM's vllm:* and the GenAI server metrics, per version (docs/design.md, "Observability")
        self.serving = ServingMetrics(
            self.metrics,
            lambda: [(s.served_id, [r.stats for r in s.runners]) for s in self.servers],
            on_ran=lambda seconds: self.finish_rate.ran(seconds),
        )

    @property
    def is_ready(self) -> bool:
        """Once serving, every version it should hold settled (ready, failed, refused or past ready);
        latched when first seen, by whichever reader (heartbeat, /readyz, /metrics) looks first."""
        if not self._ready and self.is_serving and self.versions is not None and self.versions.is_settled():
            self._ready = True
            log.info("worker %s ready: %s on %s", self.worker_id, self.versions.describe(), self.device)
        return self._ready

    @property
    def servers(self) -> list[ModelServer]:
        return self.versions.servers if self.versions is not None else []

    async def start(self) -> None:
        """Connect, create the topics and start the producer (run() then follows the registry)."""
        await wait_for_cluster(self.settings)
        await ensure_topics(self.settings.kafka_bootstrap, self.settings.topics.core_specs())
        self.producer = make_producer(self.settings, self.worker_id)
        await self.producer.start()
        await self.tracing.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Read the registry, bring up the versions it wants here, then serve and follow it until
        `stop` is set or a loop fails. The version manager's parts are built before it, in order,
        and none refers back to it or to this service (docs/worker.md, "Code layout")."""
        producer = self.producer
        assert producer is not None, "start() first"
        tasks: list[asyncio.Task] = []
        try:
            # A first start exports the fingerprint model to ONNX here: after the HTTP port opened,
            # so /readyz can say so meanwhile. Servers wait for it (ServerFactory), engines load meanwhile.
            self._fingerprinter = asyncio.create_task(self._fingerprints())
            device_bytes = await self._device_bytes()
            budget = self.settings.worker_memory_bytes or int(device_bytes * self.settings.worker_memory_fraction)
            self.registry = RegistryFollower(self.settings, self.worker_id, self._on_registry, seed=self.repo)
            parts = ManagerParts(
                worker_id=self.worker_id,
                open_engine=EngineOpener(self.settings, self.device, self.live_pressure),
                make_server=ServerFactory(
                    self.settings,
                    producer,
                    self.worker_id,
                    self.audit_key,
                    self._fingerprinter,
                    self.tracing,
                    self.serving,
                    on_assignment=self._assignment_changed.set,
                ),
                registry=RegistryDesk(self.settings, self.worker_id, self.registry),
                emit=HealthEvents(self.settings, producer, self.worker_id),
                changed=self._assignment_changed.set,  # the heartbeat goes out; is_ready is read from the versions
            )
            estimate = functools.partial(estimate_here, settings=self.settings, device=self.device)
            self.versions = VersionManager(self.settings, parts, budget, self.trusted_keys, estimate, device_bytes)
            cancellations = await open_cancellations(self.settings, self.worker_id)
            await self.registry.start()
            tasks = self.loops(producer, cancellations)
            self.is_serving = True
            self.versions.reconcile(self.wanted())
            self._assignment_changed.set()
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            for task in done - {stopped}:
                task.result()
        finally:
            self._ready = self.is_serving = False
            # Stop the loops now, while the Kafka clients' own tasks still run: left to asyncio.run's
            # teardown, which cancels those too, each consumer's LeaveGroup got no answer read and
            # a SIGTERM took 44 s (the request timeout), leaving its partitions to the session timeout.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.registry is not None:
                await self.registry.stop()
            if self.versions is not None:
                await self.versions.close()
            if self._fingerprinter is not None:
                self._fingerprinter.cancel()
            with contextlib.suppress(Exception):  # shutting down: else the heartbeat simply goes stale
                await asyncio.wait_for(self.send_heartbeat(self.producer), 3)

    async def close(self) -> None:
        await self.tracing.stop()
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None
        self.devices.close()
        self.metrics.shutdown()

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """start, run until `stop` (or cancellation), close: a worker embedded in another program."""
        try:
            await self.start()
            await self.run(stop or asyncio.Event())
        finally:
            await self.close()

    # -- the registry ---------------------------------------------------------------------------

    def wanted(self) -> dict[str, ModelVersionRecord | ModelConfig]:
        """The versions this worker should hold now: every registered version operators want loaded
        of a name it serves, and its models.toml entries the registry does not hold yet (it
        registers them as it loads them)."""
        assert self.registry is not None
        state = self.registry.state
        out: dict[str, ModelVersionRecord | ModelConfig] = {
            r.served_id: r for r in state.wanted_loaded() if self.settings.serves(r.manifest.name)
        }
        for config in self.seeds:
            if config.served_id not in state.versions:
                out[config.served_id] = config
        return out

    def _on_registry(self) -> None:
        """A registry change, once it was read to its end: reconciling on a partial read would load
        what a later record unloads, or seed an entry whose record is further on."""
        if self.versions is not None and self.is_serving:
            self.versions.reconcile(self.wanted())

    # -- engines and servers --------------------------------------------------------------------

    async def _fingerprints(self) -> FingerprintBatcher | None:
        """The batcher of the AuditEvents' SimHashes, over the fingerprinter built off the loop (None: off)."""
        fingerprinter = await asyncio.to_thread(
            build_fingerprinter,
            self.settings.audit_fingerprint_model,
            self.repo,
            precision=self.settings.audit_fingerprint_precision,
            use_cuda=self.device.type == "cuda",
        )
        return FingerprintBatcher(fingerprinter) if fingerprinter is not None else None

    async def fingerprint(self) -> None:
        """Batch the AuditEvents' SimHashes once the fingerprinter is built (forever: off is no end)."""
        assert self._fingerprinter is not None
        fingerprints = await asyncio.shield(self._fingerprinter)
        if fingerprints is None:
            await asyncio.Event().wait()
        else:
            await fingerprints.run()

    async def _device_bytes(self) -> int:
        """The memory of the device the engines run on (the GPU's, else the machine's). The worker's
        budget is WEIR_WORKER_MEMORY_BYTES, else WEIR_WORKER_MEMORY_FRACTION of it."""
        devices = await self.devices.devices()
        kind = "cuda" if self.device.type == "cuda" else "cpu"
        total = next((d.memory_total_bytes for d in devices if d.kind == kind), 0)
        return total if total > 0 else cpu_device().memory_total_bytes

    def loops(self, producer: AIOKafkaProducer, cancellations: Any) -> list[asyncio.Task]:
        """The worker's loops: heartbeats, fingerprints, cancellations, the versions' golden checks
        (each ready version's consume and publish loops are the version manager's)."""
        assert self.versions is not None
        return [
            asyncio.create_task(self.heartbeat(producer)),
            asyncio.create_task(self.fingerprint()),
            asyncio.create_task(
                consume_cancellations(cancellations, self.settings, self.versions.on_cancel, producer, self.worker_id)
            ),
            asyncio.create_task(self.versions.run()),
        ]

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready once every version it should hold is ready, failed or refused (the body says which)."""
        versions = self.versions.describe() if self.versions is not None else {}
        body = {"worker_id": self.worker_id, "versions": versions, "device": str(self.device)}
        if self.is_ready:
            return True, {**body, "reason": None}
        if self.versions is None or self.registry is None:
            reason = "reading the model registry"
        elif self._fingerprinter is not None and not self._fingerprinter.done() and self.versions.is_settled():
            reason = f"building the audit fingerprinter ({self.settings.audit_fingerprint_model}, ONNX)"
        else:
            reason = "bringing up the model versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items())
        return False, {**body, "reason": reason}

    def http_app(self) -> ASGIApp:
        return ops_app(
            self.readiness,
            self.metrics.render,
            [Route("/faults/corrupt-weights", self.corrupt_weights, methods=["POST"])],
        )

    async def corrupt_weights(self, request: Request) -> Response:
        """POST /faults/corrupt-weights?model=<name@version>: the fault hook (WEIR_FAULT_HOOKS only)
        that corrupts every engine instance of a version in memory, for tests and demos of the
        golden checks. 404 when the hooks are off or the version is not loaded here."""
        if not self.settings.fault_hooks:
            return _error(404, "fault hooks are off (WEIR_FAULT_HOOKS=false)", "not_found")
        served_id = request.query_params.get("model", "")
        if not served_id:
            return _error(400, "name the version: ?model=name@version", "missing_model")
        hosts = self.versions.hosts_of(served_id) if self.versions is not None else []
        if not hosts:
            return _error(404, f"model version {served_id!r} is not loaded on this worker", "model_not_found")
        try:
            for host in hosts:
                await host.corrupt_weights()
        except FaultHookError as exc:  # an engine with nothing to corrupt (echo)
            return _error(400, f"{served_id}: {exc}", "fault_hook_refused")
        return JSONResponse({"model": served_id, "corrupted_instances": len(hosts)})

    def _metrics(self) -> ServiceMetrics:
        """Per version (label model=name@version), summed over its engine instances, read at scrape
        time from the engines' stats and the version manager."""
        metrics = ServiceMetrics("worker")

        def per_model(stat: str) -> Any:
            def observe() -> list[tuple[float, dict[str, str]]]:
                return [(sum(r.stats.get(stat, 0) for r in s.runners), {"model": s.served_id}) for s in self.servers]

            return observe

        def per_version(read: Callable[[Any], float]) -> Any:
            def observe() -> list[tuple[float, dict[str, str]]]:
                held = self.versions.versions.values() if self.versions is not None else []
                return [(read(v), {"model": v.served_id}) for v in held]

            return observe

        metrics.gauge(
            "weir_worker_ready",
            "1 once every version it should hold is ready, failed or refused.",
            lambda: [(int(self.is_ready), {})],
        )
        for stat, text in (
            ("num_running", "Sequences in the engines' decode loop."),
            ("num_waiting", "Sequences queued in the engines."),
            ("free_kv_blocks", "Free KV-cache blocks."),
        ):
            metrics.gauge(f"weir_worker_{stat}", text, per_model(stat))
        metrics.gauge(
            "weir_worker_requests_dropped",
            "Requests given up on since start: their reply topic refused "
            "writes (or they were a minute past their deadline); none of them was answered.",
            lambda: [(s.publisher.num_dropped, {"model": s.served_id}) for s in self.servers],
        )
        metrics.gauge(
            "weir_worker_mirrors_dropped",
            "Mirror copies ended rejected (mirror_dropped) since start: "
            "held back by live work for WEIR_MIRROR_MAX_WAIT_MS.",
            lambda: [(sum(r.num_mirrors_dropped for r in s.runners), {"model": s.served_id}) for s in self.servers],
        )
        metrics.gauge(
            "weir_worker_live_pressure",
            "1 while live requests run in this worker (engines holding only mirror copies then yield), else 0.",
            lambda: [(int(self.live_pressure.is_pressed), {})],
        )
        metrics.gauge(
            "weir_worker_invalid_reply_to",
            "Requests dead-lettered since start for a reply_to that is not one of the deployment's reply topics.",
            lambda: [(s.num_invalid_reply_to, {"model": s.served_id}) for s in self.servers],
        )
        metrics.gauge(
            "weir_worker_forged_batches",
            "Batches dead-lettered since start for naming another version than their topic's.",
            lambda: [(s.num_forged, {"model": s.served_id}) for s in self.servers],
        )

        def states() -> list[tuple[float, dict[str, str]]]:
            held = self.versions.versions.values() if self.versions is not None else []
            return [
                (int(v.state == s), {"model": v.served_id, "state": s}) for v in held for s in get_args(VersionState)
            ]

        metrics.gauge("weir_worker_version_state", "1 for the state each version is in on this worker.", states)
        metrics.gauge(
            "weir_worker_version_budget_bytes",
            "Memory slice given to each version (0: none yet, or refused).",
            per_version(lambda v: v.budget_bytes),
        )
        metrics.gauge(
            "weir_worker_golden_failures",
            "Golden checks of each version that departed from the recorded outputs, since start.",
            per_version(lambda v: v.golden_failures),
        )
        metrics.gauge(
            "weir_worker_version_reloads",
            "Reloads of each version from verified weights after a golden failure, since start.",
            per_version(lambda v: v.reloads),
        )
        metrics.gauge(
            "weir_worker_version_goldens",
            "Golden cases each version is checked against; source: registry "
            "(its record), local (recorded on this worker at its first load: its record had none) or none.",
            lambda: [
                (len(v.goldens), {"model": v.served_id, "source": v.golden_source})
                for v in (self.versions.versions.values() if self.versions is not None else [])
            ],
        )
        metrics.gauge(
            "weir_worker_memory_budget_bytes",
            "Memory all versions of this worker may take.",
            lambda: [(self.versions.budget_total if self.versions is not None else 0, {})],
        )
        return metrics

    # -- heartbeats -----------------------------------------------------------------------------

    def heartbeat_message(self, devices: list[DeviceInfo]) -> WorkerHeartbeat:
        """shared protocol 1: `models` = the ready versions; partitions and next offsets of ready and
        draining ones (batches still reach a draining version); every version held or tried; the
        drain rate (finish_rate.py), sampled once per heartbeat."""
        held = self.versions
        ready = held.ready() if held is not None else []
        routed = held.routed() if held is not None else []
        stats = [r.stats for v in routed for r in v.hosts]
        owned = {v.served_id: v.server.owned_partitions() for v in routed if v.server is not None}
        servers = self.servers
        self.finish_rate.sample(
            self.clock(), sum(s.intake.num_done for s in servers), any(s.intake.in_flight for s in servers)
        )
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            models=[v.served_id for v in ready],
            is_ready=self.is_ready,
            num_running=int(sum(s.get("num_running", 0) for s in stats)),
            num_waiting=int(sum(s.get("num_waiting", 0) for s in stats)),
            max_num_seqs=max(
                1, sum(v.server.config.max_num_seqs * len(v.hosts) for v in ready if v.server is not None)
            ),
            free_kv_blocks=int(sum(s.get("free_kv_blocks", 0) for s in stats)),
            block_size_tokens=self.settings.block_size,
            kv_cache_usage_perc=kv_cache_usage(stats),
            prefix_cache_queries=int(sum(s.get("prefix_cache_queries", 0) for s in stats)),
            prefix_cache_hits=int(sum(s.get("prefix_cache_hits", 0) for s in stats)),
            partitions={m: p for m, (p, _) in owned.items()},
            next_offsets={m: o for m, (_, o) in owned.items()},
            devices=devices,
            versions=held.statuses() if held is not None else {},
            latency={
                v.served_id: v.server.publisher.recorder.latency()
                for v in routed
                if v.server is not None and v.server.publisher.recorder is not None
            },
            finished_per_s=self.finish_rate.per_s(),
            service_s=self.finish_rate.service_s(),
        )

    async def send_heartbeat(self, producer: AIOKafkaProducer) -> None:
        message = self.heartbeat_message(await self.devices.devices())
        await producer.send_and_wait(self.settings.topics.workers, encode(message), key=self.worker_id.encode())

    async def heartbeat(self, producer: AIOKafkaProducer) -> None:
        while True:
            self._assignment_changed.clear()
            try:
                await self.send_heartbeat(producer)
            except KafkaError as exc:  # the broker is away: batchers see this worker again with the next one
                log.warning("heartbeat not written (%r)", exc)
            for server in self.servers:
                server.forget_old_cancels()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._assignment_changed.wait(), self.settings.heartbeat_interval_ms / 1000)


class EngineOpener:
    """Opens one engine instance of a version, built and warmed up, in the host the settings ask for
    (loading.OpenEngine, for the version manager); `on_status` hears what an engine process is doing
    while it loads."""

    def __init__(self, settings: WorkerSettings, device: torch.device, live_pressure: LivePressure) -> None:
        self.settings = settings
        self.device = device
        self.live_pressure = live_pressure  # mirror copies yield to it (mirror_pacing.py)

    async def __call__(
        self, config: ModelConfig, on_outputs: OnOutputs, on_status: OnStatus | None = None
    ) -> EngineHost:
        if self.settings.engine_isolation == "process" and config.engine != "echo":
            process = EngineProcess(
                config, self.settings, str(self.device), asyncio.get_running_loop(), on_outputs, on_status
            )
            try:
                await process.open()
            except BaseException:
                process.stop(1.0)
                raise
            process.attach_pressure(self.live_pressure)
            return process
        engine = await asyncio.to_thread(build_engine, config, self.settings, self.device)
        await asyncio.to_thread(warm_up, engine, config, self.settings.grammar_prewarm)
        runner = EngineRunner(
            engine,
            asyncio.get_running_loop(),
            on_outputs,
            fault_hooks=self.settings.fault_hooks,
            pacing=Pacing.of(self.settings),
        )
        runner.attach_pressure(self.live_pressure)
        return runner


class ServerFactory:
    """Builds a version's ModelServer over its opened engines, reading the queue they put their outputs
    on (for the version manager); its batch topic exists."""

    def __init__(
        self,
        settings: WorkerSettings,
        producer: AIOKafkaProducer,
        worker_id: str,
        audit_key: bytes,
        fingerprints: asyncio.Task[FingerprintBatcher | None],
        tracing: Tracing,
        serving: ServingMetrics,
        on_assignment: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.worker_id = worker_id
        self.audit_key = audit_key
        self.fingerprints = fingerprints  # the SimHash batcher being built (its result None: fingerprints off)
        self.tracing = tracing
        self.serving = serving
        self.on_assignment = on_assignment  # a server's partitions changed: heartbeat now

    async def __call__(self, config: ModelConfig, hosts: list[EngineHost], outputs: Outputs) -> ModelServer:
        fingerprints = await asyncio.shield(self.fingerprints)  # its AuditEvents carry SimHashes from the first one
        topic = self.settings.topics.batches(config.served_id)
        try:
            await ensure_topics(self.settings.kafka_bootstrap, self.settings.topics.model_specs(config.served_id))
        except KafkaError as exc:  # secure mode: only the batcher may create it; read once it exists
            log.warning("batch topic %s not created here (%r); the consumer reads it once it exists", topic, exc)
        return ModelServer(
            config,
            hosts,
            self.settings,
            self.producer,
            self.worker_id,
            self.audit_key,
            fingerprints,
            tracing=self.tracing,
            recorder=self.serving.recorder(config),
            membership=Membership.of(self.settings),
            outputs=outputs,
            on_assignment=self.on_assignment,
        )


class RegistryDesk:
    """The model registry as the version manager uses it: the follower's state, models.toml entries
    seeded, records written."""

    def __init__(self, settings: WorkerSettings, worker_id: str, follower: RegistryFollower) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.follower = follower

    @property
    def state(self) -> RegistryState:
        return self.follower.state

    async def seed_manifest(self, config: ModelConfig) -> ModelManifest:
        """A models.toml entry's directory built (GGUF import, ONNX export: weir/models/sources.py),
        packed, and registered with its route when the registry still lacks them (weir.registry.
        seed_records: several workers may do it at once; a version's files are the same for all)."""
        built = await asyncio.to_thread(built_entry, config)
        single = ModelRepository(models={config.name: built})
        records = await asyncio.to_thread(seed_records, single, self.state, f"models.toml ({self.worker_id})")
        if records:
            await publish(self.settings, records, client_id=self.worker_id)
        packed = [r.manifest for r in records if isinstance(r, ModelVersionRecord)]
        return packed[0] if packed else await asyncio.to_thread(pack, built)

    async def write(self, records: list) -> None:
        await publish(self.settings, records, client_id=self.worker_id)


class HealthEvents:
    """ModelHealthEvents of this worker's versions on Topics.model_health; lost with a log line when
    the broker is away."""

    def __init__(self, settings: WorkerSettings, producer: AIOKafkaProducer, worker_id: str) -> None:
        self.settings = settings
        self.producer = producer
        self.worker_id = worker_id

    async def __call__(self, served_id: str, event: str, detail: str) -> None:
        message = ModelHealthEvent(worker_id=self.worker_id, model=served_id, event=event, detail=detail[:4096])
        try:
            await self.producer.send_and_wait(
                self.settings.topics.model_health, encode(message), key=served_id.encode()
            )
        except KafkaError as exc:
            log.warning("health event %s of %s not written (%r)", event, served_id, exc)


async def estimate_here(config: ModelConfig, *, settings: WorkerSettings, device: torch.device) -> int:
    """The bytes a version takes on this worker's device when its record names no budget (memory.py)."""
    return await asyncio.to_thread(estimate_bytes, config, settings, device)


def _error(status: int, message: str, code: str) -> JSONResponse:
    """An error body in OpenAI's format."""
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}}, status_code=status
    )


def built_entry(config: ModelConfig) -> ModelConfig:
    """A models.toml entry with `path` set to the directory it is served from, built first when
    Weir makes it (a GGUF source imported, an ONNX package exported); an echo entry as it is."""
    if config.engine == "echo":
        return config
    if config.engine == "onnx":
        return config.model_copy(update={"path": ensure_export(config)})
    return config.model_copy(update={"path": ensure_model_dir(config)})


def build_parser() -> argparse.ArgumentParser:
    """`weir worker`'s flags: the common service flags (weir/service.py) and its own."""
    parser = service_parser("worker", "Serve the model repository's models from Kafka.", 8120, "WEIR_WORKER_HTTP_PORT")
    parser.add_argument("--models", help="comma-separated models to serve (env WEIR_MODELS; default: all)")
    parser.add_argument("--model-repo", help="model repository TOML (env WEIR_MODEL_REPO)")
    return parser


def build(args: argparse.Namespace) -> tuple[WorkerService, str, int]:
    """The service from flags over WEIR_* settings; a bad setting or model entry is a ConfigError."""
    overrides = {
        **bus_overrides(args),
        "models": args.models,
        "model_repo": args.model_repo,
        "worker_http_port": args.http_port,
    }
    try:
        settings = WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
        torch.set_num_threads(cpu_threads(settings.threads))
        logging.getLogger(__name__).info(
            "engine threads: %d (WEIR_ENGINE_THREADS=%s, %d cores)",
            torch.get_num_threads(),
            settings.threads or "0: default",
            os.cpu_count() or 1,
        )
        return WorkerService(settings), settings.http_host, settings.worker_http_port
    except (ModelRepoError, SigningError) as exc:  # a bad models.toml, a trusted key that is not one
        raise ConfigError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    """`weir worker`: serve the model repository's models from Kafka until SIGINT/SIGTERM."""
    return run_service("worker", argv, build_parser(), build)
