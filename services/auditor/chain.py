"""The hash chain of the audit log: how a record is hashed, and how a chain is checked.

There is one chain per partition of the audit topic (chain_id = the partition number). A record
is the canonical JSON (orjson, sorted keys, no whitespace) of

    {"event": <AuditEvent as JSON>,
     "ledger": {"chain_id": c, "seq": n, "kafka_partition": p, "kafka_offset": o, "appended_ms": t}}

and record_hash = sha256(prev_hash || canonical_json), where prev_hash is the record_hash of
record n-1 of the same chain (GENESIS_HASH for n = 1), over bytes: the 64 hex digits of prev_hash
followed by the JSON, both UTF-8. The chain and seq are inside the hashed JSON, so moving a
record, or renumbering around a deleted or inserted one, shows up even when the columns are
rewritten to look contiguous.

Every so many records or seconds a chain gets a checkpoint: the Merkle root (RFC 6962 shape) of
the record hashes since the previous checkpoint, itself hash-chained to the previous checkpoint.

Each checkpoint also carries a MAC (checkpoint_mac) under the deployment's checkpoint key, and
the auditor publishes it to Kafka as an AuditAnchor (services/auditor/anchors.py).

What a chain alone cannot show: a forger who rewrites a record and rehashes every record after
it, or who appends well-formed records at the end, or who deletes the newest records.
Checkpoints catch the first and the last for the records they cover; recomputing them needs the
checkpoint key (their MACs), and deleting the newest ones shows against the anchors in Kafka
(docs/design.md, "The audit chain").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

GENESIS_HASH = "0" * 64

Tamper = Literal["edited", "deleted", "inserted", "reordered", "forged"]
# Which log a chain belongs to: the AuditEvents' (audit_log) or the ReviewFlags' (review_flags).
Log = Literal["audit", "review_flags"]


def canonical_record(
    event: dict[str, Any], seq: int, partition: int, offset: int, appended_ms: int, chain_id: int | None = None
) -> str:
    """The canonical JSON text of one record (the bytes its hash is taken over, as str).

    `chain_id` defaults to the partition: one chain per audit-topic partition.
    """
    ledger = {
        "chain_id": partition if chain_id is None else chain_id,
        "seq": seq,
        "kafka_partition": partition,
        "kafka_offset": offset,
        "appended_ms": appended_ms,
    }
    return orjson.dumps({"event": event, "ledger": ledger}, option=orjson.OPT_SORT_KEYS).decode("utf-8")


def canonical_checkpoint(
    chain_id: int, num: int, first_seq: int, last_seq: int, merkle_root: str, last_record_hash: str, created_ms: int
) -> str:
    """The canonical JSON text of one checkpoint of a chain (hashed like a record)."""
    checkpoint = {
        "chain_id": chain_id,
        "num": num,
        "first_seq": first_seq,
        "last_seq": last_seq,
        "merkle_root": merkle_root,
        "last_record_hash": last_record_hash,
        "created_ms": created_ms,
    }
    return orjson.dumps({"checkpoint": checkpoint}, option=orjson.OPT_SORT_KEYS).decode("utf-8")


_MAC_CONTEXT = b"weir.audit.checkpoint.v1"


def checkpoint_mac(key: bytes, log: Log, chain_id: int, checkpoint_hash: str) -> str:
    """HMAC-SHA256 (64 hex digits) of one checkpoint under the deployment's checkpoint key.

    It covers the checkpoint_hash, which covers the checkpoint's canonical JSON (chain, number,
    covered seqs, Merkle root, head record hash, time) and, through prev_hash, every checkpoint
    before it; the log and chain are in the message too, so a MAC cannot be moved to another chain.
    """
    message = b"\n".join([_MAC_CONTEXT, log.encode(), str(chain_id).encode(), checkpoint_hash.encode()])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def mac_matches(key: bytes, log: Log, chain_id: int, checkpoint_hash: str, mac: object) -> bool:
    """True when `mac` is the checkpoint's MAC under `key` (compared in constant time)."""
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(checkpoint_mac(key, log, chain_id, checkpoint_hash), mac)


