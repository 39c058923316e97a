"""Review flags in the ledger: the `review_flags` table, one hash chain per audit-topic partition.

A ReviewFlag (a gateway asking a human to review a principal) arrives on the audit topic beside
the AuditEvents. It is stored apart from them, so audit_log and its checkpoints keep the layout
(and the hashes) they had before flags existed, and a ledger written before them gets the table
added when an auditor opens it for writing. A flag record is hashed like an audit record
(services/auditor/chain.py), under its own key:

    canonical_json = orjson(sorted keys) of
        {"review_flag": <ReviewFlag JSON>,
         "ledger": {"chain_id", "seq", "kafka_partition", "kafka_offset", "appended_ms"}}
    record_hash    = sha256(prev_hash || canonical_json), prev_hash of seq 1 = 64 zeros

Flag chains get keyed checkpoints like the record chains, in `review_flag_checkpoints` (same
columns and policy, their MACs and Kafka anchors under the log name "review_flags";
services/auditor/chain_store.py): deleting the newest flags, or rewriting flags and rehashing
every one after them, is caught by the checkpoints and by their anchors in Kafka.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import orjson

from schemas.messages import ReviewFlag
from services.auditor.chain import (
    ChainRow,
    CheckpointRow,
    VerifyReport,
    chain_hash,
    locate_in,
    stored_row,
    verify_chain,
    verify_checkpoints,
)
from services.auditor.chain_store import (
    CHECKPOINT_COLUMNS,
    ChainTables,
    Store,
    chained_table_sql,
    checkpoint_table_sql,
    next_link,
    read_checkpoints,
)

FLAGS = "review_flags"
FLAG_CHECKPOINTS = "review_flag_checkpoints"
FLAG_TABLES = ChainTables("review_flags", FLAGS, FLAG_CHECKPOINTS)
# Column type of every ReviewFlag field; `rules` is stored as its JSON text.
_FLAG_TYPES: dict[str, type] = {
    "schema_version": int,
    "kind": str,
    "flag_id": str,
    "principal": str,
    "tenant": str,
    "reason": str,
    "num_detections": int,
    "window_s": int,
    "first_detection_ms": int,
    "last_detection_ms": int,
    "rules": str,
    "gateway_id": str,
    "created_ms": int,
}
assert list(_FLAG_TYPES) == list(ReviewFlag.model_fields), "ReviewFlag changed: update the review_flags columns"
_LEDGER_COLUMNS = ("chain_id", "seq", "kafka_partition", "kafka_offset", "appended_ms")
FLAG_COLUMNS = ["chain_id", "seq", *_FLAG_TYPES, *_LEDGER_COLUMNS[2:], "canonical_json", "prev_hash", "record_hash"]
_SQL = {"sqlite": {int: "INTEGER", str: "TEXT"}, "postgresql": {int: "BIGINT", str: "TEXT"}}


def tables_sql(dialect: Literal["sqlite", "postgresql"]) -> list[str]:
    """CREATE statements of the flags table and its principal index (idempotent)."""
    types = _SQL[dialect]
    cols = ",\n  ".join(
        f"{name} {types[py]} NOT NULL{' UNIQUE' if name == 'flag_id' else ''}" for name, py in _FLAG_TYPES.items()
    )
    return [
        chained_table_sql(FLAGS, types[int], cols),
        f"CREATE INDEX IF NOT EXISTS {FLAGS}_principal ON {FLAGS}(principal)",
        checkpoint_table_sql(FLAG_CHECKPOINTS, types[int]),
    ]


def triggers_sql(dialect: Literal["sqlite", "postgresql"]) -> list[str]:
    """Triggers that make the flags and their checkpoints append-only (on PostgreSQL, the ledger's
    weir_append_only())."""
    if dialect == "sqlite":
        return [
            (
                f"CREATE TRIGGER IF NOT EXISTS {table}_no_{op.lower()} BEFORE {op} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
            )
            for table in (FLAGS, FLAG_CHECKPOINTS)
            for op in ("UPDATE", "DELETE")
        ]
    return [
        (
            f"CREATE OR REPLACE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION weir_append_only()"
        )
        for table in (FLAGS, FLAG_CHECKPOINTS)
    ]


def canonical_flag_record(flag: dict[str, Any], seq: int, partition: int, offset: int, appended_ms: int) -> str:
    """The canonical JSON text of one flag record (the bytes its hash is taken over, as str)."""
    ledger = {
        "chain_id": partition,
        "seq": seq,
        "kafka_partition": partition,
        "kafka_offset": offset,
        "appended_ms": appended_ms,
    }
    return orjson.dumps({"review_flag": flag, "ledger": ledger}, option=orjson.OPT_SORT_KEYS).decode("utf-8")


def _columns_of(flag: dict[str, Any]) -> dict[str, Any]:
    """Column values of a ReviewFlag's JSON: the fields, with `rules` as JSON text."""
    return {name: orjson.dumps(flag.get(name)).decode() if name == "rules" else flag.get(name) for name in _FLAG_TYPES}


