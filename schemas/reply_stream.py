"""Reading and writing a request's reply positions (docs/wire-contract.md, "Reading replies").

A ReplyDelta covers the positions [seq, seq + count) of its request's reply: one per output token,
and a last one without a token (the tail) for text released only at the end. Deltas are repeated
after a worker crash, and a regenerated run may group positions otherwise, so a reader keeps the
number of positions it holds and takes from each delta only the positions past it (`cut`). A
writer may join consecutive deltas into one (`merge`). Pure functions of the wire types: the
gateway, the job runner, `weir replay` and the auditor's comparison read replies with them, the
worker writes with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.messages import ReplyDelta, ReplyEnd


def texts_of(delta: ReplyDelta) -> list[str]:
    """The text of each of its positions, in order."""
    return delta.texts if delta.texts is not None else [delta.text]


def cut(delta: ReplyDelta, have: int) -> ReplyDelta | None:
    """The part of `delta` past the first `have` positions of its request: the delta itself when
    it starts at or after `have`, None when `have` covers all of it, else its positions have..
    with their text, tokens and logprobs (tool call pieces belong to the last position, so they
    are kept)."""
    if have <= delta.seq:
        return delta
    if have >= delta.end:
        return None
    drop = have - delta.seq
    texts = texts_of(delta)[drop:]
    logprobs = delta.logprobs[drop:] if delta.logprobs is not None else None
    return delta.model_copy(
        update={
            "seq": have,
            "count": len(texts),
            "text": "".join(texts),
            "texts": texts if len(texts) > 1 else None,
            "token_ids": delta.token_ids[drop:],
            "logprobs": logprobs,
        }
    )


def can_merge(first: ReplyDelta, then: ReplyDelta) -> bool:
    """True when `then` continues `first` and they can be one delta: the same request, adjacent
    positions, `first` without tool call pieces (they belong to a delta's last position) and
    without a tail (the tail is a reply's last position), both with or both without logprobs,
    and each position with at most one token (a single-position delta of several tokens, as
    writers before coalescing made, is not split into positions)."""
    if first.request_id != then.request_id or first.end != then.seq or first.tool_calls:
        return False
    if (first.logprobs is None) != (then.logprobs is None):
        return False
    return len(first.token_ids) == first.count and len(then.token_ids) <= then.count


def merge(first: ReplyDelta, then: ReplyDelta) -> ReplyDelta:
    """One delta of the positions of `first` and then of `then` (can_merge must hold), created
    when `then` was."""
    if not can_merge(first, then):
        raise ValueError(f"delta at {then.seq} of {then.request_id} cannot join the one at {first.seq}")
    texts = texts_of(first) + texts_of(then)
    logprobs = first.logprobs + then.logprobs if first.logprobs is not None and then.logprobs is not None else None
    return first.model_copy(
        update={
            "count": len(texts),
            "text": first.text + then.text,
            "texts": texts,
            "token_ids": first.token_ids + then.token_ids,
            "logprobs": logprobs,
            "tool_calls": then.tool_calls,
            "created_ms": then.created_ms,
        }
    )


@dataclass
class ReplyCursor:
    """One request's reply as a reader that keeps what arrives in order takes it: the positions
    it holds (`have`) and whether its terminal came. `take` returns the new part of an event, or
    None for a repeat (or anything after the terminal). A delta past `have` is taken as it is
    (the positions between never came: a gap, counted in `missing`)."""

    have: int = 0
    is_ended: bool = False
    missing: int = 0

    def take(self, event: ReplyDelta | ReplyEnd) -> ReplyDelta | ReplyEnd | None:
        if self.is_ended:
            return None
        if isinstance(event, ReplyEnd):
            self.is_ended = True
            self.missing += max(0, event.seq - self.have)
            return event
        part = cut(event, self.have)
        if part is None:
            return None
        self.missing += part.seq - self.have
        self.have = part.end
        return part
