"""What the hash chains need of the ledger's store (SQLite or PostgreSQL, ledger.py), and the steps
both kinds of chain (audit records, review flags) share: the link before an append, and their
keyed checkpoints (services/auditor/chain.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

from services.auditor.chain import (
    GENESIS_HASH,
    CheckpointRow,
    Log,
    canonical_checkpoint,
    chain_hash,
    checkpoint_mac,
    merkle_root,
)

log = logging.getLogger(__name__)


class Store(Protocol):
    """A connection to the ledger's database."""

    dialect: Literal["sqlite", "postgresql"]

    def execute(self, sql: str, params: Any = ()) -> Any: ...
    def columns(self, table: str) -> list[str]: ...
    def transaction(self, chain_id: int) -> Any: ...


def chained_table_sql(table: str, integer: str, columns: str) -> str:
    """CREATE TABLE of one hash-chained record table: the chain position, the record's own
    `columns`, where it was read from Kafka, and its canonical form and hash link."""
    return f"""
CREATE TABLE IF NOT EXISTS {table} (
  chain_id {integer} NOT NULL,
  seq {integer} NOT NULL,
  {columns},
  kafka_partition {integer} NOT NULL,
  kafka_offset {integer} NOT NULL,
  appended_ms {integer} NOT NULL,
  canonical_json TEXT NOT NULL,
  prev_hash TEXT NOT NULL,
  record_hash TEXT NOT NULL,
  PRIMARY KEY (chain_id, seq)
)"""


def next_link(
    store: Store, table: str, id_column: str, id_value: str, key: str, payload: dict[str, Any], chain_id: int
) -> tuple[int, str] | None:
    """(seq, prev_hash) of the next record of `chain_id` in `table`; None when a record with this
    id is stored already (a redelivery: keep the first; a repeat with other content is logged).

    Called inside the chain's transaction; `key` names the payload in the stored canonical JSON.
    """
    existing = store.execute(
        f"SELECT chain_id, seq, canonical_json FROM {table} WHERE {id_column} = ?", (id_value,)
    ).fetchone()
    if existing is not None:
        if orjson.loads(existing[2]).get(key) != payload:
            log.warning(
                "%s %s re-sent with different content; kept record chain=%d seq=%d",
                id_column,
                id_value,
                existing[0],
                existing[1],
            )
        return None
    tip = store.execute(
        f"SELECT seq, record_hash FROM {table} WHERE chain_id = ? ORDER BY seq DESC LIMIT 1", (chain_id,)
    ).fetchone()
    return (tip[0] + 1, tip[1]) if tip else (1, GENESIS_HASH)


CHECKPOINT_COLUMNS = (
    "chain_id",
    "num",
    "first_seq",
    "last_seq",
    "merkle_root",
    "last_record_hash",
    "created_ms",
    "canonical_json",
    "prev_hash",
    "checkpoint_hash",
    "mac",
)


@dataclass(frozen=True)
class ChainTables:
    """One kind of chain: its log's name (in the MACs and anchors), its records' and checkpoints' tables."""

    log: Log
    records: str
    checkpoints: str


def checkpoint_table_sql(table: str, integer: str) -> str:
    """CREATE TABLE of one checkpoints table (the MAC column is added to older ones by add_mac_column)."""
    return f"""
CREATE TABLE IF NOT EXISTS {table} (
  chain_id {integer} NOT NULL,
  num {integer} NOT NULL,
  first_seq {integer} NOT NULL,
  last_seq {integer} NOT NULL,
  merkle_root TEXT NOT NULL,
  last_record_hash TEXT NOT NULL,
  created_ms {integer} NOT NULL,
  canonical_json TEXT NOT NULL,
  prev_hash TEXT NOT NULL,
  checkpoint_hash TEXT NOT NULL,
  mac TEXT,
  PRIMARY KEY (chain_id, num)
)"""


