"""The intake's account of requests and batch offsets: a batch is committable only once every
request in it is done. Pure bookkeeping, no broker (the model server's handling of a refused
request is tested here too, with an in-memory producer)."""

from __future__ import annotations

import pytest
from aiokafka import ConsumerRecord, TopicPartition

from schemas.codec import decode, encode
from schemas.messages import Batch, DeadLetter
from services.worker.kafka.consumers import ModelServer
from services.worker.kafka.intake import ConflictingRequest, Intake
from weir.bus import BusSettings

from .factories import make_model_config, make_request

TP0 = TopicPartition("weir.batches.tiny", 0)
TP1 = TopicPartition("weir.batches.tiny", 1)


def take_batch(intake: Intake, tp: TopicPartition, offset: int, requests: list) -> list:
    """Read a batch record of `requests`; returns the flights to start."""
    intake.add_record(tp, offset)
    intake.add_batch((tp, offset), len(requests))
    return [f for r in requests if (f := intake.take(r, f"b{offset}", (tp, offset))) is not None]


def test_a_batch_is_committable_once_every_request_in_it_is_done() -> None:
    intake = Intake()
    first, second = take_batch(intake, TP0, 10, [make_request(), make_request()])
    intake.forget(second)  # out of order
    assert intake.tracker.committable() == {}
    intake.forget(first)
    assert intake.tracker.committable() == {TP0: 11}
    assert intake.num_done == 2 and intake.in_flight == {}


def test_a_request_redelivered_in_another_batch_runs_once_and_closes_both() -> None:
    intake = Intake()
    request = make_request()
    [flight] = take_batch(intake, TP0, 10, [request])
    assert take_batch(intake, TP0, 11, [request]) == []  # the running flight answers it
    assert flight.offsets == [(TP0, 10), (TP0, 11)]
    intake.forget(flight)
    assert intake.tracker.committable() == {TP0: 12}


def test_a_dead_lettered_record_is_done_at_once_but_waits_for_those_before_it() -> None:
    intake = Intake()
    [flight] = take_batch(intake, TP0, 10, [make_request()])
    intake.add_record(TP0, 11)
    intake.skip_record(TP0, 11)
    assert intake.tracker.committable() == {}
    intake.forget(flight)
    assert intake.tracker.committable() == {TP0: 12}
    assert intake.next_offsets == {0: 12}


def test_only_the_current_flight_of_a_request_is_forgotten() -> None:
    intake = Intake()
    request = make_request()
    [old] = take_batch(intake, TP0, 10, [request])
    intake.forget(old)
    [new] = take_batch(intake, TP0, 11, [request])  # taken again after it ended (a later redelivery)
    intake.forget(old)  # a stale settle of the old run changes nothing
    assert intake.is_current(new) and not intake.is_current(old)
    assert intake.num_done == 1 and intake.tracker.committable() == {TP0: 11}


def test_revoked_partitions_are_forgotten_and_next_offsets_follow_the_assignment() -> None:
    intake = Intake()
    [lost] = take_batch(intake, TP0, 10, [make_request()])
    [kept] = take_batch(intake, TP1, 20, [make_request()])
    intake.revoke([TP0])
    intake.keep_partitions([1])
    intake.forget(lost)  # its record went with the partition: nothing to commit there
    intake.forget(kept)
    assert intake.tracker.committable() == {TP1: 21}
    assert intake.next_offsets == {1: 21}


def test_a_request_reusing_a_live_id_with_other_content_is_refused_and_closes_its_batch() -> None:
    """A forged (or colliding) record under a running request's id is never taken: its reply_to
    may be the running request's topic. Only how it was routed may differ in a redelivery."""
    intake = Intake()
    victim = make_request("the victim's prompt", reply_to="weir.replies.victim")
    [flight] = take_batch(intake, TP0, 10, [victim])
    forged = victim.model_copy(update={"prompt": "another prompt", "tenant": "mallory"})
    intake.add_record(TP0, 11)
    intake.add_batch((TP0, 11), 1)
    with pytest.raises(ConflictingRequest):
        intake.take(forged, "b11", (TP0, 11))
    assert intake.in_flight == {victim.request_id: flight} and flight.offsets == [(TP0, 10)]
    assert intake.tracker.committable() == {}  # the victim's record still waits for its run
    rerouted = victim.model_copy(update={"assignment": "canary", "mirrors": ["2"]})
    assert take_batch(intake, TP0, 12, [rerouted]) == []  # the same request, routed anew: the run answers it
    intake.forget(flight)
    assert intake.tracker.committable() == {TP0: 13}  # the forged record was done when it was refused


class _Producer:
    """Records what is sent (the one handler under test writes only dead letters here)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.sent.append((topic, value))


class _Host:
    num_pending = 0

    def __init__(self) -> None:
        self.submitted: list = []

    def submit(self, request) -> None:
        self.submitted.append(request)


async def test_the_model_server_dead_letters_the_conflicting_record_and_runs_only_the_victim(caplog) -> None:
    producer, host = _Producer(), _Host()
    server = ModelServer(make_model_config("tiny", engine="torch"), [host], BusSettings(), producer, "w1", b"k")
    victim = make_request(model=server.served_id, reply_to="weir.replies.victim")
    forged = victim.model_copy(update={"prompt": "another prompt", "tenant": "mallory"})
    for offset, request in ((10, victim), (11, forged), (12, victim)):  # the victim's redelivery stays silent
        batch = Batch(batch_id=f"b{offset}", batcher_id="bt", model=server.served_id, requests=[request])
        record = ConsumerRecord(TP0.topic, 0, offset, 0, 0, None, encode(batch), None, 0, 0, [])
        await server.on_batch_record(TP0, record)
    assert host.submitted == [victim]  # one run, the victim's
    [(topic, value)] = producer.sent  # nothing but one dead letter: no reply to anyone
    letter = decode(DeadLetter, value)
    assert topic == server.topics.dead_letter and letter.offset == 11
    assert "duplicate request_id with different content" in letter.reason and victim.request_id in letter.reason
    assert [r.levelname for r in caplog.records if "duplicate request_id" in r.getMessage()] == ["WARNING"]
