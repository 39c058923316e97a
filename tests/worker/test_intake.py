"""The intake's account of requests and batch offsets: a batch is committable only once every
request in it is done. Pure bookkeeping, no broker."""

from __future__ import annotations

from aiokafka import TopicPartition

from services.worker.intake import Intake

from .factories import make_request

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
