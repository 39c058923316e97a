"""What someone who can write the ledger's SQLite file can do to it, as the tests of the audit chain
do it: drop the append-only triggers, then rewrite records and recompute every unkeyed hash and
the checkpoints, or cut a chain's tail."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson

from services.auditor.chain import canonical_checkpoint, chain_hash, checkpoint_mac, merkle_root
from services.auditor.ledger import CHECKPOINTS, TABLE
from services.auditor.reviews import FLAG_CHECKPOINTS, FLAGS

TABLES = {"audit": (TABLE, CHECKPOINTS), "review_flags": (FLAGS, FLAG_CHECKPOINTS)}
ATTACKER_KEY = b"the attacker's own key, not the deployment's"


def open_raw(db: Path) -> sqlite3.Connection:
    """A raw connection to the file with every append-only trigger dropped."""
    conn = sqlite3.connect(db, isolation_level=None)
    triggers = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")]
    for name in triggers:
        conn.execute(f"DROP TRIGGER {name}")
    return conn


def rows(conn: sqlite3.Connection, table: str, chain_id: int, order: str = "seq") -> list[dict[str, Any]]:
    cursor = conn.execute(f"SELECT * FROM {table} WHERE chain_id = ? ORDER BY {order}", (chain_id,))
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def rewrite_chain(
    conn: sqlite3.Connection,
    log: str,
    chain_id: int,
    seq: int,
    field: str,
    value: Any,
    mac_key: bytes | None = ATTACKER_KEY,
) -> None:
    """Set `field` of record `seq` of the chain to `value`, then rehash that record and every one
    after it and recompute the chain's checkpoints over the same ranges, as the auditor would have
    made them, with their MACs under `mac_key` (None: keep each old MAC)."""
    table, _checkpoints = TABLES[log]
    payload_key = "event" if log == "audit" else "review_flag"
    prev = None
    for row in rows(conn, table, chain_id):
        if row["seq"] < seq:
            prev = row["record_hash"]
            continue
        record = orjson.loads(row["canonical_json"])
        if row["seq"] == seq:
            record[payload_key][field] = value
        canonical = orjson.dumps(record, option=orjson.OPT_SORT_KEYS).decode()
        prev_hash = row["prev_hash"] if prev is None else prev
        prev = chain_hash(prev_hash, canonical)
        column = {field: value} if row["seq"] == seq else {}
        sets = ", ".join(f"{c} = ?" for c in [*column, "canonical_json", "prev_hash", "record_hash"])
        conn.execute(
            f"UPDATE {table} SET {sets} WHERE chain_id = ? AND seq = ?",
            [*column.values(), canonical, prev_hash, prev, chain_id, row["seq"]],
        )
    recompute_checkpoints(conn, log, chain_id, mac_key)


def recompute_checkpoints(conn: sqlite3.Connection, log: str, chain_id: int, mac_key: bytes | None) -> None:
    """Recompute every checkpoint of the chain from its records as they are now."""
    table, checkpoints = TABLES[log]
    hashes = [r["record_hash"] for r in rows(conn, table, chain_id)]
    prev = "0" * 64
    for cp in rows(conn, checkpoints, chain_id, order="num"):
        covered = hashes[cp["first_seq"] - 1 : cp["last_seq"]]
        root, head = merkle_root(covered), covered[-1]
        canonical = canonical_checkpoint(
            chain_id, cp["num"], cp["first_seq"], cp["last_seq"], root, head, cp["created_ms"]
        )
        checkpoint_hash = chain_hash(prev, canonical)
        mac = cp["mac"] if mac_key is None else checkpoint_mac(mac_key, log, chain_id, checkpoint_hash)
        conn.execute(
            f"UPDATE {checkpoints} SET merkle_root = ?, last_record_hash = ?, canonical_json = ?, "
            "prev_hash = ?, checkpoint_hash = ?, mac = ? WHERE chain_id = ? AND num = ?",
            (root, head, canonical, prev, checkpoint_hash, mac, chain_id, cp["num"]),
        )
        prev = checkpoint_hash


def cut_tail(conn: sqlite3.Connection, log: str, chain_id: int, keep_checkpoints: int) -> int:
    """Keep the chain's first `keep_checkpoints` checkpoints and the records they cover; delete
    every later checkpoint and record. Returns how many records were deleted."""
    table, checkpoints = TABLES[log]
    kept = rows(conn, checkpoints, chain_id, order="num")[:keep_checkpoints]
    last_seq = kept[-1]["last_seq"] if kept else 0
    conn.execute(f"DELETE FROM {checkpoints} WHERE chain_id = ? AND num > ?", (chain_id, keep_checkpoints))
    return conn.execute(f"DELETE FROM {table} WHERE chain_id = ? AND seq > ?", (chain_id, last_seq)).rowcount
