"""weir.bus.TopicFollower against the real broker: it folds what is there, then follows what comes,
across every partition; a record its handler cannot take is skipped, not the end of the view."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from schemas.topics import TopicSpec
from tests.conftest import BOOTSTRAP
from tests.kafka_helpers import produce
from tests.waiting import stays_false, until
from weir.bus import BusSettings, TopicFollower
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

pytestmark = pytest.mark.kafka
# A stopped follower has closed its consumer: nothing can reach the callback any more. One second
# is many fetch waits of a live one (which hands a produced record over within milliseconds).
AFTER_STOP_S = 1.0


@pytest.fixture
async def topic():
    prefix = f"t{uuid.uuid4().hex[:8]}"
    name = f"{prefix}.follow"
    await ensure_topics(BOOTSTRAP, [TopicSpec(name, 3, {})])
    yield name
    await delete_prefixed_topics(BOOTSTRAP, prefix)


async def test_it_reads_what_is_there_before_start_returns_then_follows(topic):
    await produce(BOOTSTRAP, topic, [(f"k{i}", b"%d" % i) for i in range(30)])  # keys spread over 3 partitions
    seen: list[tuple[bytes | None, bytes | None]] = []
    follower = TopicFollower(
        BusSettings(kafka_bootstrap=BOOTSTRAP), topic, "test-follow", lambda key, value, _: seen.append((key, value))
    )
    await follower.start()
    try:
        assert sorted(int(value) for _, value in seen) == list(range(30))  # all of it, at start()
        await produce(BOOTSTRAP, topic, [("k1", b"new"), ("k2", None)])
        await until(
            lambda: (b"k1", b"new") in seen and (b"k2", None) in seen,
            timeout_s=10,
            what="k1's new value and k2's tombstone",
        )
    finally:
        await follower.stop()


async def test_a_record_the_handler_refuses_is_skipped_and_the_rest_read(topic):
    await produce(BOOTSTRAP, topic, [("a", b"1"), ("a", b"boom"), ("a", b"2")])
    seen: list[bytes | None] = []

    def on_record(key: bytes | None, value: bytes | None, _: object) -> None:
        if value == b"boom":
            raise ValueError("bad record")
        seen.append(value)

    follower = TopicFollower(BusSettings(kafka_bootstrap=BOOTSTRAP), topic, "test-follow-bad", on_record)
    await follower.start()
    try:
        assert seen == [b"1", b"2"]
        await produce(BOOTSTRAP, topic, [("a", b"boom"), ("a", b"3")])
        await until(lambda: seen[-1:] == [b"3"], timeout_s=10, what="the last record, 3")
    finally:
        await follower.stop()


async def test_an_empty_topic_starts_at_once_and_stop_ends_it(topic):
    seen: list[bytes | None] = []
    follower = TopicFollower(
        BusSettings(kafka_bootstrap=BOOTSTRAP), topic, "test-follow-empty", lambda _k, value, _r: seen.append(value)
    )
    await asyncio.wait_for(follower.start(), 20)
    await follower.stop()
    await produce(BOOTSTRAP, topic, [("a", b"late")])
    await stays_false(lambda: seen, for_s=AFTER_STOP_S, what="a record handed over after stop")


async def test_on_batch_follows_each_fetch_that_held_records(topic):
    await produce(BOOTSTRAP, topic, [(f"k{i}", b"%d" % i) for i in range(5)])
    seen: list[bytes | None] = []
    batches: list[int] = []  # how many records had been handed over when on_batch ran
    follower = TopicFollower(
        BusSettings(kafka_bootstrap=BOOTSTRAP),
        topic,
        "test-follow-batch",
        lambda _k, value, _r: seen.append(value),
        lambda: batches.append(len(seen)),
    )
    await follower.start()
    try:
        assert batches and batches[-1] == 5  # after the records of its fetch, never before
        await produce(BOOTSTRAP, topic, [("k9", b"later")])
        await until(lambda: batches[-1] == 6, timeout_s=10, what="the last batch, of 6")
    finally:
        await follower.stop()
