"""The audit ledger: an append-only, hash-chained SQLite table of AuditEvents.

Pure core of the auditor: no Kafka, no event loop. Each record keeps the event's fields as
columns (for queries), the canonical JSON they were hashed from, its Kafka origin, and its place
in the chain (seq, prev_hash, record_hash; see chain.py). Records hold only what AuditEvent
holds: keyed hashes of texts, never the texts (DESIGN.md, invariant 7).

Appending is idempotent by event_id, so an event redelivered after a crash or a rebalance does
not become a second record. Triggers refuse UPDATE and DELETE, but verify() does not trust them:
whoever holds the file can drop them, and verify() finds what they then changed.

Threading: one Ledger is used by one thread at a time (the auditor runs it on a dedicated
single-thread executor); the connection is opened with check_same_thread=False for that.
"""

from __future__ import annotations

import logging
import sqlite3
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import orjson

from schemas.messages import AuditEvent
from schemas.messages import now_ms as wall_clock_ms
from services.auditor.chain import (
    GENESIS_HASH,
    ChainRow,
    VerifyReport,
    canonical_record,
    chain_hash,
    verify_chain,
)

log = logging.getLogger(__name__)

TABLE = "audit_log"
_LEDGER_COLUMNS = ("kafka_partition", "kafka_offset", "appended_ms")


class LedgerError(RuntimeError):
    """The ledger file cannot be used as it is; the message says why and what to do."""


