"""ReplyRouter: dedup by seq, reordering, one terminal, isolation between requests."""

from __future__ import annotations

import asyncio

import pytest

from schemas.messages import ReplyDelta, ReplyEnd
from services.gateway.replies import ReplyRouter


def delta(seq: int, rid: str = "r1") -> ReplyDelta:
    return ReplyDelta(request_id=rid, seq=seq, text=f"t{seq}")


def end(seq: int, rid: str = "r1", reason: str = "stop") -> ReplyEnd:
    return ReplyEnd(request_id=rid, seq=seq, finish_reason=reason)


def drain(queue: asyncio.Queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def seqs(events: list) -> list[tuple[str, int]]:
    return [(e.type, e.seq) for e in events]


async def test_in_order_events_pass_through() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    for event in (delta(0), delta(1), end(2)):
        assert router.on_event(event)
    assert seqs(drain(queue)) == [("delta", 0), ("delta", 1), ("end", 2)]


async def test_repeated_seq_is_dropped() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    router.on_event(delta(0))
    router.on_event(delta(1))
    assert not router.on_event(delta(1))
    assert not router.on_event(delta(0))
    router.on_event(end(2))
    assert seqs(drain(queue)) == [("delta", 0), ("delta", 1), ("end", 2)]
    assert router.num_dropped("r1") == 2


async def test_out_of_order_is_buffered_until_the_gap_fills() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    assert not router.on_event(delta(2))
    assert not router.on_event(end(3))
    assert not router.on_event(delta(2))  # a repeat of a buffered one is dropped too
    assert router.has_gap("r1")
    assert drain(queue) == []
    router.on_event(delta(0))
    assert seqs(drain(queue)) == [("delta", 0)]
    router.on_event(delta(1))
    assert seqs(drain(queue)) == [("delta", 1), ("delta", 2), ("end", 3)]
    assert not router.has_gap("r1")


async def test_first_terminal_ends_the_request() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    router.on_event(delta(0))
    router.on_event(end(1))
    assert not router.on_event(end(1))
    assert not router.on_event(delta(2))
    assert not router.on_event(end(5, reason="error"))
    assert seqs(drain(queue)) == [("delta", 0), ("end", 1)]


async def test_terminal_behind_the_stream_still_ends_it() -> None:
    # A batcher's timeout does not know how many deltas a worker sent: it may carry seq 0.
    router = ReplyRouter()
    queue = router.register("r1")
    router.on_event(delta(0))
    router.on_event(delta(1))
    assert router.on_event(end(0, reason="timeout"))
    events = drain(queue)
    assert seqs(events) == [("delta", 0), ("delta", 1), ("end", 0)]
    assert events[-1].finish_reason == "timeout"


async def test_redone_request_replays_from_zero_without_repeats() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    for s in (0, 1, 2):  # first try, then the worker dies
        router.on_event(delta(s))
    for s in (0, 1, 2, 3):  # the redo from seq 0
        router.on_event(delta(s))
    router.on_event(end(4))
    assert seqs(drain(queue)) == [("delta", 0), ("delta", 1), ("delta", 2), ("delta", 3), ("end", 4)]


async def test_skip_gap_delivers_what_is_buffered() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    router.on_event(delta(0))
    router.on_event(delta(3))
    router.on_event(end(4))
    assert router.skip_gap("r1") == 2
    assert seqs(drain(queue)) == [("delta", 0), ("delta", 3), ("end", 4)]
    assert not router.on_event(delta(1))  # too late now


async def test_requests_are_isolated_and_unknown_ones_ignored() -> None:
    router = ReplyRouter()
    q1 = router.register("r1")
    q2 = router.register("r2")
    router.on_event(delta(0, "r2"))
    router.on_event(delta(0, "r1"))
    assert not router.on_event(delta(0, "nobody"))
    assert seqs(drain(q1)) == [("delta", 0)]
    assert seqs(drain(q2)) == [("delta", 0)]
    router.unregister("r1")
    assert not router.on_event(delta(1, "r1"))
    assert "r1" not in router and len(router) == 1


async def test_register_twice_is_refused() -> None:
    router = ReplyRouter()
    router.register("r1")
    with pytest.raises(ValueError):
        router.register("r1")


def span(seq: int, count: int, rid: str = "r1") -> ReplyDelta:
    """A coalesced delta of positions [seq, seq + count), position i's text `p<i>` and token i."""
    texts = [f"p{i}" for i in range(seq, seq + count)]
    return ReplyDelta(
        request_id=rid,
        seq=seq,
        count=count,
        text="".join(texts),
        texts=texts if count > 1 else None,
        token_ids=list(range(seq, seq + count)),
    )


def positions(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, ReplyDelta))


async def test_a_rerun_coalesced_otherwise_delivers_each_position_once() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    # the first run sent [0,3) and [3,5), then died; the rerun groups [0,2) [2,4) [4,7) and ends at 7
    for event in (span(0, 3), span(3, 2), span(0, 2), span(2, 2), span(4, 3), end(7)):
        router.on_event(event)
    events = drain(queue)
    assert [(e.type, e.seq, getattr(e, "count", None)) for e in events] == [
        ("delta", 0, 3),
        ("delta", 3, 2),
        ("delta", 5, 2),
        ("end", 7, None),
    ]
    assert positions(events) == "".join(f"p{i}" for i in range(7))
    assert events[2].token_ids == [5, 6] and events[2].texts == ["p5", "p6"]
    assert router.num_dropped("r1") == 2


async def test_early_coalesced_deltas_wait_and_are_cut_when_the_gap_fills() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    for event in (span(2, 3), span(3, 3), end(6), span(0, 1)):
        assert not router.on_event(event) or event.seq == 0
    assert positions(drain(queue)) == "p0"  # then nothing: the gap at 1 is still open
    assert router.has_gap("r1")
    router.on_event(span(1, 2))  # fills it, and overlaps the first early one
    events = drain(queue)
    assert [(e.type, e.seq) for e in events] == [("delta", 1), ("delta", 3), ("delta", 5), ("end", 6)]
    assert positions(events) == "p1p2p3p4p5" and not router.has_gap("r1")


async def test_skip_gap_with_overlapping_early_deltas_delivers_each_position_once() -> None:
    router = ReplyRouter()
    queue = router.register("r1")
    for event in (span(0, 1), span(2, 2), span(3, 3), end(6)):
        router.on_event(event)
    assert router.skip_gap("r1") == 1
    events = drain(queue)
    assert positions(events) == "p0p2p3p4p5" and isinstance(events[-1], ReplyEnd) and events[-1].seq == 6
