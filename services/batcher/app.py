"""Batcher wiring: Kafka clients from settings, the one asyncio loop, and `main`.

    weir batcher [--bootstrap HOST:PORT] [--topic-prefix P] [--model-repo models.toml] [--http-port N]

The batcher follows the model registry (weir/registry.py: RegistryFollower, seeded by its
models.toml): requests are resolved and pinned to a version (`name@version`) on arrival, batched
per version, and sent to that version's batch topic, which the batcher creates when the version
is registered (docs/design.md, "The model registry").

One loop round: wait for request records (at most until the planner's next wakeup), admit them,
apply cancellations, take worker heartbeats into the router, close the batches that are due (each
routed to a worker's partition), await every produce of the round and commit
what is durable. Shutdown (SIGTERM/SIGINT) finishes the round, commits, and closes: held requests
are not flushed, they are redone by the partitions' next owner. Started, stopped and served
(/healthz, /readyz, /metrics) by weir/service.py like every service.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from starlette.types import ASGIApp

from schemas.messages import now_ms
from schemas.model_repo import ModelRepoError, ModelRepository, load_model_repo
from services.batcher.config import BatcherSettings
from services.batcher.consumers import BatcherHandlers, RebalanceListener
from services.batcher.jobs import JobRunner
from services.batcher.metrics import BatcherMetrics
from services.batcher.planner import Planner
from services.batcher.routing import Router
from weir.bus import instance_id, make_consumer, make_producer, wait_for_cluster
from weir.kafka.admin import ensure_topics
from weir.lag import LAG_METRIC, LagMonitor
from weir.metrics import ServiceMetrics
from weir.registry import RegistryFollower
from weir.service import ConfigError, bus_overrides, ops_app, run_service, service_parser
from weir.tracing import Tracing

log = logging.getLogger(__name__)


class BatcherApp:
    """One batcher replica: its Kafka clients, planner and handlers, built from settings."""

    def __init__(
        self,
        settings: BatcherSettings,
        repo: ModelRepository,
        batcher_id: str | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        """`metrics`: the provider the loop's events are recorded on (the service's, exported at
        /metrics); a private one when None."""
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
        self.registry = RegistryFollower(settings, f"{self.batcher_id}-registry", self._on_registry_change, seed=repo)
        self._version_topics: set[str] = set()  # served_ids whose batch topic exists or is being made
        self._topic_tasks: set[asyncio.Task[None]] = set()
        self.planner = Planner(
            self.registry.state, max_recent=settings.max_recent_ids, max_batch_bytes=settings.max_batch_bytes
        )
        self.router = Router(worker_timeout_ms=settings.worker_timeout_ms, prefix_chars=settings.prefix_affinity_chars)
        self.handlers = BatcherHandlers(
            topics,
            self.planner,
            self.producer,
            self.requests,
            self.batcher_id,
            router=self.router,
            commit_interval_ms=settings.commit_interval_ms,
            reply_auto_create=settings.reply_topic_auto_create,
            mirror_max_queued=settings.mirror_max_queued,
            tracing=Tracing("batcher", self.batcher_id, settings),
            metrics=BatcherMetrics(metrics or ServiceMetrics("batcher")),
        )
        self._started: list[Any] = []
        self.is_reading = False

    async def start(self) -> None:
        """Read the registry and make its versions' topics, start the Kafka clients, follow the
        control topic, read the live-worker table, subscribe."""
        topics = self.settings.topics
        await self.registry.start()
        self._started.append(self.registry)
        await self._ensure_version_topics()
        for client in (self.producer, self.requests, self.control, self.workers, self.handlers.tracing):
            await client.start()
            self._started.append(client)
        partitions = await self.producer.partitions_for(topics.control)  # waits for metadata
        await _follow_control(self.control, topics.control, partitions, self.settings.control_lookback_ms)
        await self._read_heartbeats_to_end()
        # The requests topic and every outside producer's own (<prefix>.requests.<user>): a topic
        # made later (`weir kafka user add`) joins at the consumer's next metadata refresh
        # (BusSettings.group_metadata_max_age_ms, 5 s), from its earliest record.
        self.requests.subscribe(pattern=topics.requests_pattern, listener=RebalanceListener(self.handlers))
        log.info("batcher %s reading %s", self.batcher_id, topics.requests_pattern)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; raises BatchPublishError when a batch cannot be produced."""
        self.is_reading = True
        try:
            while not stop.is_set():
                await self.step()
            await self.handlers.commit()  # a clean stop leaves nothing durable uncommitted
        finally:
            self.is_reading = False

    async def serve(self, stop: asyncio.Event) -> None:
        """start, run until `stop`, close: the whole life of a batcher embedded in another program."""
        try:
            await self.start()
            await self.run(stop)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the clients. Only durable effects were committed; what is held is redone by the next owner."""
        for task in list(self._topic_tasks):
            task.cancel()
        for client in reversed(self._started):
            await client.stop()
        self._started.clear()
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

    def _on_registry_change(self) -> None:
        """A registry record changed the state: make the batch topics of new versions (once each),
        so a version registered while the batcher runs is routable without a restart."""
        if not self._started or not self._new_versions():
            return
        task = asyncio.create_task(self._ensure_version_topics(), name="version-topics")
        self._topic_tasks.add(task)
        task.add_done_callback(self._topic_tasks.discard)

    def _new_versions(self) -> list[str]:
        return sorted(set(self.registry.state.servable()) - self._version_topics)

    async def _ensure_version_topics(self) -> None:
        """Create the batch topic of every servable version not made yet; a failure is logged and
        retried at the next registry change (its batches wait for the topic's metadata meanwhile)."""
        new = self._new_versions()
        if not new:
            return
        self._version_topics.update(new)
        topics = self.settings.topics
        try:
            made = await ensure_topics(
                self.settings.kafka_bootstrap, [s for served_id in new for s in topics.model_specs(served_id)]
            )
        except (KafkaError, OSError) as exc:  # the broker is down or refuses: the next change retries
            self._version_topics.difference_update(new)
            log.warning("could not create the batch topics of %s: %r", new, exc)
            return
        if made:
            log.info("batch topics created for new model versions: %s", made)

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


class BatcherService:
    """The batcher process: one BatcherApp and the batch job runner that shares its fate (a kill -9
    stops both; see jobs.py), driven by weir/service.py."""

    name = "batcher"

    def __init__(self, settings: BatcherSettings, repo: ModelRepository) -> None:
        self.settings = settings
        self.repo = repo
        self.batcher_id = instance_id("batcher")
        # Built in start(): aiokafka's clients must be created inside the running event loop, and
        # build() runs before there is one (it raised "should be created within an async function").
        self.app: BatcherApp | None = None
        self.jobs: JobRunner | None = None
        self.lag = LagMonitor(settings, settings.lag_interval_s)
        self.metrics = _metrics(self)

    async def start(self) -> None:
        await wait_for_cluster(self.settings)
        await self.lag.start()  # polls in the background; /metrics reads its last values
        # The core topics (the registry's among them); each version's batch topic is made by the
        # app once it has read the registry.
        await ensure_topics(self.settings.kafka_bootstrap, self.settings.topics.core_specs())
        self.app = BatcherApp(self.settings, self.repo, self.batcher_id, self.metrics)
        self.jobs = JobRunner(self.settings, self.app.registry.state, self.batcher_id)
        await self.app.start()

    async def run(self, stop: asyncio.Event) -> None:
        assert self.app is not None and self.jobs is not None, "start() first"
        await asyncio.gather(self.app.run(stop), self.jobs.run(stop))

    async def close(self) -> None:
        await self.lag.stop()
        if self.app is not None:
            await self.app.close()
        self.metrics.shutdown()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready while the loop reads requests."""
        if self.app is None:
            return False, {"batcher_id": self.batcher_id, "reason": "connecting to Kafka"}
        body = {"batcher_id": self.batcher_id, "live_workers": self.app.router.num_workers}
        return self.app.is_reading, {**body, "reason": None if self.app.is_reading else "starting or stopping"}

    def http_app(self) -> ASGIApp:
        return ops_app(self.readiness, self.metrics.render)


def _metrics(service: BatcherService) -> ServiceMetrics:
    """Gauges read from the batcher's state at scrape time (none before it started); the loop's
    events (metrics.py) are recorded on the same provider once the app is built."""
    metrics = ServiceMetrics("batcher")

    def read(value: Callable[[BatcherApp], float]) -> Callable[[], list[tuple[float, dict[str, str]]]]:
        return lambda: [] if service.app is None else [(value(service.app), {})]

    metrics.gauge(
        "weir_batcher_requests_held",
        "Requests held by the planner, waiting for their batch.",
        read(lambda app: app.planner.num_held),
    )
    metrics.gauge(
        "weir_batcher_requests_uncommitted",
        "Request records whose effect is not yet durable.",
        read(lambda app: app.handlers.num_in_flight),
    )
    metrics.gauge(
        "weir_batcher_live_workers",
        "Workers with a live heartbeat in the router's table.",
        read(lambda app: app.router.num_workers),
    )
    metrics.gauge(
        "weir_batcher_models_blocked",
        "1 per model version held back because no live worker has room.",
        lambda: [] if service.app is None else [(1, {"model": m}) for m in service.app.planner.blocked_models()],
    )
    metrics.gauge(
        "weir_batcher_routable_workers",
        "Live workers per model version with it ready, or draining.",
        lambda: [] if service.app is None else _routable(service.app),
    )
    metrics.gauge(
        "weir_batcher_requests_unresolved",
        "Requests rejected since start: their model did not resolve "
        "to a servable version (unknown, unregistered, retired, malformed).",
        read(lambda app: app.handlers.num_unresolved),
    )
    metrics.gauge(
        "weir_batcher_requests_unservable",
        "Requests rejected since start per model version: every live worker reporting it had it failed or refused.",
        lambda: (
            []
            if service.app is None
            else [(n, {"model": served_id}) for served_id, n in service.app.handlers.num_unservable.items()]
        ),
    )
    metrics.gauge(
        "weir_batcher_mirrors_held",
        'Mirror copies waiting in lanes (docs/design.md, "Traffic policies").',
        read(lambda app: app.handlers.num_mirrors_held),
    )
    metrics.gauge(
        "weir_batcher_mirrors_dropped",
        "Mirror copies dropped under load since start (ended on the shadow reply topic).",
        read(lambda app: app.handlers.num_mirrors_dropped),
    )
    metrics.gauge(
        "weir_batcher_registry_versions",
        "Model versions the batcher may route (registered or seeded, not retired).",
        read(lambda app: len(app.registry.state.servable())),
    )
    metrics.gauge(
        "weir_batcher_registry_skipped",
        "Registry records skipped since start: not a valid registry record.",
        read(lambda app: app.registry.num_skipped),
    )
    metrics.gauge(
        "weir_batcher_queue_depth",
        'Requests held per lane and tenant (the 50 busiest tenants; the rest are tenant="other").',
        lambda: [] if service.app is None else service.app.handlers.metrics.observe_depth(service.app.planner),
    )
    metrics.gauge(LAG_METRIC, "Consumer lag per group and topic of this deployment (weir/lag.py).", service.lag.observe)
    return metrics


def _routable(app: BatcherApp) -> list[tuple[float, dict[str, str]]]:
    now = now_ms()
    return [
        (len(app.router.live_workers(served_id, now, state)), {"model": served_id, "state": state})
        for served_id in app.registry.state.servable()
        for state in ("ready", "draining")
    ]


def build_parser() -> argparse.ArgumentParser:
    """The command line of `weir batcher`: the common service flags (weir/service.py) and its own."""
    parser = service_parser("batcher", "Run the batcher service.", 8110, "WEIR_BATCHER_HTTP_PORT")
    parser.add_argument("--model-repo", help="model repository TOML (env WEIR_MODEL_REPO)")
    return parser


def build(args: argparse.Namespace) -> tuple[BatcherService, str, int]:
    """The service from flags over WEIR_* settings; a bad model repository is a ConfigError."""
    overrides = {**bus_overrides(args), "model_repo": args.model_repo, "batcher_http_port": args.http_port}
    settings = BatcherSettings(**{k: v for k, v in overrides.items() if v is not None})
    try:
        repo = load_model_repo(settings.model_repo)
    except ModelRepoError as exc:
        raise ConfigError(str(exc)) from exc
    return BatcherService(settings, repo), settings.http_host, settings.batcher_http_port


def main(argv: list[str]) -> int:
    """Run the batcher until SIGTERM/SIGINT; returns the process exit status (weir/service.py)."""
    return run_service("batcher", argv, build_parser(), build)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
