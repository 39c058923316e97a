"""The wait ahead of a new request for a model version, for admission from the queue.

docs/design.md, "Scale-out and failover": the queue ahead of a request is the live workers'
`num_waiting` and `num_running` plus the requests in the version's batch topic that its worker group has not read;
the drain rate is the sum of those workers' drain rates (drain_rate); the wait is their quotient.

A worker's drain rate is the larger of two measurements, each of which lags a change the other
sees at once: its `finished_per_s` (ends per busy second over about a minute: it lags a change of
concurrency, and is low while a burst that started together has not ended yet), and its
concurrency over its `service_s` (Little's law: K requests running at once for service_s each end
K / service_s a second; it lags a change of service time, as when more sequences per step slow
each step). K is the concurrency the queue will run at: the work it has and its share of the
unread requests, up to max_num_seqs (or what it runs, if more). A refusal needs both to say the
queue is too long, so a cold start or a burst after a quiet minute is not refused on a guess.

Counting the batch topic: its lag is in records (Batches), each holding several requests, so the
records between the group's read position and the end of each partition are read and their
requests counted (up to MAX_READ records a partition a poll; past that, the rest are counted at
the mean of those read). The read position of a partition is the next offset its live owner's
heartbeat reports (the batches below it are already in that worker's num_waiting or running),
else the group's committed offset (a partition no live worker owns now, between a worker's death
and the rebalance); a partition the group never read or committed is not counted.

Polled in the background every `interval_s`, never on the request path: admission reads the last
values. A failed poll keeps them; values older than `stale_s` are unknown, and an unknown queue
or rate refuses nothing (admit). Lanes are not told apart: the batch topic is read in order and a
worker's num_waiting has no lane split, so an interactive request is given the whole queue as
ahead of it (an upper bound: workers run interactive first). The requests a batcher still holds
(no worker had room) are not on Kafka per model and are not counted (a lower bound there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.codec import DecodeError, decode
from schemas.messages import Batch, WorkerHeartbeat, now_ms
from schemas.topics import Topics
from services.gateway.fleet import Fleet
from weir.bus import BusSettings
from weir.lag import BackgroundPoll

log = logging.getLogger(__name__)

MAX_READ = 200  # batch records read per partition per poll; the rest counted at their mean
MIN_STALE_S = 10.0  # last values older than max(this, 3 polls) are unknown
# A queue measured to take longer than this is told to come back then and ask again: the rate and
# the queue will have changed (and a forged heartbeat cannot send clients away for years).
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class QueueWait:
    """The estimated wait of a new request for `model`: `queue_ahead` requests at `per_s`."""

    model: str
    queue_ahead: int
    per_s: float

    @property
    def wait_s(self) -> float:
        return self.queue_ahead / self.per_s

    def retry_after_s(self, time_to_deadline_s: float) -> int:
        """Whole seconds until the queue has drained enough for a request with this time to its
        deadline to fit, at the measured rate (a retry gets the same time again); at least 1."""
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(self.wait_s - time_to_deadline_s)))


def drain_rate(hb: WorkerHeartbeat, unread_share: float) -> float | None:
    """Requests a second worker `hb` ends with `unread_share` requests on its way from the batch
    topic: the larger of its measured finished_per_s and K / service_s at the concurrency K the
    work ahead runs at (module docstring); None when it has neither."""
    rates = [] if hb.finished_per_s is None else [hb.finished_per_s]
    if hb.service_s is not None:
        work = hb.num_running + hb.num_waiting + unread_share
        concurrency = max(1.0, min(float(max(hb.max_num_seqs, hb.num_running)), work))
        rates.append(concurrency / hb.service_s)
    return max(rates) if rates else None


def estimate(model: str, serving: list[WorkerHeartbeat], unread: int | None) -> QueueWait | None:
    """The wait for `model` served by the live `serving` workers with `unread` requests in its batch
    topic; None (unknown) when the unread count is unknown, no serving worker owns a partition of
    the batch topic (none drains it; a heartbeat that claims to serve without one, a forged one
    included, counts for nothing), one that does has no drain rate yet (drain_rate), or the rates
    sum to 0. The unread requests are shared evenly between the draining workers.

    The queue ahead holds the running requests too: a worker batches continuously, so a new
    request shares the steps with every one in flight, and at the measured rate it ends about
    when the requests ahead of it have (an outside test saw 80 running requests estimated at a
    0.7 s wait while each new one timed out: the waiting ones alone were 0)."""
    drains = [hb for hb in serving if hb.partitions.get(model)]
    if unread is None or not drains:
        return None
    rates = [drain_rate(hb, unread / len(drains)) for hb in drains]
    if any(rate is None for rate in rates):
        return None
    per_s = sum(rate or 0.0 for rate in rates)
    if per_s <= 0:
        return None
    return QueueWait(model, unread + sum(hb.num_waiting + hb.num_running for hb in drains), per_s)


def owner_positions(model: str, live: list[WorkerHeartbeat]) -> dict[int, int]:
    """Per partition of `model`'s batch topic, the next offset its live owner reads (the highest
    when two report one, as during a rebalance)."""
    positions: dict[int, int] = {}
    for hb in live:
        for partition, offset in hb.next_offsets.get(model, {}).items():
            positions[partition] = max(offset, positions.get(partition, offset))
    return positions


def count_requests(model: str, values: list[bytes | None]) -> int:
    """Requests in the batch records `values` that a worker of `model` would run: a record that is
    not a Batch of that version is dead-lettered by the worker, so it counts none."""
    total = 0
    for value in values:
        try:
            batch = decode(Batch, value)
        except DecodeError:
            continue
        if batch.model == model:
            total += len(batch.requests)
    return total


def partition_requests(model: str, values: list[bytes | None], num_behind: int) -> int:
    """The requests in a partition's `num_behind` unread records, of which `values` (the first
    ones) were read: theirs, and the rest at their mean. None read: none counted."""
    if not values:
        return 0
    counted = count_requests(model, values)
    return counted + round(counted / len(values) * max(0, num_behind - len(values)))


class BatchBacklog(BackgroundPoll):
    """Polls, per model version some live worker serves, the requests its worker group has not read."""

    task_name = "queue-backlog"

    def __init__(self, settings: BusSettings, fleet: Fleet, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self.settings = settings
        self.topics: Topics = settings.topics
        self.fleet = fleet
        self.interval_s = interval_s
        self.stale_ms = int(max(MIN_STALE_S, 3 * interval_s) * 1000)
        self.unread: dict[str, int] = {}  # per model version, as the last successful poll counted
        self.polled_ms: int | None = None  # when that poll started
        self.num_polls = 0
        self._failing = False
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None

    def count(self, model: str, now: int) -> int | None:
        """The unread requests of `model`; None when unknown (never polled, or stale)."""
        if self.polled_ms is None or now - self.polled_ms > self.stale_ms:
            return None
        return self.unread.get(model)

    def wait(self, model: str, serving: list[WorkerHeartbeat], now: int) -> QueueWait | None:
        """The wait for `model` served by the live `serving` workers, from the last poll (no I/O)."""
        return estimate(model, serving, self.count(model, now))

    def observe(self) -> list[tuple[float, dict[str, str]]]:
        """weir_gateway_queue_wait_seconds: per version with a known wait, read at scrape time."""
        now = now_ms()
        waits = [self.wait(model, self.fleet.serving(model, now), now) for model in sorted(self.unread)]
        return [(w.wait_s, {"model_name": w.model}) for w in waits if w is not None]

    async def refresh(self) -> bool:
        """Poll once; a failure keeps the last values (logged once per outage) and returns False."""
        started = now_ms()
        try:
            unread = await asyncio.wait_for(self.poll(started), timeout=max(self.interval_s, MIN_STALE_S))
        except Exception as exc:  # noqa: BLE001 - whatever the broker did, admission keeps the last values
            await self._disconnect()
            if not self._failing:
                log.warning("queue backlog: poll failed, keeping the last values: %r", exc)
            self._failing = True
            return False
        self._failing = False
        self.unread, self.polled_ms = unread, started
        self.num_polls += 1
        return True

    async def poll(self, now: int) -> dict[str, int]:
        """Count the unread requests of every version a live worker serves or reads."""
        live = self.fleet.live(now)
        models = sorted({m for hb in live for m in [*hb.models, *hb.next_offsets]})
        # The partitions of the topics that exist, from the metadata of all topics: asking for one
        # by name would let a broker that auto-creates topics make a batch topic here (one
        # partition, not its spec's). A batch topic that does not exist holds nothing unread.
        admin = await self._admin_client()
        partitions = {
            t["topic"]: [p["partition"] for p in t["partitions"]]
            for t in await admin.describe_topics()
            if t["error_code"] == 0
        }
        return {
            model: await self._unread(model, live, partitions.get(self.topics.batches(model), [])) for model in models
        }

    async def _unread(self, model: str, live: list[WorkerHeartbeat], partitions: list[int]) -> int:
        if not partitions:
            return 0
        consumer = await self._reader()
        topic = self.topics.batches(model)
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in sorted(partitions)])
        positions = owner_positions(model, live)
        if any(end > 0 and tp.partition not in positions for tp, end in ends.items()):
            positions = {**await self._committed(model, topic), **positions}
        behind = {
            tp: (positions[tp.partition], end)
            for tp, end in ends.items()
            if tp.partition in positions and end > positions[tp.partition]
        }
        return await self._read_counts(consumer, model, behind) if behind else 0

    async def _read_counts(
        self, consumer: AIOKafkaConsumer, model: str, behind: dict[TopicPartition, tuple[int, int]]
    ) -> int:
        """Read up to MAX_READ records of each partition from its position; count their requests
        and the rest of each partition at the mean of its records read."""
        consumer.assign(list(behind))
        stops = {tp: min(end, start + MAX_READ) for tp, (start, end) in behind.items()}
        for tp, (start, _) in behind.items():
            consumer.seek(tp, start)
        values: dict[TopicPartition, list[bytes | None]] = {tp: [] for tp in behind}
        pending = set(behind)
        while pending:
            fetched = await consumer.getmany(*pending, timeout_ms=1000)
            if not fetched:
                break  # nothing more to read now (records removed, or a slow broker): count what was read
            for tp, records in fetched.items():
                values[tp].extend(r.value for r in records if r.offset < stops[tp])
                if records and records[-1].offset + 1 >= stops[tp]:
                    pending.discard(tp)
        return sum(partition_requests(model, values[tp], end - start) for tp, (start, end) in behind.items())

    async def _committed(self, model: str, topic: str) -> dict[int, int]:
        """The worker group's committed offsets in `topic` (partitions it never committed: none)."""
        offsets = await (await self._admin_client()).list_consumer_group_offsets(self.topics.worker_group(model))
        return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic and meta.offset >= 0}

    async def _admin_client(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            admin = AIOKafkaAdminClient(
                bootstrap_servers=self.settings.kafka_bootstrap,
                request_timeout_ms=5000,
                **self.settings.kafka_options(),
            )
            try:
                await admin.start()
            except BaseException:
                await admin.close()
                raise
            self._admin = admin
        return self._admin

    async def _reader(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.settings.kafka_bootstrap,
                group_id=None,
                enable_auto_commit=False,
                request_timeout_ms=5000,
                **self.settings.kafka_options(),
            )
            try:
                await consumer.start()
            except BaseException:
                await consumer.stop()
                raise
            self._consumer = consumer
        return self._consumer

    async def _disconnect(self) -> None:
        consumer, admin, self._consumer, self._admin = self._consumer, self._admin, None, None
        with contextlib.suppress(Exception):
            if consumer is not None:
                await consumer.stop()
        with contextlib.suppress(Exception):
            if admin is not None:
                await admin.close()
