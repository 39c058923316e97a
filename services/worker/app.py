"""Worker wiring: load engines, warm them up, then serve batches from Kafka until stopped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import torch
from aiokafka.errors import KafkaError

from schemas.codec import encode
from schemas.fingerprint import parse_key
from schemas.messages import WorkerHeartbeat
from schemas.model_repo import ModelConfig, ModelRepoError, load_model_repo
from services.worker.config import WorkerSettings
from services.worker.engine_factory import build_engine, warm_up
from services.worker.fingerprints import FingerprintBatcher
from services.worker.handlers import ModelServer, consume_cancellations, open_cancellations
from services.worker.hardware import choose_device, cpu_threads, detect_devices
from services.worker.runner import EngineHost, EngineProcess, EngineRunner
from weir.bus import instance_id, make_producer
from weir.embedding.fingerprints import build_fingerprinter
from weir.kafka.admin import ensure_topics

log = logging.getLogger("weir.worker")


class WorkerService:
    """All model servers of one worker process, its heartbeat and its control-topic reader."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = instance_id("worker")
        repo = self.repo = load_model_repo(settings.model_repo)
        self.configs = [repo.models[n] for n in settings.model_names(list(repo.models))]
        self.device = choose_device(settings.device)
        self.is_ready = False
        self.servers: list[ModelServer] = []
        self._assignment_changed = asyncio.Event()  # a heartbeat goes out at once when set

    async def run(self) -> None:
        topics = self.settings.topics
        specs = topics.core_specs() + [s for c in self.configs for s in topics.model_specs(c.name)]
        await ensure_topics(self.settings.kafka_bootstrap, specs)
        producer = make_producer(self.settings, self.worker_id)
        await producer.start()
        audit_key = parse_key(self.settings.audit_hmac_key)
        fingerprinter = await asyncio.to_thread(build_fingerprinter, self.settings.audit_fingerprint_model, self.repo)
        fingerprints = FingerprintBatcher(fingerprinter) if fingerprinter is not None else None
        tasks: list[asyncio.Task] = []
        try:
            for config in self.configs:
                server = ModelServer(config, [], self.settings, producer, self.worker_id, audit_key, fingerprints)
                server.on_assignment = self._assignment_changed.set
                for _ in range(config.instances):
                    server.runners.append(await self.open_engine(config, server.on_outputs))
                for runner in server.runners:
                    runner.start()
                self.servers.append(server)
            cancellations = await open_cancellations(self.settings, self.worker_id)
            self.is_ready = True
            log.info("worker %s ready: %s on %s", self.worker_id, [c.name for c in self.configs], self.device)
            tasks.append(asyncio.create_task(self.heartbeat(producer)))
            if fingerprints is not None:
                tasks.append(asyncio.create_task(fingerprints.run()))
            tasks.append(asyncio.create_task(
                consume_cancellations(cancellations, self.settings, self.servers, producer, self.worker_id)
            ))
            for server in self.servers:
                tasks += [asyncio.create_task(server.consume()), asyncio.create_task(server.publish())]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
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
            try:
                await asyncio.wait_for(producer.send_and_wait(topics.workers, encode(self.heartbeat_message()), key=self.worker_id.encode()), 3)
            except Exception:  # shutting down: the heartbeat simply goes stale
                pass
            await producer.stop()

    async def open_engine(self, config: ModelConfig, on_outputs) -> EngineHost:
        """One engine instance of `config`, built and warmed up, in the host the settings ask for."""
        if self.settings.engine_isolation == "process" and config.engine != "echo":
            process = EngineProcess(config, self.settings, str(self.device), asyncio.get_running_loop(), on_outputs)
            try:
                await process.open()
            except BaseException:
                process.stop(1.0)
                raise
            return process
        engine = await asyncio.to_thread(build_engine, config, self.settings, self.device)
        await asyncio.to_thread(warm_up, engine, config)
        return EngineRunner(engine, asyncio.get_running_loop(), on_outputs)

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

    async def heartbeat(self, producer) -> None:
        topic = self.settings.topics.workers
        while True:
            try:
                await producer.send_and_wait(topic, encode(self.heartbeat_message()), key=self.worker_id.encode())
            except KafkaError as exc:  # the broker is away: batchers see this worker again with the next one
                log.warning("heartbeat not written (%r)", exc)
            for server in self.servers:
                server.forget_old_cancels()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._assignment_changed.wait(), self.settings.heartbeat_interval_ms / 1000)
            self._assignment_changed.clear()


def main(argv: list[str] | None = None) -> int:
    """`weir worker`: serve the model repository's models from Kafka until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="weir worker", description=main.__doc__)
    parser.add_argument("--models", help="comma-separated models to serve (default: all)")
    parser.add_argument("--model-repo", help="model repository TOML")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in {"models": args.models, "model_repo": args.model_repo}.items() if v}
    try:
        settings = WorkerSettings(**overrides)
        torch.set_num_threads(cpu_threads(settings.torch_threads))
        service = WorkerService(settings)
    except (ValueError, ModelRepoError) as exc:
        print(f"weir worker: {exc}", file=sys.stderr)
        return 2
    return _run_until_signal(service.run())


def _run_until_signal(coro) -> int:
    async def runner() -> int:
        task = asyncio.create_task(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            return 0
        return 0

    try:
        return asyncio.run(runner())
    except Exception as exc:
        log.error("worker stopped: %s", exc)
        return 1
