"""A model server's group membership on the real broker (services/worker/kafka/membership.py): a
second process under the same instance name is noticed instead of stealing partitions forever,
and a static member that stops leaves the group so the other worker takes over at once."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer

from schemas.topics import TopicSpec
from services.worker.kafka.membership import FenceWatch, Membership, stop_consumer
from tests.waiting import stays_false, until
from weir.bus import BusSettings, make_consumer
from weir.kafka.admin import ensure_topics

pytestmark = pytest.mark.kafka
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

MEMBERSHIP = Membership(session_timeout_ms=2000, heartbeat_interval_ms=300, instance="worker-1")


async def topic_and_group() -> tuple[str, str]:
    topic = f"membership-{uuid.uuid4().hex[:8]}"
    await ensure_topics(BOOTSTRAP, [TopicSpec(topic, num_partitions=4)])
    return topic, f"group-{topic}"


async def member(topic: str, group: str, instance: str | None) -> AIOKafkaConsumer:
    consumer = make_consumer(
        BusSettings(kafka_bootstrap=BOOTSTRAP),
        topic,
        client_id=f"c-{instance}",
        group_id=group,
        session_timeout_ms=MEMBERSHIP.session_timeout_ms,
        heartbeat_interval_ms=MEMBERSHIP.heartbeat_interval_ms,
        group_instance_id=instance,
    )
    await consumer.start()
    return consumer


# A static member fenced by a second process under its instance name would fence the second back
# at its next heartbeat (one every heartbeat_interval_ms): three of them without that happening show
# the two settled on sharing.
SETTLED_S = 3 * MEMBERSHIP.heartbeat_interval_ms / 1000


async def polled(consumers: list[AIOKafkaConsumer], done: Callable[[], object]) -> object:
    """One poll of every consumer (as a model server's loop does; membership moves only while it
    polls), then done()."""
    for c in consumers:
        with contextlib.suppress(Exception):  # errors of a member being fenced; the watch decides
            await c.getmany(timeout_ms=50)
    return done()


async def test_a_second_process_with_the_same_instance_name_turns_the_first_dynamic_not_looping():
    topic, group = await topic_and_group()
    first = await member(topic, group, MEMBERSHIP.instance)
    watch = FenceWatch(first, MEMBERSHIP)
    await until(
        lambda: polled([first], lambda: len(first.assignment()) == 4),
        timeout_s=30,
        what="the first member assigned all 4 partitions",
    )
    assert watch.notice() is None  # alone: not fenced
    second = await member(topic, group, MEMBERSHIP.instance)
    second_watch = FenceWatch(second, MEMBERSHIP)
    try:
        await until(
            lambda: polled([first, second], lambda: watch.fenced_by is not None),
            timeout_s=15,
            what="the first member noticing it was fenced",
        )
        assert "worker-1" in watch.notice() and watch.notice() is None  # said once

        # the first carries on as a dynamic member: the instance stays the second's (it is not
        # fenced back), and the two share the partitions instead of stealing them every heartbeat
        def shared() -> bool:
            a, b = first.assignment(), second.assignment()
            return bool(a) and bool(b) and not a & b and len(a | b) == 4

        await until(lambda: polled([first, second], shared), timeout_s=20, what="the two sharing the partitions")
        await stays_false(
            lambda: polled([first, second], lambda: second_watch.fenced_by is not None or not shared()),
            for_s=SETTLED_S,
            what="the second fenced back, or the partitions taken again",
        )
    finally:
        await stop_consumer(first)
        await second.stop()


async def test_a_static_member_that_stops_leaves_the_group_at_once():
    topic, group = await topic_and_group()
    stays, goes = await member(topic, group, "worker-a"), await member(topic, group, "worker-b")
    try:
        await until(
            lambda: polled([stays, goes], lambda: len(stays.assignment()) == 2 == len(goes.assignment())),
            timeout_s=30,
            what="two members with 2 partitions each",
        )
        started = time.monotonic()
        await stop_consumer(goes)
        await until(
            lambda: polled([stays], lambda: len(stays.assignment()) == 4),
            timeout_s=30,
            what="the staying member assigned all 4 partitions",
        )
        # without the leave it waits out the session (2 s): measured 5 s at 6 s, 0.4 s with it
        assert time.monotonic() - started < MEMBERSHIP.session_timeout_ms / 1000
    finally:
        await stays.stop()