class ReviewFlagLog:
    """The review flags of one ledger. `is_present` is False for a ledger, opened read-only, that
    was written before review flags existed: it then has no flags, and verifies as before;
    `has_checkpoints` likewise for one written before flag chains had checkpoints."""

    def __init__(self, store: Store) -> None:
        self._store = store
        found = store.columns(FLAGS)
        self.is_present = bool(found)
        if found and sorted(found) != sorted(FLAG_COLUMNS):
            differ = sorted(set(found) ^ set(FLAG_COLUMNS))
            raise ValueError(f"its {FLAGS} table was written for another ReviewFlag schema (columns {differ} differ)")
        found = store.columns(FLAG_CHECKPOINTS)
        self.has_checkpoints = bool(found)
        if found and sorted(found) != sorted(CHECKPOINT_COLUMNS):
            differ = sorted(set(found) ^ set(CHECKPOINT_COLUMNS))
            raise ValueError(f"its {FLAG_CHECKPOINTS} table has other columns ({differ} differ)")

    def insert(self, flag: ReviewFlag, partition: int, offset: int, appended_ms: int) -> bool:
        """Add `flag` as the next record of its partition's flag chain; False when its flag_id is in.

        Called inside a transaction of the chain `partition` that the caller (the Ledger) holds,
        before the flag's offset is committed. A repeat with different content keeps the first
        record and logs a warning.
        """
        flag_json = flag.model_dump(mode="json")
        link = next_link(self._store, FLAGS, "flag_id", flag.flag_id, "review_flag", flag_json, partition)
        if link is None:
            return False
        seq, prev_hash = link
        canonical = canonical_flag_record(flag_json, seq, partition, offset, appended_ms)
        values = {
            "chain_id": partition,
            "seq": seq,
            **_columns_of(flag_json),
            "kafka_partition": partition,
            "kafka_offset": offset,
            "appended_ms": appended_ms,
            "canonical_json": canonical,
            "prev_hash": prev_hash,
            "record_hash": chain_hash(prev_hash, canonical),
        }
        self._store.execute(
            f"INSERT INTO {FLAGS} ({', '.join(FLAG_COLUMNS)}) VALUES ({', '.join('?' * len(FLAG_COLUMNS))})",
            [values[c] for c in FLAG_COLUMNS],
        )
        return True

    def rows(
        self, limit: int | None = None, principal: str | None = None, chain_id: int | None = None
    ) -> list[dict[str, Any]]:
        """The newest `limit` flag records (all when None), oldest first, as {column: value}.

        Filtered by principal and/or chain when given; `rules` is the stored JSON text.
        """
        if not self.is_present:
            return []
        where = [
            (f"{name} = ?", value)
            for name, value in (("principal", principal), ("chain_id", chain_id))
            if value is not None
        ]
        params: list[Any] = [value for _, value in where]
        sql = f"SELECT {', '.join(FLAG_COLUMNS)} FROM {FLAGS}"
        if where:
            sql += " WHERE " + " AND ".join(clause for clause, _ in where)
        sql += " ORDER BY appended_ms DESC, chain_id DESC, seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        rows = self._store.execute(sql, params).fetchall()
        return [dict(zip(FLAG_COLUMNS, row, strict=True)) for row in reversed(rows)]

    def num_flags(self) -> int:
        """How many flags the ledger holds, all chains together."""
        if not self.is_present:
            return 0
        return int(self._store.execute(f"SELECT count(*) FROM {FLAGS}").fetchone()[0])

    def chain_ids(self) -> list[int]:
        """The flag chains that have flags or checkpoints, ascending."""
        if not self.is_present:
            return []
        sql = f"SELECT chain_id FROM {FLAGS}"
        if self.has_checkpoints:
            sql += f" UNION SELECT chain_id FROM {FLAG_CHECKPOINTS}"
        return [int(r[0]) for r in self._store.execute(sql + " ORDER BY chain_id")]

    def checkpoints(self, chain_id: int) -> list[CheckpointRow]:
        """The checkpoints of one flag chain, in num order."""
        return read_checkpoints(self._store, FLAG_CHECKPOINTS, chain_id) if self.has_checkpoints else []

    def verify(self, key: bytes) -> list[VerifyReport]:
        """Walk every flag chain and its checkpoints (MACs under the checkpoint `key`), ascending
        chain_id; called inside the ledger's read snapshot."""
        return [self._verify_chain(chain_id, key) for chain_id in self.chain_ids()]

    def _verify_chain(self, chain_id: int, key: bytes) -> VerifyReport:
        rows = sorted((_chain_row(r) for r in self.rows(chain_id=chain_id)), key=lambda r: r.seq)
        checkpoints = self.checkpoints(chain_id)
        report = replace(
            verify_chain(rows, len(rows), lambda hashed: locate_in(rows, hashed)),
            chain_id=chain_id,
            log="review_flags",
            num_checkpoints=len(checkpoints),
        )
        if not report.is_ok:
            return report
        problem = verify_checkpoints(chain_id, checkpoints, [r.record_hash for r in rows], key, "review_flags")
        if problem is None:
            return report
        num, kind, reason, seq = problem
        flag_id = next((r.event_id for r in rows if r.seq == seq), None)
        return replace(
            report,
            kind=kind,
            reason=reason.replace("records", "flags"),
            broken_checkpoint=num,
            broken_seq=seq,
            broken_event_id=flag_id,
        )


def _chain_row(row: dict[str, Any]) -> ChainRow:
    def hashed_columns(record: dict[str, Any]) -> dict[str, Any]:
        ledger = record["ledger"]
        return {
            **_columns_of(record["review_flag"]),
            **{name: ledger.get(name) for name in _LEDGER_COLUMNS if name != "seq"},
        }

    return stored_row(row, "flag_id", "a review flag record", hashed_columns)
