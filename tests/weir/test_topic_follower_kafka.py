"""weir.bus.TopicFollower against the real broker: it reads a topic's every partition from the
beginning before start() returns, then follows what comes later; a record whose handler raises
is skipped and the following goes on; stop() ends it."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from schemas.topics import Topics, TopicSpec
from tests.auditor.test_auditor_kafka import produce
from tests.conftest import BOOTSTRAP
from weir.bus import BusSettings, TopicFollower
from weir.kafka.admin import delete_topics, ensure_topics

pytestmark = pytest.mark.kafka


async def test_reads_to_the_end_then_follows_and_skips_what_its_handler_refuses() -> None:
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    topic = topics.token_usage
    await ensure_topics(BOOTSTRAP, [TopicSpec(topic, 3, {})])
    seen: list[bytes] = []

    def on_record(key, value, record) -> None:  # noqa: ANN001
        if value == b"boom":
            raise ValueError("unreadable")
        seen.append(value)

    try:
        await produce(BOOTSTRAP, topic, [(b"k%d" % i, b"v%d" % i) for i in range(6)] + [(b"k9", b"boom")])
        follower = TopicFollower(BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix), topic,
                                 "test-follower", on_record)  # fmt: skip
        await follower.start()
        try:
            assert sorted(seen) == [b"v%d" % i for i in range(6)]  # all partitions, before start() returned
            await produce(BOOTSTRAP, topic, [(b"k7", b"later")])
            for _ in range(100):
                if b"later" in seen:
                    break
                await asyncio.sleep(0.1)
            assert b"later" in seen
        finally:
            await follower.stop()
    finally:
        await delete_topics(BOOTSTRAP, [topic])
