"""Topic metadata against the real broker. ensure_topics hands topics over only once every broker
shows them with a leader per partition (a KRaft broker learns a new topic after the controller
answers). A group member whose topic vanished from a metadata answer gets its partitions back within
WEIR_GROUP_METADATA_MAX_AGE_MS, not aiokafka's default 5 minutes (docs/design.md, "Scale-out and
failover"), against the real broker. The topic is deleted and made again under the same name: the
member's fetch fails, its metadata then lacks the topic, and it holds no partition until it asks
the broker again, which is what a transient UnknownTopicOrPartition does to a live worker. (The
broker may make the topic again itself, with one partition, when the member's metadata request
names it: auto.create.topics.enable is on for reply topics. Either way it exists again at once and
the member must see it.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer

from schemas.topics import TopicSpec
from tests.conftest import BOOTSTRAP
from tests.waiting import until
from weir.bus import BusSettings, make_consumer
from weir.kafka.admin import (
    _admin,
    delete_prefixed_topics,
    delete_topics,
    ensure_topics,
    list_topic_names,
    wait_topics_visible,
)

pytestmark = pytest.mark.kafka


async def polled(consumer: AIOKafkaConsumer, is_done: Callable[[], bool]) -> bool:
    """One poll of the consumer (its group membership moves only while it polls), then is_done()."""
    await consumer.getmany(timeout_ms=100)
    return is_done()


async def test_a_member_gets_back_a_topic_that_vanished_from_its_metadata():
    prefix = f"t{uuid.uuid4().hex[:8]}"
    name = f"{prefix}.batches"
    spec = TopicSpec(name, 2, {})
    await ensure_topics(BOOTSTRAP, [spec])
    settings = BusSettings(kafka_bootstrap=BOOTSTRAP, group_metadata_max_age_ms=1000)
    consumer = make_consumer(
        settings, client_id=f"{prefix}-member", group_id=f"{prefix}-group", session_timeout_ms=6000
    )
    consumer.subscribe([name])
    await consumer.start()
    try:
        await until(
            lambda: polled(consumer, lambda: len(consumer.assignment()) == 2),
            timeout_s=30,
            what="both partitions assigned",
        )
        await delete_topics(BOOTSTRAP, [name])
        await until(
            lambda: polled(consumer, lambda: not consumer.assignment()),
            timeout_s=30,
            what="no partition assigned once the topic is gone",
        )
        await ensure_topics(BOOTSTRAP, [spec])  # a no-op where the broker made it again already
        # Back within a refresh (1 s) and a rebalance; with aiokafka's default it stays empty 5 minutes.
        await until(
            lambda: polled(consumer, lambda: bool(consumer.assignment())),
            timeout_s=20,
            what="partitions assigned again",
        )
    finally:
        await consumer.stop()
        await delete_prefixed_topics(BOOTSTRAP, prefix)


async def test_only_group_members_get_the_shorter_refresh():
    settings = BusSettings(kafka_bootstrap=BOOTSTRAP, group_metadata_max_age_ms=1234)
    member = make_consumer(settings, "x", client_id="m", group_id="g")
    reader = make_consumer(settings, "x", client_id="r", group_id=None)
    assert member._client._metadata_max_age_ms == 1234
    assert reader._client._metadata_max_age_ms == 300_000


async def test_topics_are_visible_on_every_broker_when_ensure_topics_returns_and_a_wrong_count_times_out():
    prefix = f"t{uuid.uuid4().hex[:8]}"
    specs = [TopicSpec(f"{prefix}.a", 3, {}), TopicSpec(f"{prefix}.b", 1, {})]
    assert sorted(await ensure_topics(BOOTSTRAP, specs)) == [f"{prefix}.a", f"{prefix}.b"]
    admin = _admin(BOOTSTRAP, None)
    await admin.start()
    try:
        await wait_topics_visible(admin, {f"{prefix}.a": 3, f"{prefix}.b": 1}, timeout_s=0.0)  # already: no wait
        with pytest.raises(TimeoutError, match=rf"{prefix}\.a on node"):
            await wait_topics_visible(admin, {f"{prefix}.a": 4}, timeout_s=0.5)  # it has 3, not 4
        with pytest.raises(TimeoutError, match=rf"{prefix}\.missing on node"):
            await wait_topics_visible(admin, {f"{prefix}.missing": 1}, timeout_s=0.5)
    finally:
        await admin.close()
        await delete_prefixed_topics(BOOTSTRAP, prefix)
    assert f"{prefix}.missing" not in await list_topic_names(BOOTSTRAP)  # asking did not create it
