"""Worker wiring: load engines, warm them up, then serve batches from Kafka until stopped.

Started, stopped and served (/healthz, /readyz, /metrics) by weir/service.py like every service;
/readyz answers 503 while the models load and warm up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import torch
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from starlette.types import ASGIApp

from schemas.codec import encode
from schemas.messages import WorkerHeartbeat
from schemas.model_repo import ModelConfig, ModelRepoError, load_model_repo
from services.worker.config import WorkerSettings
from services.worker.engine_factory import build_engine, warm_up
from services.worker.fingerprints import FingerprintBatcher
from services.worker.handlers import ModelServer, consume_cancellations, open_cancellations
from services.worker.hardware import choose_device, cpu_threads, detect_devices
from services.worker.loading import EngineLoader
from services.worker.runner import EngineHost, EngineProcess, EngineRunner
from weir.bus import instance_id, make_producer, wait_for_cluster
from weir.embedding.fingerprints import build_fingerprinter
from weir.kafka.admin import ensure_topics
from weir.metrics import ServiceMetrics
from weir.service import ConfigError, bus_overrides, ops_app, run_service, service_parser

log = logging.getLogger(__name__)


class WorkerService:
    """All model servers of one worker process, its heartbeat and its control-topic reader."""

    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = instance_id("worker")
        repo = self.repo = load_model_repo(settings.model_repo)
        self.configs = [repo.models[n] for n in settings.model_names(list(repo.models))]
        self.device = choose_device(settings.device)
        self.audit_key = settings.hmac_key()  # read (or made) now: a bad key file is a configuration error
        self.is_ready = False
        self.servers: list[ModelServer] = []
        self._assignment_changed = asyncio.Event()  # a heartbeat goes out at once when set
        self.producer: AIOKafkaProducer | None = None
        self.fingerprints: FingerprintBatcher | None = None
        self.metrics = self._metrics()
        self.loader = EngineLoader(self.configs, self.open_engine)
        self.is_building_fingerprinter = False

    async def start(self) -> None:
        """Begin loading the engines, then create the topics and start the producer while they
        load (run() waits for them, its /readyz saying how far they got)."""
        self.loader.start()
        await wait_for_cluster(self.settings)
        topics = self.settings.topics
        specs = topics.core_specs() + [s for c in self.configs for s in topics.model_specs(c.name)]
        await ensure_topics(self.settings.kafka_bootstrap, specs)
        self.producer = make_producer(self.settings, self.worker_id)
        await self.producer.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Build the fingerprinter while the engines finish loading, then serve until `stop` is set
        or a loop fails."""
        assert self.producer is not None, "start() first"
        tasks: list[asyncio.Task] = []
        try:
            # A first start exports the fingerprint model to ONNX here (or waits for the engine
            # process that does): after the HTTP port opened, so /readyz can say so meanwhile.
            self.is_building_fingerprinter = True
            fingerprinter, hosts = await asyncio.gather(
                asyncio.to_thread(build_fingerprinter, self.settings.audit_fingerprint_model, self.repo),
                self.loader.wait(),
            )  # fmt: skip
            self.is_building_fingerprinter = False
            self.fingerprints = FingerprintBatcher(fingerprinter) if fingerprinter is not None else None
            self.open_servers(self.producer, hosts)
            cancellations = await open_cancellations(self.settings, self.worker_id)
            self.is_ready = True
            log.info("worker %s ready: %s on %s", self.worker_id, [c.name for c in self.configs], self.device)
            tasks = self.loops(self.producer, cancellations)
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            for task in done - {stopped}:
                task.result()
        finally:
            self.is_ready = False
            # Stop the loops now, while the Kafka clients' own tasks still run: left to asyncio.run's
            # teardown, which cancels those too, each consumer's LeaveGroup got no answer read and
            # a SIGTERM took 44 s (the request timeout), leaving its partitions to the session timeout.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for server in self.servers:
                for runner in server.runners:
                    runner.stop(1.0)
            with contextlib.suppress(Exception):  # shutting down: else the heartbeat simply goes stale
                await asyncio.wait_for(self.send_heartbeat(self.producer), 3)

    async def close(self) -> None:
        if not self.servers:  # stopped before serving (Kafka away, a model that cannot load, a signal)
            await self.loader.discard()
        if self.producer is not None:
            await self.producer.stop()
            self.producer = None
        self.metrics.shutdown()

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """start, run until `stop` (or cancellation), close: a worker embedded in another program."""
        try:
            await self.start()
            await self.run(stop or asyncio.Event())
        finally:
            await self.close()

    def open_servers(self, producer: AIOKafkaProducer, hosts: dict[str, list[EngineHost]]) -> None:
        """One ModelServer per model over its opened engine instances, which start stepping now."""
        for config in self.configs:
            server = ModelServer(config, hosts[config.name], self.settings, producer, self.worker_id, self.audit_key,
                                 self.fingerprints)  # fmt: skip
            server.on_assignment = self._assignment_changed.set
            self.loader.deliver_to(config.name, server.on_outputs)
            self.servers.append(server)
            for runner in server.runners:
                runner.start()

    def loops(self, producer: AIOKafkaProducer, cancellations: Any) -> list[asyncio.Task]:
        """The worker's loops: heartbeats, fingerprints, cancellations, each server's consume and publish."""
        tasks = [asyncio.create_task(self.heartbeat(producer))]
        if self.fingerprints is not None:
            tasks.append(asyncio.create_task(self.fingerprints.run()))
        tasks.append(asyncio.create_task(
            consume_cancellations(cancellations, self.settings, self.servers, producer, self.worker_id)
        ))  # fmt: skip
        for server in self.servers:
            tasks += [asyncio.create_task(server.consume()), asyncio.create_task(server.publish())]
        return tasks

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready once every engine is warmed up and the loops run."""
        body = {"worker_id": self.worker_id, "models": [c.name for c in self.configs], "device": str(self.device)}
        if self.is_ready:
            return True, {**body, "reason": None}
        loading = self.loader.describe()
        if loading:
            reason = f"loading the models: {loading}"
        elif self.is_building_fingerprinter:
            reason = f"building the audit fingerprinter ({self.settings.audit_fingerprint_model}, ONNX)"
        else:
            reason = "starting the model servers"
        return False, {**body, "reason": reason}

    def http_app(self) -> ASGIApp:
        return ops_app(self.readiness, self.metrics.render)

    def _metrics(self) -> ServiceMetrics:
        """Per model, summed over its engine instances, read at scrape time from the engines' stats."""
        metrics = ServiceMetrics("worker")

        def per_model(stat: str) -> Any:
            def observe() -> list[tuple[float, dict[str, str]]]:
                return [(sum(r.stats.get(stat, 0) for r in s.runners), {"model": s.config.name}) for s in self.servers]

            return observe

        metrics.gauge("weir_worker_ready", "1 once every engine is warmed up and serving.", lambda: [(int(self.is_ready), {})])
        for stat, text in (("num_running", "Sequences in the engines' decode loop."),
                           ("num_waiting", "Sequences queued in the engines."),
                           ("free_kv_blocks", "Free KV-cache blocks.")):  # fmt: skip
            metrics.gauge(f"weir_worker_{stat}", text, per_model(stat))
        metrics.gauge("weir_worker_requests_dropped", "Requests given up on since start: their reply topic refused "
                      "writes (or they were a minute past their deadline); none of them was answered.",
                      lambda: [(s.publisher.num_dropped, {"model": s.config.name}) for s in self.servers])  # fmt: skip
        metrics.gauge("weir_worker_invalid_reply_to", "Requests dead-lettered since start for a reply_to that is not "
                      "one of the deployment's reply topics.",
                      lambda: [(s.num_invalid_reply_to, {"model": s.config.name}) for s in self.servers])  # fmt: skip
        return metrics

    async def open_engine(self, config: ModelConfig, on_outputs, on_status=None) -> EngineHost:
        """One engine instance of `config`, built and warmed up, in the host the settings ask for;
        `on_status` hears what an engine process is doing while it loads."""
        if self.settings.engine_isolation == "process" and config.engine != "echo":
            process = EngineProcess(config, self.settings, str(self.device), asyncio.get_running_loop(), on_outputs,
                                    on_status)  # fmt: skip
            try:
                await process.open()
            except BaseException:
                process.stop(1.0)
                raise
            return process
        engine = await asyncio.to_thread(build_engine, config, self.settings, self.device)
        await asyncio.to_thread(warm_up, engine, config)
        return EngineRunner(engine, asyncio.get_running_loop(), on_outputs, fault_hooks=self.settings.fault_hooks)

    def heartbeat_message(self) -> WorkerHeartbeat:
        stats = [r.stats for s in self.servers for r in s.runners]
        owned = {s.config.name: s.owned_partitions() for s in self.servers}
        return WorkerHeartbeat(
            worker_id=self.worker_id, models=[c.name for c in self.configs], is_ready=self.is_ready,
            num_running=int(sum(s["num_running"] for s in stats)), num_waiting=int(sum(s["num_waiting"] for s in stats)),
            max_num_seqs=sum(c.max_num_seqs * c.instances for c in self.configs),
            free_kv_blocks=int(sum(s["free_kv_blocks"] for s in stats)), block_size_tokens=self.settings.block_size,
            partitions={m: p for m, (p, _) in owned.items()}, next_offsets={m: o for m, (_, o) in owned.items()},
            devices=detect_devices(),
        )  # fmt: skip

    async def send_heartbeat(self, producer: AIOKafkaProducer) -> None:
        await producer.send_and_wait(self.settings.topics.workers, encode(self.heartbeat_message()),
                                     key=self.worker_id.encode())  # fmt: skip

    async def heartbeat(self, producer: AIOKafkaProducer) -> None:
        while True:
            try:
                await self.send_heartbeat(producer)
            except KafkaError as exc:  # the broker is away: batchers see this worker again with the next one
                log.warning("heartbeat not written (%r)", exc)
            for server in self.servers:
                server.forget_old_cancels()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._assignment_changed.wait(), self.settings.heartbeat_interval_ms / 1000)
            self._assignment_changed.clear()


def build_parser() -> argparse.ArgumentParser:
    """`weir worker`'s flags: the common service flags (weir/service.py) and its own."""
    parser = service_parser("worker", "Serve the model repository's models from Kafka.", 8120, "WEIR_WORKER_HTTP_PORT")
    parser.add_argument("--models", help="comma-separated models to serve (env WEIR_MODELS; default: all)")
    parser.add_argument("--model-repo", help="model repository TOML (env WEIR_MODEL_REPO)")
    return parser


def build(args: argparse.Namespace) -> tuple[WorkerService, str, int]:
    """The service from flags over WEIR_* settings; a bad setting or model entry is a ConfigError."""
    overrides = {**bus_overrides(args), "models": args.models, "model_repo": args.model_repo,
                 "worker_http_port": args.http_port}
    try:
        settings = WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
        torch.set_num_threads(cpu_threads(settings.torch_threads))
        return WorkerService(settings), settings.http_host, settings.worker_http_port
    except ModelRepoError as exc:
        raise ConfigError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    """`weir worker`: serve the model repository's models from Kafka until SIGINT/SIGTERM."""
    return run_service("worker", argv, build_parser(), build)
