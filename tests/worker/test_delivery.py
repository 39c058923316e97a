"""delivery.py: when a run that could not be written runs again, and the fail-fast writer; and how
it runs again (publisher.py through dispatch.py, as the model server ran it first)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiokafka.errors import InvalidTopicError, KafkaConnectionError, KafkaTimeoutError, NotLeaderForPartitionError

from schemas.codec import decode_reply
from schemas.messages import ReplyEnd, now_ms
from services.worker.kafka.delivery import RedoPolicy, Writer, failure_of, first_failure, is_outage
from services.worker.kafka.dispatch import Dispatch
from services.worker.kafka.intake import InFlight, Intake
from services.worker.kafka.publisher import Publisher

from .factories import make_model_config, make_request


def test_outages_are_told_from_refusals() -> None:
    assert (
        is_outage(KafkaTimeoutError()) and is_outage(KafkaConnectionError()) and is_outage(NotLeaderForPartitionError())
    )
    assert not is_outage(InvalidTopicError()) and not is_outage(ValueError())


def test_redo_backs_off_and_gives_up_past_the_deadline_grace_or_on_a_refusal() -> None:
    policy = RedoPolicy(first_delay_s=0.5, max_delay_s=4, grace_after_deadline_s=60)
    deadline = 100_000
    assert [policy.next_try_s(KafkaTimeoutError(), n, deadline, 0) for n in range(6)] == [0.5, 1, 2, 4, 4, 4]
    assert policy.next_try_s(KafkaTimeoutError(), 0, deadline, deadline + 59_000) == 0.5  # to write its timeout
    assert policy.next_try_s(KafkaTimeoutError(), 0, deadline, deadline + 61_000) is None
    assert policy.next_try_s(InvalidTopicError(), 0, deadline, 0) is None


class FakeProducer:
    """send() as aiokafka's: returns the future of the write; `fail_with` makes send() raise."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.fail_with: BaseException | None = None
        self.futures: list[asyncio.Future] = []
        # The producer's metadata: every topic known (TopicWriter then sends at once).
        self.client = SimpleNamespace(cluster=SimpleNamespace(partitions_for_topic=lambda topic: {0}))

    async def send(
        self,
        topic: str,
        value: bytes,
        key: bytes,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future:
        if self.fail_with is not None:
            raise self.fail_with
        self.sent.append((topic, value))
        future = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future


async def test_writer_fails_fast_during_an_outage_and_probes_once_a_second() -> None:
    now = [0.0]
    producer = FakeProducer()
    writer = Writer(producer, probe_interval_s=1.0, clock=lambda: now[0])
    producer.fail_with = KafkaTimeoutError()
    with pytest.raises(KafkaTimeoutError):
        await (await writer.send("t", b"1", b"k"))
    assert writer.is_down
    producer.fail_with = None
    now[0] = 0.5  # within the probe interval: not tried
    with pytest.raises(KafkaConnectionError):
        await (await writer.send("t", b"2", b"k"))
    assert producer.sent == []
    now[0] = 1.1  # the probe
    future = await writer.send("t", b"3", b"k")
    assert producer.sent == [("t", b"3")]
    producer.futures[0].set_result("metadata")
    assert await future == "metadata"
    await asyncio.sleep(0)  # the done-callback
    assert not writer.is_down


async def test_a_refused_topic_does_not_stop_the_writes_to_others() -> None:
    producer = FakeProducer()
    writer = Writer(producer)
    producer.fail_with = InvalidTopicError()
    with pytest.raises(InvalidTopicError):
        await (await writer.send("bad topic", b"1", b"k"))
    assert not writer.is_down
    producer.fail_with = None
    await writer.send("good", b"2", b"k")
    assert producer.sent == [("good", b"2")]


async def test_first_failure_waits_for_every_write_and_names_the_first_that_failed() -> None:
    loop = asyncio.get_running_loop()
    ok, late, failed = loop.create_future(), loop.create_future(), loop.create_future()
    ok.set_result(1)
    failed.set_exception(KafkaTimeoutError())
    loop.call_later(0.01, late.set_exception, NotLeaderForPartitionError())
    exc = await first_failure([ok, late, failed])
    assert isinstance(exc, NotLeaderForPartitionError)  # in order, not in time
    assert late.done() and failure_of(failed) is not None
    assert await first_failure([ok]) is None
    assert failure_of(loop.create_future()) is None  # pending


class FakeHost:
    """An engine host as Dispatch drives it: what was submitted, an event per submission."""

    num_pending = 0
    weights_sha256 = "0" * 64

    def __init__(self) -> None:
        self.submitted: list = []
        self.ran = asyncio.Event()

    def submit(self, request) -> None:
        self.submitted.append(request)
        self.ran.set()

    def cancel(self, request_id: str) -> None:
        pass


class SignallingProducer(FakeProducer):
    """FakeProducer with an event set by each write."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = asyncio.Event()

    async def send(
        self,
        topic: str,
        value: bytes,
        key: bytes,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future:
        future = await super().send(topic, value, key, partition, headers)
        self.wrote.set()
        return future


async def test_a_run_that_could_not_be_written_runs_again_through_the_dispatch_or_ends_there() -> None:
    config, host, producer, intake = make_model_config("tiny"), FakeHost(), SignallingProducer(), Intake()
    dispatch = Dispatch(config, [host])
    publisher = Publisher(
        config,
        Writer(producer),
        "weir.audit",
        intake,
        dispatch,
        worker_id="w",
        audit_key=b"k" * 32,
        redo_policy=RedoPolicy(first_delay_s=0.01),
    )
    request = make_request()
    flight = InFlight(request, "b1")
    intake.in_flight[request.request_id] = flight
    assert dispatch.run(flight, now_ms()) is None and host.submitted == [request] and flight.host is host
    host.ran.clear()
    publisher.redo_later(flight, KafkaTimeoutError())  # a write of its run failed: the broker was away
    await asyncio.wait_for(host.ran.wait(), 5)
    assert host.submitted == [request, request] and flight.num_redos == 1 and producer.sent == []

    dispatch.recent_cancels[request.request_id] = now_ms()  # cancelled before its next try
    publisher.redo_later(flight, KafkaTimeoutError())
    await asyncio.wait_for(producer.wrote.wait(), 5)
    assert len(host.submitted) == 2  # not run again: ended here, its end written to its reply topic
    [(topic, value)] = producer.sent
    end = decode_reply(value)
    assert topic == request.reply_to and isinstance(end, ReplyEnd) and end.finish_reason == "cancelled"
