"""How `weir chaos` counts what a client saw: duplicated tokens, ends, stalls (no stack needed)."""

from __future__ import annotations

import orjson

from bench.chaos import Request, _on_event, stall_s


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return orjson.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_a_content_event_of_a_seq_seen_before_is_a_duplicate_and_the_terminal_counts_once() -> None:
    r = Request(0, {}, "interactive", started=1.0)
    for event_id, data in [
        (b"0", chunk("def")),
        (b"1", chunk(" f")),
        (b"1", chunk(" f")),  # a resume that repeats seq 1
        (b"2", chunk("()")),
        (b"3", chunk(finish="length")),
        (b"3", b"[DONE]"),
    ]:
        _on_event(r, event_id, data)
    assert r.num_duplicated == 1 and "".join(r.text) == "def f f()"
    assert r.num_ends == 1 and r.last_id == 3 and r.ended_at is not None and r.ended_once


def test_an_error_event_is_a_failure_not_an_end() -> None:
    r = Request(0, {}, "bulk", started=1.0)
    _on_event(r, b"0", orjson.dumps({"error": {"message": "deadline"}}))
    _on_event(r, b"0", b"[DONE]")
    assert r.errors == ["deadline"] and not r.ended_once


def test_the_stall_of_a_fault_is_the_longest_gap_ending_after_it() -> None:
    r = Request(0, {}, "interactive", started=10.0, times=[10.5, 11.0, 15.0, 15.2], ended_at=15.2)
    assert stall_s(r, 12.0) == 4.0  # 11.0 -> 15.0 spans the fault
    assert stall_s(r, 9.0) is None  # not started yet
    assert stall_s(r, 16.0) is None  # already over
    # one that never ended stalled from its last event until its client gave up
    assert stall_s(Request(1, {}, "bulk", started=11.0, times=[11.1], over_at=31.1), 12.0) == 20.0
