"""LagMonitor against the real broker: committed offsets -> kafka_consumergroup_lag per group and topic."""

from __future__ import annotations

import logging
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from schemas.topics import TopicSpec
from tests.conftest import BOOTSTRAP
from tests.kafka_helpers import produce
from weir.bus import BusSettings
from weir.kafka.admin import ensure_topics
from weir.lag import LAG_METRIC, LagMonitor, fold_lags
from weir.metrics import ServiceMetrics, value

pytestmark = pytest.mark.kafka


async def commit(group: str, tp: TopicPartition, offset: int) -> None:
    """Commit `offset` for `tp` as `group` (a manual assignment: no rebalance to wait for)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: OffsetAndMetadata(offset, "")})
    finally:
        await consumer.stop()


async def test_lag_is_end_minus_committed_per_group_and_topic_of_this_prefix_only():
    prefix = f"t{uuid.uuid4().hex[:8]}"
    topic, other_topic = f"{prefix}.requests", f"{prefix}.control"
    await ensure_topics(BOOTSTRAP, [TopicSpec(topic, 2, {}), TopicSpec(other_topic, 1, {})])
    await produce(BOOTSTRAP, topic, [("a", b"%d" % i) for i in range(7)])  # K=7 on partition of key "a"
    await produce(BOOTSTRAP, other_topic, [("k", b"%d" % i) for i in range(3)])
    part = await partition_holding(topic)
    await commit(f"{prefix}.batcher", TopicPartition(topic, part), 2)  # j=2 -> lag 5, then j=4 -> 3
    await commit(f"{prefix}.batcher", TopicPartition(other_topic, 0), 3)  # at the end -> lag 0
    await commit(f"{prefix}.auditor", TopicPartition(topic, part), 7)
    await commit(f"other{prefix}.batcher", TopicPartition(topic, part), 0)  # another deployment's group
    # A group that has joined but committed nothing: listed, nothing to report.
    idle = AIOKafkaConsumer(topic, bootstrap_servers=BOOTSTRAP, group_id=f"{prefix}.idle", enable_auto_commit=False)
    await idle.start()
    monitor = LagMonitor(BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=prefix), interval_s=1)
    try:
        await idle.getmany(timeout_ms=500)
        assert await monitor.refresh()
        assert monitor.lags[(f"{prefix}.batcher", topic)] == 5
        await commit(f"{prefix}.batcher", TopicPartition(topic, part), 4)  # the same clients see the new offset
        assert await monitor.refresh() and monitor.num_polls == 2
    finally:
        await idle.stop()
        await monitor.stop()
    assert monitor.lags == {
        (f"{prefix}.batcher", topic): 3,
        (f"{prefix}.batcher", other_topic): 0,
        (f"{prefix}.auditor", topic): 0,
    }

    # Exported under kafka_exporter's name and labels.
    metrics = ServiceMetrics("test")
    metrics.gauge(LAG_METRIC, "lag", monitor.observe)
    text = metrics.render()
    metrics.shutdown()
    assert value(text, LAG_METRIC, consumergroup=f"{prefix}.batcher", topic=topic) == 3
    assert value(text, LAG_METRIC, consumergroup=f"{prefix}.auditor", topic=topic) == 0
    assert value(text, LAG_METRIC, consumergroup=f"other{prefix}.batcher", topic=topic) is None


async def test_a_broker_that_is_gone_keeps_the_last_values_and_logs_once(caplog):
    monitor = LagMonitor(BusSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="nothere"), interval_s=1)
    monitor.lags = {("nothere.batcher", "nothere.requests"): 4}
    with caplog.at_level(logging.WARNING, logger="weir.lag"):
        assert not await monitor.refresh()
        assert not await monitor.refresh()
    assert monitor.lags == {("nothere.batcher", "nothere.requests"): 4}
    assert monitor.observe() == [(4, {"consumergroup": "nothere.batcher", "topic": "nothere.requests"})]
    assert len([r for r in caplog.records if r.name == "weir.lag"]) == 1


def test_lag_never_goes_negative_and_sums_partitions():
    a0, a1 = TopicPartition("p.a", 0), TopicPartition("p.a", 1)
    committed = {"p.g": {a0: 10, a1: 3}}
    assert fold_lags(committed, {a0: 8, a1: 9}) == {("p.g", "p.a"): 6}  # 0 (a committed offset past the end) + 6


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        LagMonitor(BusSettings(), interval_s=0)


async def partition_holding(topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, group_id=None)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in (0, 1)])
    finally:
        await consumer.stop()
    [part] = [tp.partition for tp, end in ends.items() if end > 0]
    return part
