"""Coalesced reply deltas: positions, cutting, merging, and what a reader assembles
(schemas/reply_stream.py; docs/wire-contract.md, "Reading replies")."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from schemas.codec import DecodeError, decode, decode_reply, encode
from schemas.messages import ReplyDelta, ReplyEnd, TokenLogprob
from schemas.reply_stream import ReplyCursor, can_merge, cut, merge

HERE = Path(__file__).parent


def _lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, token=f"t{token_id}", bytes=[token_id], logprob=-0.1 * token_id)


# One reply as a worker sees it: (token id or None for the tail, text its step released).
# Position 2's step released nothing (an incomplete character); 3 released its and 2's text;
# the tail is text held back (a possible stop string) until the end.
POSITIONS = [(10, "The"), (11, " caf"), (12, ""), (13, "é is"), (14, " open"), (15, ""), (None, ".\n")]


def _single(i: int, logprobs: bool = False) -> ReplyDelta:
    token, text = POSITIONS[i]
    ids = [] if token is None else [token]
    return ReplyDelta(
        request_id="r", seq=i, text=text, token_ids=ids, logprobs=[_lp(t) for t in ids] if logprobs else None
    )


def _grouped(sizes: list[int], logprobs: bool = False) -> list[ReplyDelta]:
    """The reply's positions coalesced into deltas of the given sizes, as a worker's ReplyLane merges them."""
    deltas, i = [], 0
    for size in sizes:
        delta = _single(i, logprobs)
        for j in range(i + 1, i + size):
            delta = merge(delta, _single(j, logprobs))
        deltas.append(delta)
        i += size
    assert i == len(POSITIONS)
    return deltas


def _end() -> ReplyEnd:
    return ReplyEnd(request_id="r", seq=len(POSITIONS), finish_reason="stop")


def _assemble(events) -> tuple[str, list[int], list[int], ReplyCursor]:
    cursor, text, ids, lp_ids = ReplyCursor(), [], [], []
    for event in events:
        part = cursor.take(event)
        if isinstance(part, ReplyDelta):
            text.append(part.text)
            ids += part.token_ids
            lp_ids += [e.token_id for e in part.logprobs or []]
    return "".join(text), ids, lp_ids, cursor


FULL_TEXT = "The café is open.\n"
FULL_IDS = [10, 11, 12, 13, 14, 15]


def test_a_delta_before_coalescing_is_still_valid_and_reads_as_one_position():
    raw = (HERE / "legacy" / "ReplyDelta.json").read_bytes()
    assert b'"count"' not in raw and b'"texts"' not in raw
    delta = decode_reply(raw)
    assert isinstance(delta, ReplyDelta) and delta.count == 1 and delta.texts is None and delta.end == delta.seq + 1
    # A reader of old single-position deltas keeps exactly what `seq > last kept` kept.
    old = [ReplyDelta(request_id="r", seq=i, text=t, token_ids=[i, i + 100]) for i, t in enumerate(["a", "b", "c"])]
    text, *_, cursor = _assemble(
        [old[0], old[1], old[0], old[1], old[2], ReplyEnd(request_id="r", seq=3, finish_reason="stop")]
    )
    assert text == "abc" and cursor.is_ended and cursor.missing == 0


def test_a_coalesced_delta_round_trips_and_states_each_positions_text():
    delta = decode(ReplyDelta, (HERE / "golden" / "ReplyDeltaCoalesced.json").read_bytes())
    assert (delta.seq, delta.count, delta.end) == (3, 4, 7)
    assert "".join(delta.texts) == delta.text and len(delta.token_ids) == delta.count
    assert orjson.loads(encode(delta))["count"] == 4


@pytest.mark.parametrize(
    "change, why",
    [
        ({"texts": None}, "needs the text of each"),
        ({"texts": ["a", "b"]}, "needs the text of each"),
        ({"texts": [" Paris", ":", "", " cafe"]}, "join to text"),
        ({"token_ids": [1, 2]}, "one token per position"),
        ({"token_ids": [1, 2, 3, 4, 5]}, "one token per position"),
        ({"count": 1}, "only a delta of several positions"),
        ({"count": 0}, "greater than or equal to 1"),
        ({"logprobs": [{"token_id": 1, "token": "a", "bytes": [97], "logprob": -1.0}]}, "logprobs: 1 entries for 4"),
    ],
)
def test_a_coalesced_delta_that_does_not_state_its_positions_is_refused(change, why):
    raw = orjson.loads((HERE / "golden" / "ReplyDeltaCoalesced.json").read_bytes())
    with pytest.raises(DecodeError, match=why):
        decode(ReplyDelta, orjson.dumps({**raw, **change}))


def test_a_reader_holding_k_positions_keeps_exactly_the_rest_of_an_overlapping_delta():
    delta = _grouped([1, 6], logprobs=True)[1]  # positions 1..6, the tail last
    assert (delta.seq, delta.count, len(delta.token_ids)) == (1, 6, 5)
    for k in range(9):
        part = cut(delta, k)
        if k >= 7:
            assert part is None
            continue
        first = max(k, 1)
        assert part.seq == first and part.end == 7
        assert part.text == "".join(t for _, t in POSITIONS[first:])
        assert part.token_ids == [t for t, _ in POSITIONS[first:] if t is not None]
        assert [e.token_id for e in part.logprobs] == part.token_ids
        assert (part.count == 1 and part.texts is None) or part.texts == [t for _, t in POSITIONS[first:]]
        decode(ReplyDelta, encode(part))  # still a valid delta


def test_tool_call_pieces_belong_to_the_last_position_and_survive_a_cut():
    from schemas.messages import ToolCallDelta

    calls = [ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")]
    a = ReplyDelta(request_id="r", seq=0, text="", token_ids=[5])
    b = ReplyDelta(request_id="r", seq=1, text="", token_ids=[6], tool_calls=calls)
    joined = merge(a, b)
    assert joined.tool_calls == calls and cut(joined, 1).tool_calls == calls
    assert not can_merge(b, ReplyDelta(request_id="r", seq=2, text="x", token_ids=[7]))  # nothing joins after them


def test_merge_refuses_what_is_not_adjacent_or_after_a_tail():
    assert not can_merge(_single(0), _single(2))
    assert not can_merge(_single(1), _single(0))
    tail = _single(6)
    assert not can_merge(tail, ReplyDelta(request_id="r", seq=7, text="x", token_ids=[1]))
    with pytest.raises(ValueError):
        merge(_single(0), _single(2))


def test_runs_that_coalesce_differently_assemble_the_same_reply_whatever_the_repeats():
    rng = random.Random(7)
    n = len(POSITIONS)
    for trial in range(300):
        runs = []
        for _ in range(rng.randint(1, 3)):  # the first run and its regenerations, each grouped its own way
            sizes, left = [], n
            while left:
                sizes.append(rng.randint(1, left))
                left -= sizes[-1]
            runs.append(_grouped(sizes, logprobs=True))
        # a reader sees a prefix of each broken run, then the last run whole, interleaved in order
        events = []
        for run in runs[:-1]:
            events += run[: rng.randint(0, len(run))]
        last = runs[-1]
        split = rng.randint(0, len(last))
        events += last[:split] + [d for run in runs[:-1] for d in run[: rng.randint(0, len(run))]] + last[split:]
        events.append(_end())
        text, ids, lp_ids, cursor = _assemble(events)
        assert text == FULL_TEXT, (trial, events)
        assert ids == FULL_IDS and lp_ids == FULL_IDS
        assert cursor.have == n and cursor.missing == 0 and cursor.is_ended


def test_a_gap_is_counted_and_the_end_after_the_last_delta():
    deltas = _grouped([2, 2, 3])
    text, _, _, cursor = _assemble([deltas[0], deltas[2], _end()])
    assert cursor.missing == 2 and text == "The caf" + "".join(t for _, t in POSITIONS[4:])
    _, _, _, cursor = _assemble([deltas[0], ReplyEnd(request_id="r", seq=7, finish_reason="stop")])
    assert cursor.missing == 5
