"""What the hash chains need of the ledger's store (SQLite or PostgreSQL, ledger.py), and the one
step both chains (audit records, review flags) take before appending."""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

import orjson

from services.auditor.chain import GENESIS_HASH

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
            log.warning("%s %s re-sent with different content; kept record chain=%d seq=%d",
                        id_column, id_value, existing[0], existing[1])  # fmt: skip
        return None
    tip = store.execute(
        f"SELECT seq, record_hash FROM {table} WHERE chain_id = ? ORDER BY seq DESC LIMIT 1", (chain_id,)
    ).fetchone()
    return (tip[0] + 1, tip[1]) if tip else (1, GENESIS_HASH)
