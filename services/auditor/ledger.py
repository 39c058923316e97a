"""The audit ledger: one hash chain per audit-topic partition, with Merkle checkpoints.

SQLite by default (one file), PostgreSQL when given a DSN (postgresql://...). Both sit behind the
same Ledger class; only the few statements that differ go through the store (`_SqliteStore`,
`_PgStore`). See services/auditor/chain.py for how records and checkpoints are hashed and keyed,
services/auditor/reviews.py for the review flags kept beside the records (`Ledger.review_flags`),
services/auditor/comparison_log.py for the shadow comparisons' measures (`Ledger.add_comparison`),
and services/auditor/anchors.py for the checkpoints' anchors in Kafka.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import types
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Self, Union, get_args, get_origin

import orjson

from schemas.messages import AuditAnchor, AuditEvent, ReviewFlag
from schemas.messages import now_ms as wall_clock_ms
from schemas.registry import ModelComparison
from services.auditor import comparison_log, reviews
from services.auditor.anchors import AnchorRecord, AnchorReport, ChainKey, ChainState, anchor_of, check_anchors
from services.auditor.chain import (
    ChainRow,
    CheckpointRow,
    LedgerReport,
    Log,
    VerifyReport,
    canonical_record,
    chain_hash,
    locate_in,
    stored_row,
    verify_chain,
    verify_checkpoints,
)
from services.auditor.chain_store import (
    CHECKPOINT_COLUMNS,
    ChainTables,
    CheckpointPolicy,
    add_mac_column,
    chained_table_sql,
    checkpoint_if_due,
    checkpoint_table_sql,
    latest_checkpoints,
    next_link,
    read_checkpoints,
)
from weir.audit_key import AuditKeyError, resolve_checkpoint_key

log = logging.getLogger(__name__)

TABLE = "audit_log"
DAY_MS = 86_400_000
UsageKey = tuple[int, str, str, str]  # (UTC day as days since the epoch, tenant, principal, model version)
CHECKPOINTS = "audit_checkpoints"
_LEDGER_COLUMNS = ("chain_id", "kafka_partition", "kafka_offset", "appended_ms")
AUDIT_TABLES = ChainTables("audit", TABLE, CHECKPOINTS)
Dialect = Literal["sqlite", "postgresql"]
_SQL_TYPES: dict[Dialect, dict[type, str]] = {
    "sqlite": {int: "INTEGER", float: "REAL", str: "TEXT", bool: "INTEGER"},
    "postgresql": {int: "BIGINT", float: "DOUBLE PRECISION", str: "TEXT", bool: "BOOLEAN"},
}


class LedgerError(RuntimeError):
    """The ledger cannot be used as it is; the message says why and what to do."""


@dataclass
class BatchOutcome:
    """What Ledger.append_batch did: `is_new[i]` for each item i stored (False: it was in already,
    a redelivery), and per chain whose append failed, (index of the first item not stored, why)."""

    is_new: dict[int, bool] = field(default_factory=dict)
    failed: dict[int, tuple[int, Exception]] = field(default_factory=dict)
    num_checkpoints: int = 0  # checkpoints written (of records and of flags): their anchors are due


def _py_type(annotation: Any) -> tuple[type, bool]:
    """(Python scalar type, nullable) of one AuditEvent field annotation."""
    args = get_args(annotation)
    nullable = False
    if get_origin(annotation) in (Union, types.UnionType):
        nullable = type(None) in args
        annotation = next(a for a in args if a is not type(None))
        args = get_args(annotation)
    if get_origin(annotation) is Literal:
        annotation = type(args[0])
    if annotation not in _SQL_TYPES["sqlite"]:
        raise TypeError(f"AuditEvent field type {annotation!r} has no SQL column type")
    return annotation, nullable


# (name, Python type, nullable) of every AuditEvent field, in declaration order.
EVENT_FIELDS: list[tuple[str, type, bool]] = [
    (name, *_py_type(field.annotation)) for name, field in AuditEvent.model_fields.items()
]
_EVENT_NAMES = [name for name, _, _ in EVENT_FIELDS]
ALL_COLUMNS = ["chain_id", "seq", *_EVENT_NAMES, *_LEDGER_COLUMNS[1:], "canonical_json", "prev_hash", "record_hash"]
assert len(set(ALL_COLUMNS)) == len(ALL_COLUMNS), "an AuditEvent field collides with a ledger column"


def _tables_sql(dialect: Dialect) -> list[str]:
    types_ = _SQL_TYPES[dialect]
    integer = types_[int]
    event_cols = ",\n  ".join(
        f"{name} {types_[py]}{'' if nullable else ' NOT NULL'}{' UNIQUE' if name == 'event_id' else ''}"
        for name, py, nullable in EVENT_FIELDS
    )
    return [chained_table_sql(TABLE, integer, event_cols), checkpoint_table_sql(CHECKPOINTS, integer)]


def _extras_sql(dialect: Dialect) -> list[str]:
    """Indexes for lookups by fingerprint or request; triggers that make both tables append-only."""
    sql = [
        f"CREATE INDEX IF NOT EXISTS {TABLE}_{c} ON {TABLE}({c})" for c in ("prompt_hmac", "output_hmac", "request_id")
    ]
    sql += [
        f"CREATE INDEX IF NOT EXISTS {TABLE}_finished_ms ON {TABLE}(finished_ms)",  # usage_keys_since, rate cards
        f"CREATE INDEX IF NOT EXISTS {TABLE}_usage ON {TABLE}(tenant, principal, model_version, finished_ms)",
    ]
    for table in (TABLE, CHECKPOINTS):
        if dialect == "sqlite":
            sql += [
                f"CREATE TRIGGER IF NOT EXISTS {table}_no_{op.lower()} BEFORE {op} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
                for op in ("UPDATE", "DELETE")
            ]
        else:
            sql.append(
                f"CREATE OR REPLACE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION weir_append_only()"
            )
    if dialect == "postgresql":
        sql.insert(
            0,
            "CREATE OR REPLACE FUNCTION weir_append_only() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END $$",
        )
    return sql


_INT64 = range(-(2**63), 2**63)


def unstorable_reason(event: AuditEvent | ReviewFlag) -> str | None:
    """Why `event` (or a review flag) cannot become a record (an integer past 64 bits), or None.

    The auditor's decoder asks this so such an event is dead-lettered instead of retried forever.
    """
    for name, value in event.model_dump().items():
        if isinstance(value, int) and value not in _INT64:
            return f"{name}={value} does not fit a 64-bit integer"
    return None


def is_dsn(target: str | Path) -> bool:
    """True when `target` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


