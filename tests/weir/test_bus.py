"""The shared offset bookkeeping: OffsetTracker (what is safe to commit) and CommitPacer (when)."""

from __future__ import annotations

from aiokafka import TopicPartition

from weir.bus import CommitPacer, OffsetTracker

TP = TopicPartition("t", 0)


def test_tracker_commits_only_below_the_lowest_offset_in_flight() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.add(TP, offset)
    tracker.done(TP, 11)  # finished out of order
    assert tracker.committable() == {}
    tracker.done(TP, 10)
    assert tracker.committable() == {TP: 12}
    assert tracker.committable() == {}  # reported once
    assert tracker.num_in_flight() == 1
    tracker.done(TP, 99)  # unknown: ignored
    tracker.done(TP, 12)
    assert tracker.committable() == {TP: 13}


def test_pacer_spaces_commits_by_the_interval(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("weir.bus.time.monotonic", lambda: clock[0])
    pacer = CommitPacer(200)
    assert pacer.is_due()  # the first chance commits
    clock[0] += 0.15
    assert not pacer.is_due()
    clock[0] += 0.06
    assert pacer.is_due()
    assert not pacer.is_due()


def test_pacer_with_no_interval_is_always_due() -> None:
    pacer = CommitPacer(0)
    assert all(pacer.is_due() for _ in range(5))