def add_mac_column(store: Store, table: str) -> None:
    """Give a checkpoints table written before checkpoints were keyed its `mac` column (its old
    checkpoints keep none, and verify says so)."""
    found = store.columns(table)
    if found and "mac" not in found:
        store.execute(f"ALTER TABLE {table} ADD COLUMN mac TEXT")


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a chain gets a checkpoint, and the key its MAC is made with."""

    every_records: int
    every_ms: int
    key: bytes


def checkpoint_if_due(store: Store, tables: ChainTables, chain_id: int, now_ms: int, policy: CheckpointPolicy) -> bool:
    """Write the chain's next checkpoint when `policy` says one is due; True when it did.

    Called inside the chain's transaction. The checkpoint covers the records since the previous
    one: their Merkle root, the head record's hash, the time, hash-chained to the previous
    checkpoint, with its MAC under the checkpoint key.
    """
    last = store.execute(
        f"SELECT num, last_seq, checkpoint_hash FROM {tables.checkpoints} WHERE chain_id = ? ORDER BY num DESC LIMIT 1",
        (chain_id,),
    ).fetchone()
    num, last_seq, prev_hash = (last[0] + 1, last[1], last[2]) if last else (1, 0, GENESIS_HASH)
    # Seqs are contiguous, so the tip and the first pending record say whether one is due, in
    # two primary-key lookups, before the pending rows are read.
    tip = store.execute(
        f"SELECT seq FROM {tables.records} WHERE chain_id = ? ORDER BY seq DESC LIMIT 1", (chain_id,)
    ).fetchone()
    if tip is None or tip[0] <= last_seq:
        return False
    if tip[0] - last_seq < policy.every_records:
        first = store.execute(
            f"SELECT appended_ms FROM {tables.records} WHERE chain_id = ? AND seq = ?", (chain_id, last_seq + 1)
        ).fetchone()
        if now_ms - first[0] < policy.every_ms:
            return False
    pending = store.execute(
        f"SELECT seq, record_hash FROM {tables.records} WHERE chain_id = ? AND seq > ? ORDER BY seq",
        (chain_id, last_seq),
    ).fetchall()
    first_seq, end_seq, end_hash = pending[0][0], pending[-1][0], pending[-1][1]
    root = merkle_root([row[1] for row in pending])
    canonical = canonical_checkpoint(chain_id, num, first_seq, end_seq, root, end_hash, now_ms)
    checkpoint_hash = chain_hash(prev_hash, canonical)
    values = [
        chain_id,
        num,
        first_seq,
        end_seq,
        root,
        end_hash,
        now_ms,
        canonical,
        prev_hash,
        checkpoint_hash,
        checkpoint_mac(policy.key, tables.log, chain_id, checkpoint_hash),
    ]
    store.execute(
        f"INSERT INTO {tables.checkpoints} ({', '.join(CHECKPOINT_COLUMNS)}) VALUES ({', '.join('?' * len(values))})",
        values,
    )
    return True


def read_checkpoints(store: Store, table: str, chain_id: int) -> list[CheckpointRow]:
    """The checkpoints of one chain, in num order."""
    cols = CHECKPOINT_COLUMNS[1:]
    rows = store.execute(
        f"SELECT {', '.join(cols)} FROM {table} WHERE chain_id = ? ORDER BY num", (chain_id,)
    ).fetchall()
    return [CheckpointRow(**dict(zip(cols, row, strict=True))) for row in rows]


def latest_checkpoints(store: Store, table: str) -> dict[int, CheckpointRow]:
    """The newest checkpoint of every chain of `table`, by chain_id."""
    cols = CHECKPOINT_COLUMNS[1:]
    rows = store.execute(
        f"SELECT chain_id, {', '.join(cols)} FROM {table} t WHERE num = "
        f"(SELECT max(num) FROM {table} WHERE chain_id = t.chain_id)"
    ).fetchall()
    return {int(row[0]): CheckpointRow(**dict(zip(cols, row[1:], strict=True))) for row in rows}