class Ledger:
    """The hash-chained audit log: one chain per audit-topic partition, with Merkle checkpoints.

    `target` is a SQLite file path, or a PostgreSQL DSN (postgresql://...). `Ledger(target)`
    creates the tables when missing; `readonly=True` opens an existing ledger for reading only
    (verify, show, lookup) and raises LedgerError if there is none. A chain gets a checkpoint once
    `checkpoint_every_records` records follow the last one, or at the first append (or
    `checkpoint_due` call) `checkpoint_every_s` after its oldest uncheckpointed record; the review
    flags' chains (`review_flags`, services/auditor/reviews.py) the same way.

    `checkpoint_key` makes and checks the checkpoints' MACs; None: the deployment's key file
    ($WEIR_HOME/secrets/audit-checkpoint.key), made when a writable ledger opens, and read when
    a read-only one verifies (weir/audit_key.py).
    """

    def __init__(
        self,
        target: str | Path,
        *,
        readonly: bool = False,
        checkpoint_every_records: int = 1000,
        checkpoint_every_s: float = 60.0,
        checkpoint_key: bytes | None = None,
    ) -> None:
        if checkpoint_every_records < 1:
            raise ValueError(f"{checkpoint_every_records=} must be >= 1")
        self.checkpoint_every_records = checkpoint_every_records
        self.checkpoint_every_ms = int(checkpoint_every_s * 1000)
        if checkpoint_key is None and not readonly:
            checkpoint_key = resolve_checkpoint_key(None, create=True)
        self._key = checkpoint_key
        self._store: _SqliteStore | _PgStore = (
            _PgStore(str(target), readonly) if is_dsn(target) else _SqliteStore(Path(target), readonly)
        )
        self.name = self._store.name
        try:
            if not readonly:
                # review_flags is created in ledgers written before it existed: that is their migration.
                for sql in [
                    *_tables_sql(self._store.dialect),
                    *reviews.tables_sql(self._store.dialect),
                    *comparison_log.tables_sql(self._store.dialect),
                ]:
                    self._store.execute(sql)
                add_mac_column(self._store, CHECKPOINTS)  # a ledger written before checkpoints were keyed
                add_event_columns(self._store)  # a ledger written before an optional AuditEvent field existed
            self._check_columns()
            try:
                self.review_flags = reviews.ReviewFlagLog(self._store)
            except ValueError as exc:
                raise LedgerError(f"{self.name}: {exc}; start a new WEIR_AUDIT_DB") from exc
            if not readonly:
                for sql in [*_extras_sql(self._store.dialect), *reviews.triggers_sql(self._store.dialect)]:
                    self._store.execute(sql)
        except BaseException:
            self._store.close()
            raise

    @property
    def _policy(self) -> CheckpointPolicy:
        assert self._key is not None, "a writable Ledger has its checkpoint key"
        return CheckpointPolicy(self.checkpoint_every_records, self.checkpoint_every_ms, self._key)

    def checkpoint_key(self) -> bytes:
        """The key the checkpoints' MACs are checked with: the one given, else the deployment's
        key file (never made here). LedgerError when there is none."""
        if self._key is None:
            try:
                self._key = resolve_checkpoint_key(None, create=False)
            except AuditKeyError as exc:
                raise LedgerError(str(exc)) from exc
        return self._key

    @property
    def path(self) -> Path:
        """The SQLite file (tests and tools that open it raw)."""
        assert isinstance(self._store, _SqliteStore)
        return self._store.path

    def close(self) -> None:
        """Close the connection; the Ledger is unusable afterwards."""
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- appending ------------------------------------------------------------------------------

    def append(self, event: AuditEvent, partition: int, offset: int, *, now_ms: int | None = None) -> bool:
        """Add `event` as the next record of its partition's chain, durably; False when its event_id is in.

        `partition` and `offset` say where in the audit topic it came from (the partition is the
        chain); `now_ms` is the append time (epoch ms, default now). A repeat with different
        content keeps the first record and logs a warning. Writes the chain's checkpoint when one
        is due. Raises ValueError, touching nothing, for an event unstorable_reason refuses.
        """
        appended_ms = wall_clock_ms() if now_ms is None else now_ms
        with self._store.transaction(partition):
            is_new = self._insert(event, partition, offset, appended_ms)
            if is_new:
                self._checkpoint_if_due(partition, appended_ms)
        return is_new

    def append_flag(self, flag: ReviewFlag, partition: int, offset: int, *, now_ms: int | None = None) -> bool:
        """Add `flag` to its partition's review-flag chain, durably; False when its flag_id is in.

        Raises ValueError, touching nothing, for a flag unstorable_reason refuses.
        """
        appended_ms = wall_clock_ms() if now_ms is None else now_ms
        with self._store.transaction(partition):
            is_new = self._insert_flag(flag, partition, offset, appended_ms)
            if is_new:
                self._checkpoint_if_due(partition, appended_ms)
        return is_new

    def append_batch(
        self, items: Sequence[tuple[AuditEvent | ReviewFlag, int, int]], *, now_ms: int | None = None
    ) -> BatchOutcome:
        """Append a consumed batch of (event or flag, partition, offset), in order and durably, with
        one transaction, and so one fsync, per chain: the auditor's group commit.

        Where a chain's transaction fails, its items are appended again one per transaction, in
        order, up to the first that fails: that one and those after it in its chain are not
        stored, and `failed` names it. The other chains are unaffected.
        """
        appended_ms = wall_clock_ms() if now_ms is None else now_ms
        outcome = BatchOutcome()
        chains: dict[int, list[int]] = {}
        for index, (_, partition, _) in enumerate(items):
            chains.setdefault(partition, []).append(index)
        for chain_id, indexes in chains.items():
            try:
                self._append_group(items, indexes, chain_id, appended_ms, outcome)
                continue
            except Exception as exc:  # noqa: BLE001 - which item failed is found below
                if len(indexes) == 1:
                    outcome.failed[chain_id] = (indexes[0], exc)
                    continue
            for index in indexes:
                try:
                    self._append_group(items, [index], chain_id, appended_ms, outcome)
                except Exception as exc:  # noqa: BLE001 - reported; the caller redelivers from here
                    outcome.failed[chain_id] = (index, exc)
                    break
        return outcome

    def _append_group(
        self,
        items: Sequence[tuple[AuditEvent | ReviewFlag, int, int]],
        indexes: list[int],
        chain_id: int,
        appended_ms: int,
        outcome: BatchOutcome,
    ) -> None:
        """Append items[indexes] of one chain in one transaction; their is_new only once it committed."""
        is_new = {}
        with self._store.transaction(chain_id):
            for index in indexes:
                record, partition, offset = items[index]
                if isinstance(record, ReviewFlag):
                    is_new[index] = self._insert_flag(record, partition, offset, appended_ms)
                else:
                    is_new[index] = self._insert(record, partition, offset, appended_ms)
            num_checkpoints = self._checkpoint_if_due(chain_id, appended_ms) if any(is_new.values()) else 0
        outcome.is_new.update(is_new)
        outcome.num_checkpoints += num_checkpoints

    def _insert_flag(self, flag: ReviewFlag, partition: int, offset: int, appended_ms: int) -> bool:
        """append_flag() inside a transaction of the chain `partition` that the caller holds."""
        if (reason := unstorable_reason(flag)) is not None:
            raise ValueError(f"flag {flag.flag_id} cannot be stored: {reason}")
        return self.review_flags.insert(flag, partition, offset, appended_ms)

    def _insert(self, event: AuditEvent, partition: int, offset: int, appended_ms: int) -> bool:
        """append() inside a transaction of the chain `partition` that the caller holds."""
        if (reason := unstorable_reason(event)) is not None:
            raise ValueError(f"event {event.event_id} cannot be stored: {reason}")
        event_json = event.model_dump(mode="json")
        chain_id = partition
        link = next_link(self._store, TABLE, "event_id", event.event_id, "event", event_json, chain_id)
        if link is None:
            return False
        seq, prev_hash = link
        canonical = canonical_record(event_json, seq, partition, offset, appended_ms, chain_id)
        values = [
            chain_id,
            seq,
            *(event_json[name] for name in _EVENT_NAMES),
            partition,
            offset,
            appended_ms,
            canonical,
            prev_hash,
            chain_hash(prev_hash, canonical),
        ]
        marks = ", ".join("?" * len(values))
        self._store.execute(f"INSERT INTO {TABLE} ({', '.join(ALL_COLUMNS)}) VALUES ({marks})", values)
        return True

    def checkpoint_due(self, now_ms: int | None = None) -> int:
        """Checkpoint every chain (of records, of flags) whose oldest uncheckpointed record is
        `checkpoint_every_s` old.

        Called periodically by the auditor (quiet chains get their checkpoint too). Returns how
        many checkpoints it wrote.
        """
        now = wall_clock_ms() if now_ms is None else now_ms
        written = 0
        for chain_id in sorted({*self.chain_ids(), *self.review_flags.chain_ids()}):
            with self._store.transaction(chain_id):
                written += self._checkpoint_if_due(chain_id, now)
        return written

    def _checkpoint_if_due(self, chain_id: int, now_ms: int) -> int:
        """The checkpoints due of the chain's records and of its flags, inside its transaction."""
        tables = [AUDIT_TABLES, *([reviews.FLAG_TABLES] if self.review_flags.has_checkpoints else [])]
        return sum(checkpoint_if_due(self._store, t, chain_id, now_ms, self._policy) for t in tables)

    # -- reading --------------------------------------------------------------------------------

    def add_comparison(self, comparison: ModelComparison) -> bool:
        """Store one shadow comparison's measures; False when it was in already (a redelivery)."""
        return comparison_log.insert(self._store, comparison)

    def comparisons(self, name: str | None = None) -> list[ModelComparison]:
        """The stored shadow comparisons (of `name`, or all), oldest first; none in a ledger
        written before they existed."""
        if not self._store.columns(comparison_log.COMPARISONS):
            return []
        return comparison_log.read(self._store, name)

    def num_records(self) -> int:
        """How many records the ledger holds, all chains together."""
        return int(self._store.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0])

    def traffic_rows(self) -> list[tuple[str, str | None, str, int]]:
        """(model_version, assignment, finish_reason, records) of every group: the traffic counts
        since the ledger began (services/auditor/traffic.py)."""
        rows = self._store.execute(
            f"SELECT model_version, assignment, finish_reason, count(*) FROM {TABLE} "
            "GROUP BY model_version, assignment, finish_reason"
        ).fetchall()
        return [(str(r[0]), r[1], str(r[2]), int(r[3])) for r in rows]

    def drift_rows(self, first: int, last: int) -> list[tuple[str, str, int, str, float]]:
        """(model_version, signal, finished_ms, event_id, value) of each version's first `first` and
        last `last` output entropies ("entropy"), watermark z-scores ("watermark"), errors
        ("error_rate": 1.0 for finish_reason 'error', else 0.0) and checked constrained outputs that
        ended stop ("structured": 1.0 valid, 0.0 invalid), by finished_ms then event_id: what
        services/auditor/drift.py starts from, so a restart judges against the same baseline."""
        out: list[tuple[str, str, int, str, float]] = []
        signals = (
            ("entropy", "mean_token_entropy"),
            ("watermark", "watermark_z"),
            ("error_rate", "CASE WHEN finish_reason = 'error' THEN 1.0 ELSE 0.0 END"),
            (
                "structured",
                "CASE WHEN finish_reason = 'stop' AND structured_valid IS NOT NULL THEN "
                "(CASE WHEN structured_valid THEN 1.0 ELSE 0.0 END) END",
            ),
        )
        for signal, column in signals:
            for order, n in (("ASC", first), ("DESC", last)):
                rows = self._store.execute(
                    f"SELECT model_version, finished_ms, event_id, value FROM (SELECT model_version, finished_ms, "
                    f"event_id, {column} AS value, ROW_NUMBER() OVER (PARTITION BY model_version ORDER BY finished_ms "
                    f"{order}, event_id {order}) AS rn FROM {TABLE} WHERE ({column}) IS NOT NULL) ranked WHERE rn <= ?",
                    (n,),
                ).fetchall()
                out += [(str(r[0]), signal, int(r[1]), str(r[2]), float(r[3])) for r in rows]
        return out

    def comparable_events(self, limit: int) -> list[AuditEvent]:
        """The last `limit` events the determinism comparison can use (services/auditor/determinism.py:
        with params_sha256, not a mirror copy, ended stop or length), in the ledger's order (finished_ms,
        event_id), as they were appended (from their canonical JSON)."""
        rows = self._store.execute(
            f"SELECT canonical_json FROM {TABLE} WHERE params_sha256 IS NOT NULL AND shadow_of IS NULL AND "
            "finish_reason IN ('stop', 'length') ORDER BY finished_ms DESC, event_id DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [AuditEvent.model_validate(orjson.loads(r[0])["event"]) for r in reversed(rows)]

    def usage_of(self, key: UsageKey) -> tuple[int, int, int, int]:
        """(requests, prompt, completion, cached prompt tokens) of one (epoch day, tenant, principal,
        model version), mirror copies left out (services/auditor/usage.py): from the records, so a
        redelivered event, stored once, counts once."""
        day, tenant, principal, model_version = key
        row = self._store.execute(
            f"SELECT count(*), sum(prompt_tokens), sum(completion_tokens), sum(coalesce(cached_prompt_tokens, 0)) "
            f"FROM {TABLE} WHERE tenant = ? AND principal = ? AND model_version = ? AND finished_ms >= ? "
            "AND finished_ms < ? AND shadow_of IS NULL",
            (tenant, principal, model_version, day * DAY_MS, (day + 1) * DAY_MS),
        ).fetchone()
        return int(row[0]), int(row[1] or 0), int(row[2] or 0), int(row[3] or 0)

    def usage_keys_since(self, since_ms: int) -> list[UsageKey]:
        """Every (epoch day, tenant, principal, model version) with a billed record finished at or after `since_ms`."""
        rows = self._store.execute(
            f"SELECT DISTINCT finished_ms / {DAY_MS}, tenant, principal, model_version FROM {TABLE} "
            "WHERE finished_ms >= ? AND shadow_of IS NULL",
            (since_ms,),
        ).fetchall()
        return [(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in rows]

    def tokens_served_since(self, since_ms: int) -> dict[str, int]:
        """Prompt + completion tokens per model version finished at or after `since_ms`, mirror
        copies included: what the hardware served, for the rate cards."""
        rows = self._store.execute(
            f"SELECT model_version, sum(prompt_tokens + completion_tokens) FROM {TABLE} WHERE finished_ms >= ? "
            "GROUP BY model_version",
            (since_ms,),
        ).fetchall()
        return {str(r[0]): int(r[1] or 0) for r in rows}

    def chain_ids(self) -> list[int]:
        """The chains that have records or checkpoints, ascending."""
        rows = self._store.execute(
            f"SELECT chain_id FROM {TABLE} UNION SELECT chain_id FROM {CHECKPOINTS} ORDER BY chain_id"
        ).fetchall()
        return [int(r[0]) for r in rows]

    def records(self, limit: int | None = None, chain_id: int | None = None) -> list[dict[str, Any]]:
        """The newest `limit` records (all when None), of one chain or all, oldest first, as {column: value}.

        Across chains "newest" is by appended_ms, then chain and seq.
        """
        where, params = ("WHERE chain_id = ?", [chain_id]) if chain_id is not None else ("", [])
        sql = f"SELECT {', '.join(ALL_COLUMNS)} FROM {TABLE} {where} ORDER BY appended_ms DESC, chain_id DESC, seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        rows = self._store.execute(sql, params).fetchall()
        return [dict(zip(ALL_COLUMNS, row, strict=True)) for row in reversed(rows)]

    def checkpoints(self, chain_id: int, log: Log = "audit") -> list[CheckpointRow]:
        """The checkpoints of one chain of records (or of flags), in num order."""
        if log == "review_flags":
            return self.review_flags.checkpoints(chain_id)
        return read_checkpoints(self._store, CHECKPOINTS, chain_id)

    def latest_anchors(self) -> list[AuditAnchor]:
        """The newest checkpoint of every chain, of records and of flags, as the AuditAnchors the
        auditor publishes (each one vouches for every checkpoint before it, through prev_hash).
        A chain whose newest checkpoint has no MAC (written before checkpoints were keyed) has
        none until its next checkpoint."""
        tables: list[tuple[Log, str]] = [("audit", CHECKPOINTS)]
        if self.review_flags.has_checkpoints:
            tables.append(("review_flags", reviews.FLAG_CHECKPOINTS))
        return [
            anchor_of(log, chain_id, cp)
            for log, table in tables
            for chain_id, cp in latest_checkpoints(self._store, table).items()
            if cp.mac is not None
        ]

    def find_by_hmac(self, hmacs: list[str]) -> list[dict[str, Any]]:
        """Records whose prompt_hmac or output_hmac is one of `hmacs`, oldest first."""
        if not hmacs:
            return []
        marks = ", ".join("?" * len(hmacs))
        rows = self._store.execute(
            f"SELECT {', '.join(ALL_COLUMNS)} FROM {TABLE} WHERE prompt_hmac IN ({marks}) OR output_hmac IN ({marks}) "
            "ORDER BY appended_ms, chain_id, seq",
            [*hmacs, *hmacs],
        ).fetchall()
        return [dict(zip(ALL_COLUMNS, row, strict=True)) for row in rows]

    def iter_simhashes(self) -> Iterator[tuple[int, int, str | None, str | None]]:
        """(chain_id, seq, prompt_simhash, output_simhash) of every record that has a SimHash."""
        cursor = self._store.execute(
            f"SELECT chain_id, seq, prompt_simhash, output_simhash FROM {TABLE} "
            "WHERE prompt_simhash IS NOT NULL OR output_simhash IS NOT NULL"
        )
        for row in cursor.fetchall():
            yield int(row[0]), int(row[1]), row[2], row[3]

    def record(self, chain_id: int, seq: int) -> dict[str, Any] | None:
        """One record by its place, or None."""
        row = self._store.execute(
            f"SELECT {', '.join(ALL_COLUMNS)} FROM {TABLE} WHERE chain_id = ? AND seq = ?", (chain_id, seq)
        ).fetchone()
        return dict(zip(ALL_COLUMNS, row, strict=True)) if row else None

    # -- verifying ------------------------------------------------------------------------------

    def verify(self) -> LedgerReport:
        """Walk every chain and its checkpoints, then the review-flag chains; the report names each
        chain's first broken record."""
        key = self.checkpoint_key()
        with self._store.snapshot():
            return LedgerReport(
                [self.verify_chain(chain_id) for chain_id in self.chain_ids()], self.review_flags.verify(key)
            )

    def verify_with_anchors(self, topic: str, anchors: list[AnchorRecord]) -> tuple[LedgerReport, AnchorReport]:
        """verify(), and the chains against the records of the anchor topic (read before this
        call: every anchor then names a checkpoint already committed), in one read snapshot."""
        key = self.checkpoint_key()
        with self._store.snapshot():
            report = LedgerReport(
                [self.verify_chain(chain_id) for chain_id in self.chain_ids()], self.review_flags.verify(key)
            )
            states: dict[ChainKey, ChainState] = {
                (c.log, c.chain_id): ChainState(self.checkpoints(c.chain_id, c.log), c.num_records)
                for c in [*report.chains, *report.flag_chains]
            }
        return report, check_anchors(topic, anchors, key, states)

    def verify_chain(self, chain_id: int) -> VerifyReport:
        """Walk one chain, then its checkpoints against the record hashes."""
        rows = [_chain_row(r) for r in self.records(chain_id=chain_id)]
        rows.sort(key=lambda r: r.seq)
        checkpoints = self.checkpoints(chain_id)
        report = verify_chain(rows, len(rows), lambda hashed: locate_in(rows, hashed))
        report = replace(report, chain_id=chain_id, num_checkpoints=len(checkpoints))
        if not report.is_ok:
            return report
        problem = verify_checkpoints(chain_id, checkpoints, [r.record_hash for r in rows], self.checkpoint_key())
        if problem is None:
            return report
        num, kind, reason, seq = problem
        event_id = next((r.event_id for r in rows if r.seq == seq), None)
        return replace(
            report, kind=kind, reason=reason, broken_checkpoint=num, broken_seq=seq, broken_event_id=event_id
        )

    def _check_columns(self) -> None:
        for table, expected in ((TABLE, ALL_COLUMNS), (CHECKPOINTS, list(CHECKPOINT_COLUMNS))):
            found = self._store.columns(table)
            if not found:
                raise LedgerError(f"{self.name} has no {table} table; is it an audit ledger?")
            if sorted(found) != sorted(expected):
                differ = sorted(set(found) ^ set(expected))
                raise LedgerError(
                    f"{self.name} was written for another AuditEvent schema (columns {differ} differ); "
                    "verify it with the auditor version that wrote it, then start a new WEIR_AUDIT_DB"
                )


def add_event_columns(store: Any) -> list[str]:
    """Give an audit table written before some optional (nullable) AuditEvent fields existed their
    columns, NULL in its old rows; returns the columns added. Old records stay verifiable: their
    canonical JSON has no such key, which the chain check reads as null, as the column holds."""
    found = store.columns(TABLE)
    if not found:
        return []
    added = []
    for name, py_type, nullable in EVENT_FIELDS:
        if name not in found and nullable:
            store.execute(f"ALTER TABLE {TABLE} ADD COLUMN {name} {_SQL_TYPES[store.dialect][py_type]}")
            added.append(name)
    if added:
        log.info(
            "audit ledger %s: added the columns %s of newer AuditEvent fields (NULL in older records)",
            store.name,
            added,
        )
    return added


def _chain_row(row: dict[str, Any]) -> ChainRow:
    def hashed_columns(record: dict[str, Any]) -> dict[str, Any]:
        event, ledger = record["event"], record["ledger"]
        return {
            **{name: event.get(name) for name in _EVENT_NAMES},
            **{name: ledger.get(name) for name in _LEDGER_COLUMNS},
        }

    return stored_row(row, "event_id", "a ledger record", hashed_columns)


class _SqliteStore:
    """One SQLite file. Appends take the file's write lock (BEGIN IMMEDIATE)."""

    dialect: Dialect = "sqlite"

    def __init__(self, path: Path, readonly: bool) -> None:
        self.path = path
        self.name = str(path)
        if readonly:
            if not path.is_file():
                raise LedgerError(f"no audit ledger at {path}; pass --db or set WEIR_AUDIT_DB")
            uri = f"{path.resolve().as_uri()}?mode=ro"
            self._conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():  # readable by its owner only (SQLite gives its -wal and -shm the same mode)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
            self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            # WAL lets `weir audit verify` read while the auditor writes; synchronous=FULL makes a
            # returned append durable, which the Kafka offset commit that follows relies on.
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA busy_timeout=10000")

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        return self._conn.execute(sql, params)

    def columns(self, table: str) -> list[str]:
        return [row[1] for row in self._conn.execute(f"PRAGMA table_info({table})")]

    @contextmanager
    def transaction(self, chain_id: int) -> Iterator[None]:
        # IMMEDIATE takes the write lock up front: reading the tip and inserting after it is atomic
        # even if a second process (a second auditor replica) writes the same file.
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        # One read transaction: verify sees a consistent ledger while the auditor appends.
        self._conn.execute("BEGIN")
        try:
            yield
        finally:
            self._conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()


class _PgStore:
    """A PostgreSQL database (psycopg 3). Appends to one chain serialise on an advisory lock per chain."""

    dialect: Dialect = "postgresql"
    _LOCK_SPACE = 0x57E1  # first key of pg_advisory_xact_lock(int, int): Weir's audit chains

    def __init__(self, dsn: str, readonly: bool) -> None:
        try:
            import psycopg
        except ImportError as exc:  # pragma: no cover - psycopg is a dependency
            raise LedgerError("WEIR_AUDIT_DSN needs psycopg: pip install 'psycopg[binary]'") from exc
        self._errors = psycopg.errors
        self.name = dsn.split("@")[-1]  # no password in messages
        try:
            self._conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot connect to the audit database {self.name}: {exc}") from exc
        if readonly:
            self._conn.execute("SET default_transaction_read_only = on")
        self._conn.execute("SET client_min_messages = warning")

    def execute(self, sql: str, params: Any = ()) -> Any:
        if params:
            sql = sql.replace("?", "%s")
        return self._conn.execute(sql, params or None)

    def columns(self, table: str) -> list[str]:
        rows = self._conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = %s",
            (table,),
        ).fetchall()
        return [r[0] for r in rows]

    def transaction(self, chain_id: int) -> AbstractContextManager[None]:
        return self._locked(chain_id)

    @contextmanager
    def _locked(self, chain_id: int) -> Iterator[None]:
        with self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (self._LOCK_SPACE, chain_id))
            yield

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        with self._conn.transaction():
            self._conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            yield

    def close(self) -> None:
        self._conn.close()
