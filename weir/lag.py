"""Consumer lag of a deployment's consumer groups, polled in the background for /metrics.

`kafka_consumergroup_lag{consumergroup,topic}` is kafka_exporter's name and meaning (docs/design.md,
"Observability"): per group and topic, the sum over partitions of the end offset (high
watermark) minus the group's committed offset, never negative. A group is this deployment's when
its id starts with `<prefix>.` (schemas/topics.py names every group so); a partition the group
never committed is not counted (kafka_exporter does the same).

The lags are refreshed every `interval_s` by a background task, never at scrape time: a scrape
reads the last values, so a slow or absent broker never slows or breaks /metrics. A failed poll
keeps the last values and is logged once until a poll succeeds again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from weir.bus import BusSettings

log = logging.getLogger(__name__)

LAG_METRIC = "kafka_consumergroup_lag"  # kafka_exporter's gauge name
Lags = dict[tuple[str, str], int]  # (group, topic) -> lag


class BackgroundPoll:
    """A poll every `interval_s` on a task of its own (`refresh`, first at once), never at request
    or scrape time; `stop` cancels it and closes the poll's Kafka clients (`_disconnect`)."""

    interval_s: float
    task_name = "poll"
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start polling in the background (the first poll at once); returns without waiting for it."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._disconnect()

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def refresh(self) -> bool:
        raise NotImplementedError

    async def _disconnect(self) -> None:
        raise NotImplementedError


class LagMonitor(BackgroundPoll):
    """Polls the committed offsets of every consumer group under the deployment's prefix."""

    task_name = "consumer-lag"

    def __init__(self, settings: BusSettings, interval_s: float = 5.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self.settings = settings
        self.interval_s = interval_s
        self.lags: Lags = {}  # the last successful poll's
        self.num_polls = 0  # successful polls (tests wait on it)
        self._failing = False  # a failure was logged; logged again only after a success
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None

    @property
    def group_prefix(self) -> str:
        return f"{self.settings.topic_prefix}."

    def observe(self) -> list[tuple[float, dict[str, str]]]:
        """The gauge's observations: the last values, read at scrape time without I/O."""
        return [(lag, {"consumergroup": group, "topic": topic}) for (group, topic), lag in sorted(self.lags.items())]

    async def refresh(self) -> bool:
        """Poll once; on success replace the lags and return True. A failure keeps the last
        values (logged once per outage) and returns False."""
        try:
            self.lags = await asyncio.wait_for(self.poll(), timeout=max(self.interval_s, 10.0))
        except Exception as exc:  # noqa: BLE001 - whatever the broker did, /metrics keeps the last values
            await self._disconnect()  # the next poll connects afresh
            if not self._failing:
                log.warning("consumer lag: poll failed, keeping the last values: %r", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("consumer lag: polling again")
        self._failing = False
        self.num_polls += 1
        return True

    async def poll(self) -> Lags:
        """Read every group's committed offsets and the end offsets of their partitions."""
        admin, consumer = await self._clients()
        groups = [g[0] for g in await admin.list_consumer_groups() if str(g[0]).startswith(self.group_prefix)]
        committed: dict[str, dict[TopicPartition, int]] = {}
        for group in sorted(groups):
            offsets = await admin.list_consumer_group_offsets(group)
            committed[group] = {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}
        partitions = sorted({tp for offsets in committed.values() for tp in offsets})
        ends = await consumer.end_offsets(partitions) if partitions else {}
        return fold_lags(committed, ends)

    async def _clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        """The admin client and the end-offset reader, connected once and kept across polls."""
        if self._admin is None or self._consumer is None:
            options = self.settings.kafka_options()
            bootstrap = self.settings.kafka_bootstrap
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **options)
            # No group, default isolation: the high watermark, as kafka_exporter reads it.
            consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, request_timeout_ms=5000, **options)
            try:
                await admin.start()
                await consumer.start()
            except BaseException:
                await _close(admin, consumer)
                raise
            self._admin, self._consumer = admin, consumer
        return self._admin, self._consumer

    async def _disconnect(self) -> None:
        admin, consumer, self._admin, self._consumer = self._admin, self._consumer, None, None
        await _close(admin, consumer)


async def _close(admin: AIOKafkaAdminClient | None, consumer: AIOKafkaConsumer | None) -> None:
    with contextlib.suppress(Exception):
        if admin is not None:
            await admin.close()
    with contextlib.suppress(Exception):
        if consumer is not None:
            await consumer.stop()


def fold_lags(committed: dict[str, dict[TopicPartition, int]], ends: dict[TopicPartition, int]) -> Lags:
    """Per (group, topic): the sum over its committed partitions of max(end - committed, 0)."""
    lags: Lags = {}
    for group, offsets in committed.items():
        for tp, offset in offsets.items():
            key = (group, tp.topic)
            lags[key] = lags.get(key, 0) + max(ends.get(tp, offset) - offset, 0)
    return lags