def _sql_type(annotation: Any) -> tuple[str, bool]:
    """(SQLite type, nullable) of one AuditEvent field annotation."""
    args = get_args(annotation)
    nullable = False
    if get_origin(annotation) in (Union, types.UnionType):
        nullable = type(None) in args
        annotation = next(a for a in args if a is not type(None))
        args = get_args(annotation)
    if get_origin(annotation) is Literal:
        annotation = type(args[0])
    sql = {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER"}.get(annotation)
    if sql is None:
        raise TypeError(f"AuditEvent field type {annotation!r} has no SQLite column type")
    return sql, nullable


# (name, SQLite type, nullable) of every AuditEvent field, in declaration order.
EVENT_COLUMNS: list[tuple[str, str, bool]] = [
    (name, *_sql_type(field.annotation)) for name, field in AuditEvent.model_fields.items()
]
_EVENT_NAMES = [name for name, _, _ in EVENT_COLUMNS]
ALL_COLUMNS = ["seq", *_EVENT_NAMES, *_LEDGER_COLUMNS, "canonical_json", "prev_hash", "record_hash"]
assert len(set(ALL_COLUMNS)) == len(ALL_COLUMNS), "an AuditEvent field collides with a ledger column"


def _table_sql() -> str:
    event_cols = ",\n  ".join(
        f"{name} {sql}{'' if nullable else ' NOT NULL'}{' UNIQUE' if name == 'event_id' else ''}"
        for name, sql, nullable in EVENT_COLUMNS
    )
    return f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
  seq INTEGER PRIMARY KEY,
  {event_cols},
  kafka_partition INTEGER NOT NULL,
  kafka_offset INTEGER NOT NULL,
  appended_ms INTEGER NOT NULL,
  canonical_json TEXT NOT NULL,
  prev_hash TEXT NOT NULL,
  record_hash TEXT NOT NULL
);
"""


# Indexes for lookups by fingerprint or request; triggers that make the table append-only.
_EXTRAS_SQL = f"""
CREATE INDEX IF NOT EXISTS {TABLE}_prompt_hmac ON {TABLE}(prompt_hmac);
CREATE INDEX IF NOT EXISTS {TABLE}_output_hmac ON {TABLE}(output_hmac);
CREATE INDEX IF NOT EXISTS {TABLE}_request_id ON {TABLE}(request_id);
CREATE TRIGGER IF NOT EXISTS {TABLE}_no_update BEFORE UPDATE ON {TABLE}
BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only'); END;
CREATE TRIGGER IF NOT EXISTS {TABLE}_no_delete BEFORE DELETE ON {TABLE}
BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only'); END;
"""


_INT64 = range(-(2**63), 2**63)


def unstorable_reason(event: AuditEvent) -> str | None:
    """Why `event` cannot become a record (an integer past SQLite's 64 bits), or None.

    The auditor's decoder asks this so such an event is dead-lettered instead of retried forever.
    """
    for name, value in event.model_dump().items():
        if isinstance(value, int) and value not in _INT64:
            return f"{name}={value} does not fit a 64-bit integer"
    return None


class Ledger:
    """The hash-chained audit log in one SQLite file.

    `Ledger(path)` creates the file and table when missing; `Ledger(path, readonly=True)` opens
    an existing file for reading only (verify, show) and raises LedgerError if there is none.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly:
            if not self.path.is_file():
                raise LedgerError(f"no audit ledger at {self.path}; pass --db or set WEIR_AUDIT_DB")
            uri = f"{self.path.resolve().as_uri()}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # WAL lets `weir audit verify` read while the auditor writes; synchronous=FULL makes a
            # returned append durable, which the Kafka offset commit that follows relies on.
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute(_table_sql())
        self._conn.execute("PRAGMA busy_timeout=10000")
        try:
            self._check_columns()
        except LedgerError:
            self._conn.close()
            raise
        if not readonly:
            self._conn.executescript(_EXTRAS_SQL)

    def close(self) -> None:
        """Close the file; the Ledger is unusable afterwards."""
        self._conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, event: AuditEvent, partition: int, offset: int, *, now_ms: int | None = None) -> bool:
        """Add `event` as the next record, durably; returns False when its event_id is already in.

        Called once per consumed AuditEvent, before its offset is committed. `partition` and
        `offset` say where in the audit topic it came from; `now_ms` is the append time (epoch ms,
        default now). A repeat with different content keeps the first record and logs a warning.
        Raises ValueError, touching nothing, for an event unstorable_reason refuses.
        """
        if (reason := unstorable_reason(event)) is not None:
            raise ValueError(f"event {event.event_id} cannot be stored: {reason}")
        appended_ms = wall_clock_ms() if now_ms is None else now_ms
        event_json = event.model_dump(mode="json")
        with self._transaction():
            existing = self._conn.execute(
                f"SELECT seq, canonical_json FROM {TABLE} WHERE event_id = ?", (event.event_id,)
            ).fetchone()
            if existing is not None:
                if orjson.loads(existing[1]).get("event") != event_json:
                    log.warning("event_id %s re-sent with different content; kept record seq=%d",
                                event.event_id, existing[0])
                return False
            tip = self._conn.execute(f"SELECT seq, record_hash FROM {TABLE} ORDER BY seq DESC LIMIT 1").fetchone()
            seq, prev_hash = (tip[0] + 1, tip[1]) if tip else (1, GENESIS_HASH)
            canonical = canonical_record(event_json, seq, partition, offset, appended_ms)
            values = [seq, *(event_json[name] for name in _EVENT_NAMES), partition, offset, appended_ms,
                      canonical, prev_hash, chain_hash(prev_hash, canonical)]
            marks = ", ".join("?" * len(values))
            self._conn.execute(f"INSERT INTO {TABLE} ({', '.join(ALL_COLUMNS)}) VALUES ({marks})", values)
        return True

    def num_records(self) -> int:
        """How many records the table holds."""
        return int(self._conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0])

    def records(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The newest `limit` records (all when None), oldest first, as {column: value}."""
        sql = f"SELECT * FROM {TABLE} ORDER BY seq DESC"
        cursor = self._conn.execute(sql + (" LIMIT ?" if limit is not None else ""),
                                    (limit,) if limit is not None else ())
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in reversed(cursor.fetchall())]

    def verify(self) -> VerifyReport:
        """Walk the whole chain; the report names the first broken record, if any."""
        with self._snapshot():
            return verify_chain(self._chain_rows(), self.num_records(), self._locate)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        # IMMEDIATE takes the write lock up front: reading the tip and inserting after it is atomic
        # even if a second process (a misconfigured second auditor) writes the same file.
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        # One read transaction: verify sees a consistent table while the auditor appends.
        self._conn.execute("BEGIN")
        try:
            yield
        finally:
            self._conn.execute("COMMIT")

    def _chain_rows(self) -> Iterator[ChainRow]:
        cursor = self._conn.execute(f"SELECT {', '.join(ALL_COLUMNS)} FROM {TABLE} ORDER BY seq")
        for values in cursor:
            yield _chain_row(dict(zip(ALL_COLUMNS, values, strict=True)))

    def _locate(self, hashed_seq: int) -> tuple[int, str] | None:
        row = self._conn.execute(
            f"SELECT seq, event_id FROM {TABLE} WHERE CASE WHEN json_valid(canonical_json) "
            "THEN json_extract(canonical_json, '$.ledger.seq') END = ? LIMIT 1",
            (hashed_seq,),
        ).fetchone()
        return (int(row[0]), str(row[1])) if row else None

    def _check_columns(self) -> None:
        found = [row[1] for row in self._conn.execute(f"PRAGMA table_info({TABLE})")]
        if not found:
            raise LedgerError(f"{self.path} has no {TABLE} table; is it an audit ledger?")
        if sorted(found) != sorted(ALL_COLUMNS):
            differ = sorted(set(found) ^ set(ALL_COLUMNS))
            raise LedgerError(
                f"{self.path} was written for another AuditEvent schema (columns {differ} differ); "
                "verify it with the auditor version that wrote it, then start a new WEIR_AUDIT_DB"
            )


def _chain_row(row: dict[str, Any]) -> ChainRow:
    """A stored row as the chain walk needs it, with any inconsistency inside the row found."""
    base = dict(seq=row["seq"], event_id=row["event_id"], prev_hash=row["prev_hash"], record_hash=row["record_hash"])
    canonical = row["canonical_json"]
    if not all(isinstance(row[name], str) for name in ("canonical_json", "prev_hash", "record_hash")):
        return ChainRow(hashed_seq=None, problem="its canonical_json or hashes are not text", **base)
    if chain_hash(row["prev_hash"], canonical) != row["record_hash"]:
        return ChainRow(hashed_seq=None, problem="record_hash does not match its content (content or hash edited)",
                        **base)
    try:
        record = orjson.loads(canonical)
        event, ledger = record["event"], record["ledger"]
        hashed_seq = int(ledger["seq"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return ChainRow(hashed_seq=None, problem="its canonical_json is not a ledger record", **base)
    for name in _EVENT_NAMES:
        if row[name] != event.get(name):
            return ChainRow(hashed_seq=hashed_seq, problem=f"column {name}={row[name]!r} differs from the "
                            f"hashed record ({event.get(name)!r})", **base)
    for name in _LEDGER_COLUMNS:
        if row[name] != ledger.get(name):
            return ChainRow(hashed_seq=hashed_seq, problem=f"column {name}={row[name]!r} differs from the "
                            f"hashed record ({ledger.get(name)!r})", **base)
    return ChainRow(hashed_seq=hashed_seq, **base)
