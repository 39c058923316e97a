"""TopicWriter against the real broker: a topic that refuses writes fails only its own sends."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from schemas.topics import Topics
from tests.conftest import BOOTSTRAP
from tests.kafka_helpers import read_until
from weir.bus import BusSettings, make_producer
from weir.kafka.admin import ensure_topics, list_topic_names
from weir.reply_topics import TopicRefused, TopicWriter

pytestmark = pytest.mark.kafka


@pytest.fixture
async def producer():
    producer = make_producer(BusSettings(kafka_bootstrap=BOOTSTRAP), client_id="test-reply-topics")
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def test_a_missing_topic_fails_its_own_sends_fast_while_others_go_on(producer):
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    good, missing = topics.replies("good"), topics.replies("missing")
    await ensure_topics(BOOTSTRAP, [topics.reply_spec("good")])
    writer = TopicWriter(producer, auto_create=False)

    started = time.monotonic()
    doomed = [await writer.send(missing, b"x%d" % i, b"k") for i in range(20)]
    sent = [await writer.send(good, b"%d" % i, b"k") for i in range(20)]
    assert time.monotonic() - started < 1.0, "send() waited for a topic"
    await asyncio.wait_for(asyncio.gather(*sent), 5)  # the good topic's writes are not held up
    results = await asyncio.wait_for(asyncio.gather(*doomed, return_exceptions=True), 5)
    assert all(isinstance(r, TopicRefused) and "does not exist" in str(r) for r in results), results
    assert writer.num_refused == 20
    assert not TopicRefused(missing, "").retriable  # not an outage: nobody else's writes stop

    # Refused for a while: the next send fails at once, untried, and the topic was never made.
    again = await writer.send(missing, b"y", b"k")
    assert again.done() and isinstance(again.exception(), TopicRefused)
    assert missing not in await list_topic_names(BOOTSTRAP)
    records = await read_until(BOOTSTRAP, [good], lambda rs: len(rs) >= 20, timeout_s=10)
    assert [r.value for r in records] == [b"%d" % i for i in range(20)]


async def test_a_missing_topic_is_created_where_allowed_and_written_in_order(producer):
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    fresh = topics.replies("fresh")
    writer = TopicWriter(producer, auto_create=True)  # the test broker has auto.create.topics.enable
    futures = [await writer.send(fresh, b"%d" % i, b"k") for i in range(10)]
    assert writer.is_looking_up(fresh)
    await asyncio.wait_for(asyncio.gather(*futures), 15)
    records = await read_until(BOOTSTRAP, [fresh], lambda rs: len(rs) >= 10, timeout_s=10)
    assert [r.value for r in records] == [b"%d" % i for i in range(10)]  # queued sends keep their order
    assert not writer.is_looking_up(fresh) and writer.num_refused == 0


async def test_a_name_the_broker_refuses_fails_alone(producer):
    """Defence in depth: the services refuse such a reply_to before they write (schemas/topics.py)."""
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    good = topics.replies("good")
    await ensure_topics(BOOTSTRAP, [topics.reply_spec("good")])
    writer = TopicWriter(producer)
    bad = await writer.send("bad topic!", b"x", b"k")
    ok = await writer.send(good, b"ok", b"k")
    await asyncio.wait_for(ok, 5)
    with pytest.raises(TopicRefused, match="invalid"):
        await asyncio.wait_for(bad, 5)