def merkle_root(record_hashes: list[str]) -> str:
    """Merkle tree hash (RFC 6962, section 2.1) over the record hashes (hex), as 64 hex digits.

    leaf = sha256(0x00 || bytes(record_hash)), node = sha256(0x01 || left || right), the left
    subtree holding the largest power of two below n leaves. Empty list: sha256 of nothing.
    """
    leaves = [hashlib.sha256(b"\x00" + bytes.fromhex(h)).digest() for h in record_hashes]
    return _merkle(leaves).hex()


def _merkle(nodes: list[bytes]) -> bytes:
    if not nodes:
        return hashlib.sha256(b"").digest()
    if len(nodes) == 1:
        return nodes[0]
    split = 1 << ((len(nodes) - 1).bit_length() - 1)
    return hashlib.sha256(b"\x01" + _merkle(nodes[:split]) + _merkle(nodes[split:])).digest()


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


def stored_row(
    row: dict[str, Any], id_column: str, what: str, hashed_columns: Callable[[dict[str, Any]], dict[str, Any]]
) -> ChainRow:
    """A stored row (of the audit log or the review flags) as the chain walk needs it, with any
    inconsistency inside the row found.

    `hashed_columns` maps the parsed canonical record to the column values it fixes; it raises
    KeyError/TypeError/ValueError/AttributeError when the JSON is not such a record (`what`).
    """
    base = {
        "seq": row["seq"],
        "event_id": row[id_column],
        "prev_hash": row["prev_hash"],
        "record_hash": row["record_hash"],
    }
    canonical = row["canonical_json"]
    if not all(isinstance(row[name], str) for name in ("canonical_json", "prev_hash", "record_hash")):
        return ChainRow(hashed_seq=None, problem="its canonical_json or hashes are not text", **base)
    if chain_hash(row["prev_hash"], canonical) != row["record_hash"]:
        return ChainRow(
            hashed_seq=None, problem="record_hash does not match its content (content or hash edited)", **base
        )
    try:
        record = orjson.loads(canonical)
        hashed_seq = int(record["ledger"]["seq"])
        hashed = hashed_columns(record)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return ChainRow(hashed_seq=None, problem=f"its canonical_json is not {what}", **base)
    for name, value in hashed.items():
        if row[name] != value:
            return ChainRow(
                hashed_seq=hashed_seq,
                problem=f"column {name}={row[name]!r} differs from the hashed record ({value!r})",
                **base,
            )
    return ChainRow(hashed_seq=hashed_seq, **base)


