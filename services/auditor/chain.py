"""The hash chain of the audit log: how a record is hashed, and how a chain is checked.

A record is the canonical JSON (orjson, sorted keys, no whitespace) of

    {"event": <AuditEvent as JSON>,
     "ledger": {"seq": n, "kafka_partition": p, "kafka_offset": o, "appended_ms": t}}

and record_hash = sha256(prev_hash || canonical_json), where prev_hash is the record_hash of
record n-1 (GENESIS_HASH for n = 1), over bytes: the 64 hex digits of prev_hash followed by the
JSON, both UTF-8. The seq is inside the hashed JSON, so moving a record, or renumbering around a
deleted or inserted one, shows up even when the seq column is rewritten to look contiguous.

What a chain alone cannot show: a forger who rewrites a record and rehashes every record after
it, or who appends well-formed records at the end, or who deletes the newest records. Against
those, keep the head hash (VerifyReport.head_hash) somewhere the ledger's owner cannot write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson

GENESIS_HASH = "0" * 64

Tamper = Literal["edited", "deleted", "inserted", "reordered"]


def canonical_record(event: dict[str, Any], seq: int, partition: int, offset: int, appended_ms: int) -> str:
    """The canonical JSON text of one record (the bytes its hash is taken over, as str)."""
    record = {
        "event": event,
        "ledger": {"seq": seq, "kafka_partition": partition, "kafka_offset": offset, "appended_ms": appended_ms},
    }
    return orjson.dumps(record, option=orjson.OPT_SORT_KEYS).decode("utf-8")


def chain_hash(prev_hash: str, canonical_json: str) -> str:
    """sha256(prev_hash || canonical_json) as 64 hex digits."""
    return hashlib.sha256(prev_hash.encode("utf-8") + canonical_json.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ChainRow:
    """One stored record as verification sees it.

    `hashed_seq` is the seq inside the hashed JSON (None when the JSON is unreadable);
    `problem` is set when the row is inconsistent with itself (content edited).
    """

    seq: int
    event_id: str
    hashed_seq: int | None
    prev_hash: str
    record_hash: str
    problem: str | None = None


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of walking the chain: intact, or the first broken record and what is wrong."""

    num_records: int
    head_hash: str
    broken_seq: int | None = None
    broken_event_id: str | None = None
    kind: Tamper | None = None
    reason: str | None = None

    @property
    def is_ok(self) -> bool:
        """True when every record is intact and linked to the one before it."""
        return self.kind is None

    def describe(self) -> str:
        """One line for a person: 'OK: N records, chain intact' or 'BROKEN at record seq=K ...'."""
        if self.is_ok:
            return f"OK: {self.num_records} records, chain intact (head {self.head_hash})"
        return f"BROKEN at record seq={self.broken_seq} (event_id={self.broken_event_id}): {self.kind}: {self.reason}"


# Given a hashed seq, where is the record chained under it now: (seq column, event_id), or None.
Locate = Callable[[int], "tuple[int, str] | None"]


def verify_chain(rows: Iterable[ChainRow], num_records: int, locate: Locate) -> VerifyReport:
    """Walk `rows` in seq order and report the first broken record.

    Pure: `rows` streams the table, `locate` answers where a record chained as a given seq now
    sits (only asked once something is already wrong).
    """
    it: Iterator[ChainRow] = iter(rows)
    prev: ChainRow | None = None
    prev_prev_hash = GENESIS_HASH  # record_hash two positions back, for spotting an intruder
    expected_prev = GENESIS_HASH
    cur = next(it, None)
    position = 0
    while cur is not None:
        position += 1
        nxt = next(it, None)
        broken = _check(cur, nxt, prev, position, expected_prev, prev_prev_hash, locate)
        if broken is not None:
            row, kind, reason = broken
            return VerifyReport(num_records, expected_prev, row.seq, row.event_id, kind, reason)
        prev_prev_hash, expected_prev = expected_prev, cur.record_hash
        prev, cur = cur, nxt
    return VerifyReport(num_records, expected_prev)


def _check(
    cur: ChainRow,
    nxt: ChainRow | None,
    prev: ChainRow | None,
    position: int,
    expected_prev: str,
    prev_prev_hash: str,
    locate: Locate,
) -> tuple[ChainRow, Tamper, str] | None:
    """What is wrong at `cur`, the record at 1-based `position` of the walk, if anything."""
    if cur.problem is not None or cur.hashed_seq is None:
        return cur, "edited", cur.problem or "its record has no seq"
    hashed = cur.hashed_seq
    if hashed > position:
        elsewhere = locate(position)
        if elsewhere is not None:
            seq, event_id = elsewhere
            return cur, "reordered", (
                f"it was chained as seq={hashed}; the record chained as seq={position} "
                f"(event_id={event_id}) now sits at seq={seq}"
            )
        missing = f"seq={position}" if hashed == position + 1 else f"seq={position}..{hashed - 1}"
        return cur, "deleted", f"the record(s) chained before it as {missing} are missing"
    if hashed < position:
        if prev is not None and cur.prev_hash == prev_prev_hash:
            # cur links straight past prev: prev is not part of the chain.
            return prev, "inserted", (
                f"not part of the chain: the record chained as seq={hashed} (event_id={cur.event_id}) "
                f"links directly to the record before it"
            )
        return cur, "reordered", f"it was chained as seq={hashed} but sits at position {position}"
    if cur.prev_hash != expected_prev:
        return _broken_link(cur, nxt, prev, expected_prev)
    if cur.seq != hashed:
        return cur, "edited", f"its seq column was changed from {hashed} (the hashed seq)"
    return None


def _broken_link(
    cur: ChainRow, nxt: ChainRow | None, prev: ChainRow | None, expected_prev: str
) -> tuple[ChainRow, Tamper, str]:
    """cur sits where its seq says but does not link to prev: who broke the link?"""
    nxt_links_to_cur = nxt is not None and nxt.prev_hash == cur.record_hash
    if not nxt_links_to_cur:
        if nxt is not None and nxt.prev_hash == expected_prev:
            return cur, "inserted", "forged: the next record links past it to the record before it"
        if nxt is None:
            return cur, "inserted", (
                "its prev_hash is not the record_hash of the record before it: it was forged, "
                "or the record before it was rewritten and rehashed"
            )
        return cur, "inserted", "forged: its prev_hash links to no record, and no record links to it"
    if prev is None:
        return cur, "edited", "the first record's prev_hash is not the genesis hash"
    return prev, "edited", (
        f"its record_hash is not the one seq={cur.seq} was chained to: it was rewritten and rehashed"
    )
