"""TopicWriter's classification of failures, with a fake producer (the real broker:
test_reply_topics_kafka.py, tests/worker/test_reply_to_kafka.py): what the broker says about
a topic fails that topic's sends (TopicRefused, not retriable); a broker that does not answer is
an outage (retriable), as before."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError

from services.worker.kafka.delivery import is_outage
from tests.waiting import until
from weir.reply_topics import TopicRefused, TopicWriter

UNKNOWN_TOPIC, LEADER_NOT_AVAILABLE, TOPIC_AUTHORIZATION_FAILED = 3, 5, 29


class FakeClient:
    """The producer's client: its cluster metadata, and answers to MetadataRequests."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.answer: int | None = None  # error code per topic; None: no broker answers
        self.num_lookups = 0
        self.cluster = SimpleNamespace(partitions_for_topic=lambda t: {0} if t in self.known else None)

    def get_random_node(self) -> int:
        return 1

    async def send(self, node_id: int, request) -> SimpleNamespace:
        self.num_lookups += 1
        if self.answer is None:
            raise KafkaConnectionError("connection refused")
        partitions = [(0, 0, 1, [1], [1])] if self.answer == 0 else []
        return SimpleNamespace(topics=[(self.answer, request._topics[0], False, partitions)])


class FakeProducer:
    def __init__(self) -> None:
        self.client = FakeClient()
        self.sent: list[tuple[str, bytes]] = []
        self.futures: list[asyncio.Future] = []

    async def send(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future:
        self.sent.append((topic, value))
        future = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future

    async def partitions_for(self, topic: str) -> set[int]:
        self.client.known.add(topic)
        return {0}


def writer_of(producer: FakeProducer, **kw) -> TopicWriter:
    return TopicWriter(producer, lookup_timeout_s=0.5, **kw)


async def test_a_topic_the_broker_does_not_know_is_refused_without_an_outage() -> None:
    producer = FakeProducer()
    producer.client.answer = UNKNOWN_TOPIC
    writer = writer_of(producer, auto_create=False)
    with pytest.raises(TopicRefused, match="does not exist") as caught:
        await (await writer.send("weir.replies.gone", b"1", b"k"))
    assert not is_outage(caught.value) and producer.sent == []


async def test_a_topic_not_authorised_is_refused_even_when_asked_to_create_it() -> None:
    producer = FakeProducer()
    producer.client.answer = TOPIC_AUTHORIZATION_FAILED
    writer = writer_of(producer, auto_create=True)
    with pytest.raises(TopicRefused, match="not authorised"):
        await (await writer.send("weir.replies.theirs", b"1", b"k"))


async def test_asked_to_create_it_a_missing_topic_is_waited_for_then_refused() -> None:
    producer = FakeProducer()
    producer.client.answer = UNKNOWN_TOPIC
    writer = writer_of(producer, auto_create=True)
    with pytest.raises(TopicRefused, match="does not exist"):
        await (await writer.send("weir.replies.gone", b"1", b"k"))
    assert producer.client.num_lookups > 1  # it asked again while the topic might be being created


async def test_no_broker_answering_a_lookup_is_an_outage_not_a_refusal() -> None:
    producer = FakeProducer()
    writer = writer_of(producer)
    with pytest.raises(KafkaConnectionError) as caught:
        await (await writer.send("weir.replies.new", b"1", b"k"))
    assert is_outage(caught.value) and writer.refusal("weir.replies.new") is None


async def test_a_refused_topic_fails_at_once_for_a_while_then_is_looked_up_again() -> None:
    now = [0.0]
    producer = FakeProducer()
    producer.client.answer = UNKNOWN_TOPIC
    writer = TopicWriter(producer, auto_create=False, refused_for_s=10, clock=lambda: now[0])
    with pytest.raises(TopicRefused):
        await (await writer.send("weir.replies.late", b"1", b"k"))
    lookups = producer.client.num_lookups
    again = await writer.send("weir.replies.late", b"2", b"k")
    assert again.done() and isinstance(again.exception(), TopicRefused)
    assert producer.client.num_lookups == lookups and writer.num_refused == 2
    now[0] = 11.0  # made meanwhile: the next send looks it up and goes out
    producer.client.answer = 0
    future = await writer.send("weir.replies.late", b"3", b"k")
    await until(lambda: producer.sent, timeout_s=5, what="the send to go out")
    assert producer.sent == [("weir.replies.late", b"3")]
    producer.futures[0].set_result("ok")
    assert await future == "ok"


async def test_a_write_to_a_known_topic_that_timed_out_is_refused_when_the_topic_is_gone() -> None:
    producer = FakeProducer()
    producer.client.known.add("weir.replies.deleted")
    writer = writer_of(producer, auto_create=False)
    future = await writer.send("weir.replies.deleted", b"1", b"k")
    producer.client.answer = UNKNOWN_TOPIC  # deleted meanwhile
    producer.futures[0].set_exception(KafkaTimeoutError())
    with pytest.raises(TopicRefused):
        await future


async def test_a_write_that_timed_out_with_no_broker_answering_stays_an_outage() -> None:
    producer = FakeProducer()
    producer.client.known.add("weir.replies.fine")
    writer = writer_of(producer)
    future = await writer.send("weir.replies.fine", b"1", b"k")
    producer.futures[0].set_exception(KafkaTimeoutError())  # the broker is away (answer None)
    with pytest.raises(KafkaTimeoutError):
        await future
    assert producer.client.num_lookups == 1  # one try, not the whole lookup timeout


async def test_a_write_that_timed_out_while_the_topic_still_exists_stays_an_outage() -> None:
    producer = FakeProducer()
    producer.client.known.add("weir.replies.fine")
    producer.client.answer = LEADER_NOT_AVAILABLE  # an election: no leader for a while
    writer = writer_of(producer)
    future = await writer.send("weir.replies.fine", b"1", b"k")
    producer.futures[0].set_exception(KafkaTimeoutError())
    with pytest.raises(KafkaTimeoutError):
        await future
