"""Batcher wiring: Kafka clients from settings, the one asyncio loop, signals, and `main`.

    weir batcher [--bootstrap HOST:PORT] [--topic-prefix P] [--model-repo models.toml]

One loop round: wait for request records (at most until the planner's next wakeup), admit them,
apply cancellations, take worker heartbeats into the router, close the batches that are due (each
routed to a worker's partition), await every produce of the round and commit
what is durable. Shutdown (SIGTERM/SIGINT) finishes the round, commits, and closes: held requests
are not flushed, they are redone by the partitions' next owner.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas.messages import now_ms
from schemas.model_repo import ModelRepoError, ModelRepository, load_model_repo
from services.batcher.config import BatcherSettings
from services.batcher.jobs import JobRunner
from services.batcher.handlers import BatcherHandlers, BatchPublishError, RebalanceListener
from services.batcher.planner import Planner
from services.batcher.routing import Router
from weir.bus import instance_id, make_consumer, make_producer
from weir.kafka.admin import deployment_specs, ensure_topics

log = logging.getLogger("weir.batcher")


class BatcherApp:
    """One batcher replica: its Kafka clients, planner and handlers, built from settings."""

    def __init__(self, settings: BatcherSettings, repo: ModelRepository, batcher_id: str | None = None) -> None:
        self.settings = settings
        self.batcher_id = batcher_id or instance_id("batcher")
        topics = settings.topics
        self.producer = make_producer(settings, client_id=self.batcher_id)
        self.requests = make_consumer(
            settings,
            client_id=self.batcher_id,
            group_id=topics.batcher_group,
            max_poll_records=settings.max_poll_records,
        )
        self.control = make_consumer(
            settings, client_id=f"{self.batcher_id}-control", group_id=None, auto_offset_reset="latest"
        )
        # Heartbeats: every replica reads the whole compacted workers topic, from the beginning.
        self.workers = make_consumer(
            settings, client_id=f"{self.batcher_id}-workers", group_id=None, auto_offset_reset="earliest"
        )
        self.planner = Planner(repo, max_recent=settings.max_recent_ids, max_batch_bytes=settings.max_batch_bytes)
        self.router = Router(worker_timeout_ms=settings.worker_timeout_ms, prefix_chars=settings.prefix_affinity_chars)
        self.handlers = BatcherHandlers(
            topics, self.planner, self.producer, self.requests, self.batcher_id, router=self.router,
            commit_interval_ms=settings.commit_interval_ms,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; raises BatchPublishError when a batch cannot be produced."""
        topics = self.settings.topics
        started: list[Any] = []
        try:
            for client in (self.producer, self.requests, self.control, self.workers):
                await client.start()
                started.append(client)
            partitions = await self.producer.partitions_for(topics.control)  # waits for metadata
            await _follow_control(self.control, topics.control, partitions, self.settings.control_lookback_ms)
            await self._read_heartbeats_to_end()
            self.requests.subscribe([topics.requests], listener=RebalanceListener(self.handlers))
            log.info("batcher %s reading %s", self.batcher_id, topics.requests)
            while not stop.is_set():
                await self.step()
            await self.handlers.commit()  # a clean stop leaves nothing durable uncommitted
        finally:
            # Only durable effects were committed; what is held is redone by the next owner.
            for client in reversed(started):
                await client.stop()
            log.info("batcher %s stopped, %d requests uncommitted", self.batcher_id, self.handlers.num_in_flight)

    async def step(self) -> None:
        """One loop round; sleeps at most until the planner's next wakeup or the next record."""
        now = now_ms()
        wakeup = self.planner.next_wakeup_ms(now)
        idle_ms = self.settings.max_idle_wait_ms
        timeout_ms = idle_ms if wakeup is None else min(max(wakeup - now, 0), idle_ms)
        fetched = await self.requests.getmany(timeout_ms=timeout_ms)
        await self.handlers.on_requests(fetched, now_ms())
        await self.handlers.on_cancels(await self.control.getmany(timeout_ms=0))
        self.handlers.on_heartbeats(await self.workers.getmany(timeout_ms=0))
        await self.handlers.on_tick(now_ms())
        await self.handlers.settle()


    async def _read_heartbeats_to_end(self) -> None:
        """Assign the workers topic from the beginning and read it up to its current end, so the
        first batches are routed with the whole live-worker table."""
        topic = self.settings.topics.workers
        tps = [TopicPartition(topic, p) for p in sorted(await self.producer.partitions_for(topic))]
        self.workers.assign(tps)
        await self.workers.seek_to_beginning(*tps)
        ends = await self.workers.end_offsets(tps)
        for tp, end in ends.items():
            while await self.workers.position(tp) < end:
                self.handlers.on_heartbeats(await self.workers.getmany(tp, timeout_ms=200))
        log.info("batcher %s knows %d worker heartbeats", self.batcher_id, self.router.num_workers)


async def _follow_control(control: AIOKafkaConsumer, topic: str, partitions: set[int], lookback_ms: int) -> None:
    """Read every partition of the control topic from `lookback_ms` ago (or its end)."""
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    control.assign(tps)
    since = await control.offsets_for_times({tp: now_ms() - lookback_ms for tp in tps})
    for tp in tps:
        found = since.get(tp)
        if found is None:
            await control.seek_to_end(tp)
        else:
            control.seek(tp, found.offset)


async def _run(settings: BatcherSettings, repo: ModelRepository) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await ensure_topics(settings.kafka_bootstrap, deployment_specs(settings.topics, repo))
        app = BatcherApp(settings, repo)
        # The batch job runner shares the process (and its fate: kill -9 stops both; see jobs.py).
        await asyncio.gather(app.run(stop), JobRunner(settings, repo, app.batcher_id).run(stop))
    except BatchPublishError as exc:
        log.error("%s", exc)
        return 1
    except (KafkaError, OSError, RuntimeError) as exc:
        log.error("batcher cannot run: %r; check WEIR_KAFKA_BOOTSTRAP=%s", exc, settings.kafka_bootstrap)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line of `weir batcher`; flags override WEIR_* environment settings."""
    parser = argparse.ArgumentParser(prog="weir batcher", description="Run the batcher service.")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (WEIR_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic-prefix", help="prefix of topics and groups (WEIR_TOPIC_PREFIX)")
    parser.add_argument("--model-repo", help="model repository TOML (WEIR_MODEL_REPO)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def main(argv: list[str]) -> int:
    """Run the batcher until SIGTERM/SIGINT; returns the process exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {
        key: value
        for key, value in (
            ("kafka_bootstrap", args.bootstrap),
            ("topic_prefix", args.topic_prefix),
            ("model_repo", args.model_repo),
        )
        if value is not None
    }
    settings = BatcherSettings(**overrides)
    try:
        repo = load_model_repo(settings.model_repo)
    except ModelRepoError as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(_run(settings, repo))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