def locate_in(rows: list[ChainRow], hashed_seq: int) -> tuple[int, str] | None:
    """Where the record chained as `hashed_seq` sits now: (seq column, event_id), or None."""
    return next(((r.seq, r.event_id) for r in rows if r.hashed_seq == hashed_seq), None)


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of walking one chain: intact, or the first broken record (or checkpoint)."""

    num_records: int
    head_hash: str
    broken_seq: int | None = None
    broken_event_id: str | None = None
    kind: Tamper | None = None
    reason: str | None = None
    chain_id: int = 0
    num_checkpoints: int = 0
    broken_checkpoint: int | None = None  # set when a checkpoint, not a record, is what is broken
    log: Log = "audit"  # review_flags: broken_event_id is the flag_id

    @property
    def is_ok(self) -> bool:
        """True when every record is intact and linked to the one before it."""
        return self.kind is None

    def describe(self) -> str:
        """One line for a person: 'chain C: OK ...' or 'BROKEN chain=C at record seq=K ...'."""
        if self.log == "review_flags":
            if self.is_ok:
                return (
                    f"review flags chain {self.chain_id}: {self.num_records} flags, {self.num_checkpoints} "
                    f"checkpoints, intact (head {self.head_hash})"
                )
            if self.broken_checkpoint is not None:
                return (
                    f"BROKEN review flags chain={self.chain_id} at checkpoint {self.broken_checkpoint}: "
                    f"{self.kind}: {self.reason}"
                )
            return (
                f"BROKEN review flags chain={self.chain_id} at flag seq={self.broken_seq} "
                f"(flag_id={self.broken_event_id}): {self.kind}: {self.reason}"
            )
        if self.is_ok:
            return (
                f"chain {self.chain_id}: {self.num_records} records, {self.num_checkpoints} checkpoints, "
                f"intact (head {self.head_hash})"
            )
        if self.broken_checkpoint is not None:
            return f"BROKEN chain={self.chain_id} at checkpoint {self.broken_checkpoint}: {self.kind}: {self.reason}"
        return (
            f"BROKEN chain={self.chain_id} at record seq={self.broken_seq} (event_id={self.broken_event_id}): "
            f"{self.kind}: {self.reason}"
        )


@dataclass(frozen=True)
class LedgerReport:
    """The outcome of verifying every chain of a ledger: the AuditEvents' and the ReviewFlags'."""

    chains: list[VerifyReport]
    flag_chains: list[VerifyReport] = field(default_factory=list)

    @property
    def is_ok(self) -> bool:
        """True when every chain, of records and of review flags, is intact."""
        return all(chain.is_ok for chain in [*self.chains, *self.flag_chains])

    @property
    def num_records(self) -> int:
        return sum(chain.num_records for chain in self.chains)

    @property
    def num_flags(self) -> int:
        return sum(chain.num_records for chain in self.flag_chains)

    @property
    def broken(self) -> list[VerifyReport]:
        """The broken chains (audit ones first), each with its first broken record or checkpoint."""
        return [chain for chain in [*self.chains, *self.flag_chains] if not chain.is_ok]

    def chain(self, chain_id: int) -> VerifyReport:
        """The report of one chain (KeyError when the ledger has no such chain)."""
        return next(c for c in self.chains if c.chain_id == chain_id)

    def describe(self) -> str:
        """Lines for a person: a summary ('OK: ...' or 'BROKEN: ...'), then one line per chain."""
        num_checkpoints = sum(chain.num_checkpoints for chain in self.chains)
        summary = f"{self.num_records} records in {len(self.chains)} chains, {num_checkpoints} checkpoints"
        first = f"OK: {summary}, all intact" if self.is_ok else f"BROKEN: {len(self.broken)} chain(s) of {summary}"
        if self.flag_chains:  # ledgers without review flags print as before
            first += f"; {self.num_flags} review flags in {len(self.flag_chains)} chains"
        return "\n".join([first, *(chain.describe() for chain in [*self.chains, *self.flag_chains])])


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
            return (
                cur,
                "reordered",
                (
                    f"it was chained as seq={hashed}; the record chained as seq={position} "
                    f"(event_id={event_id}) now sits at seq={seq}"
                ),
            )
        missing = f"seq={position}" if hashed == position + 1 else f"seq={position}..{hashed - 1}"
        return cur, "deleted", f"the record(s) chained before it as {missing} are missing"
    if hashed < position:
        if prev is not None and cur.prev_hash == prev_prev_hash:
            # cur links straight past prev: prev is not part of the chain.
            return (
                prev,
                "inserted",
                (
                    f"not part of the chain: the record chained as seq={hashed} (event_id={cur.event_id}) "
                    f"links directly to the record before it"
                ),
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
            return (
                cur,
                "inserted",
                (
                    "its prev_hash is not the record_hash of the record before it: it was forged, "
                    "or the record before it was rewritten and rehashed"
                ),
            )
        return cur, "inserted", "forged: its prev_hash links to no record, and no record links to it"
    if prev is None:
        return cur, "edited", "the first record's prev_hash is not the genesis hash"
    return (
        prev,
        "edited",
        (f"its record_hash is not the one seq={cur.seq} was chained to: it was rewritten and rehashed"),
    )


@dataclass(frozen=True)
class CheckpointRow:
    """One stored checkpoint of a chain as verification sees it (columns as stored)."""

    num: int
    first_seq: int
    last_seq: int
    merkle_root: str
    last_record_hash: str
    created_ms: int
    canonical_json: str
    prev_hash: str
    checkpoint_hash: str
    mac: str | None = None  # None: written before checkpoints were keyed (or its MAC removed)


# (checkpoint num, kind, reason, broken record seq or None) of the first broken checkpoint.
CheckpointProblem = tuple[int, Tamper, str, "int | None"]


def verify_checkpoints(
    chain_id: int, checkpoints: list[CheckpointRow], record_hashes: list[str], key: bytes, log: Log = "audit"
) -> CheckpointProblem | None:
    """Check a chain's checkpoints (in num order) against its record hashes (seq 1..n, already verified).

    Pure. Each checkpoint must hash to itself, carry its MAC under the checkpoint `key`, link to
    the previous one, start where the previous one ended, cover records that exist, and hold
    their Merkle root.
    """
    expected_prev, expected_first = GENESIS_HASH, 1
    for position, cp in enumerate(checkpoints, start=1):
        problem = _checkpoint_problem(chain_id, cp, position, expected_prev, expected_first, record_hashes)
        if problem is None and not mac_matches(key, log, chain_id, cp.checkpoint_hash, cp.mac):
            why = (
                "it carries no MAC (written before checkpoints were keyed, or its MAC removed)"
                if cp.mac is None
                else "its MAC does not match the checkpoint key: it was made or rewritten without the key"
            )
            problem = cp.num, "forged", why, cp.first_seq
        if problem is not None:
            return problem
        expected_prev, expected_first = cp.checkpoint_hash, cp.last_seq + 1
    return None


def _checkpoint_problem(
    chain_id: int, cp: CheckpointRow, position: int, expected_prev: str, expected_first: int, record_hashes: list[str]
) -> CheckpointProblem | None:
    if not all(isinstance(v, str) for v in (cp.canonical_json, cp.prev_hash, cp.checkpoint_hash)):
        return cp.num, "edited", "its canonical_json or hashes are not text", None
    if chain_hash(cp.prev_hash, cp.canonical_json) != cp.checkpoint_hash:
        return cp.num, "edited", "checkpoint_hash does not match its content (content or hash edited)", None
    stored = canonical_checkpoint(
        chain_id, cp.num, cp.first_seq, cp.last_seq, cp.merkle_root, cp.last_record_hash, cp.created_ms
    )
    if stored != cp.canonical_json:
        return cp.num, "edited", "a column differs from the hashed checkpoint", None
    if cp.num != position:
        kind: Tamper = "deleted" if cp.num > position else "reordered"
        return cp.num, kind, f"it sits at position {position} of the chain's checkpoints", None
    if cp.prev_hash != expected_prev:
        return (
            cp.num,
            "inserted",
            "its prev_hash is not the hash of the checkpoint before it (forged or rewritten)",
            None,
        )
    if cp.first_seq != expected_first:
        return (
            cp.num,
            "edited",
            f"it starts at seq={cp.first_seq}; the previous checkpoint ended at seq={expected_first - 1}",
            None,
        )
    if cp.last_seq > len(record_hashes):
        return (
            cp.num,
            "deleted",
            (
                f"it covers seq={cp.first_seq}..{cp.last_seq} but the chain ends at seq={len(record_hashes)}: "
                "the newest records were deleted"
            ),
            len(record_hashes) + 1,
        )
    root = merkle_root(record_hashes[cp.first_seq - 1 : cp.last_seq])
    if root != cp.merkle_root or record_hashes[cp.last_seq - 1] != cp.last_record_hash:
        return (
            cp.num,
            "edited",
            (
                f"the records seq={cp.first_seq}..{cp.last_seq} no longer hash to its Merkle root: one of them was "
                "rewritten and the chain rehashed from there on"
            ),
            cp.first_seq,
        )
    return None
