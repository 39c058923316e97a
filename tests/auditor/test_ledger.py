"""Unit tests of the audit ledger: appends, idempotency, and tampering that verify() must name."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.auditor.chain import GENESIS_HASH, canonical_record, chain_hash
from services.auditor.ledger import ALL_COLUMNS, TABLE, Ledger, LedgerError, unstorable_reason

from .factories import T0_MS, make_event

NUM = 10


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "audit.sqlite"
    with Ledger(path) as ledger:
        for i in range(1, NUM + 1):
            assert ledger.append(make_event(i), partition=i % 4, offset=100 + i, now_ms=T0_MS + i)
    return path


def verify(path: Path):
    with Ledger(path, readonly=True) as ledger:
        return ledger.verify()


@pytest.fixture
def raw(db: Path) -> Iterator[sqlite3.Connection]:
    """A raw connection of someone who holds the file: triggers dropped, free to rewrite rows."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(f"DROP TRIGGER {TABLE}_no_update")
    conn.execute(f"DROP TRIGGER {TABLE}_no_delete")
    yield conn
    conn.close()


def row(conn: sqlite3.Connection, seq: int) -> dict:
    cursor = conn.execute(f"SELECT * FROM {TABLE} WHERE seq = ?", (seq,))
    return dict(zip([d[0] for d in cursor.description], cursor.fetchone(), strict=True))


def insert_forged(conn: sqlite3.Connection, seq: int, prev_hash: str, event_id: str = "forged") -> None:
    """Insert a well-formed record for a made-up event at `seq`, chained after `prev_hash`."""
    event = make_event(99, event_id=event_id, principal="mallory").model_dump(mode="json")
    canonical = canonical_record(event, seq, 0, 999, T0_MS + 99)
    values = {"seq": seq, **event, "kafka_partition": 0, "kafka_offset": 999, "appended_ms": T0_MS + 99,
              "canonical_json": canonical, "prev_hash": prev_hash, "record_hash": chain_hash(prev_hash, canonical)}
    conn.execute(f"INSERT INTO {TABLE} ({', '.join(ALL_COLUMNS)}) VALUES ({', '.join('?' * len(ALL_COLUMNS))})",
                 [values[c] for c in ALL_COLUMNS])


def shift_up(conn: sqlite3.Connection, from_seq: int) -> None:
    """Renumber rows seq >= from_seq to seq + 1 (in two steps: seq is a primary key)."""
    conn.execute(f"UPDATE {TABLE} SET seq = -(seq + 1) WHERE seq >= ?", (from_seq,))
    conn.execute(f"UPDATE {TABLE} SET seq = -seq WHERE seq < 0")


# --- appending -------------------------------------------------------------------------------


def test_append_builds_an_intact_chain(db: Path) -> None:
    report = verify(db)
    assert report.is_ok, report.describe()
    assert report.num_records == NUM
    assert report.describe().startswith(f"OK: {NUM} records, chain intact")
    with Ledger(db, readonly=True) as ledger:
        records = ledger.records()
    assert [r["seq"] for r in records] == list(range(1, NUM + 1))
    assert [r["event_id"] for r in records] == [f"ev-{i}" for i in range(1, NUM + 1)]
    assert records[0]["prev_hash"] == GENESIS_HASH
    for before, after in zip(records, records[1:]):
        assert after["prev_hash"] == before["record_hash"]
    assert report.head_hash == records[-1]["record_hash"]
    first = records[0]
    assert (first["kafka_partition"], first["kafka_offset"], first["appended_ms"]) == (1, 101, T0_MS + 1)
    assert first["first_token_ms"] == T0_MS + 21 and records[1]["first_token_ms"] is None


def test_records_limit_gives_the_newest_oldest_first(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        assert [r["seq"] for r in ledger.records(limit=3)] == [NUM - 2, NUM - 1, NUM]


def test_canonical_json_is_sorted_and_compact(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        canonical = ledger.records(limit=1)[0]["canonical_json"]
    assert canonical.startswith('{"event":{"completion_tokens":')
    assert '"ledger":{"appended_ms":' in canonical and ", " not in canonical


def test_redelivered_event_is_not_a_second_record(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Ledger(db) as ledger:
        assert ledger.append(make_event(3), partition=3, offset=103) is False
        assert ledger.append(make_event(3), partition=0, offset=555) is False  # other origin, same event
        with caplog.at_level(logging.WARNING):
            assert ledger.append(make_event(3, principal="someone-else"), partition=3, offset=103) is False
        assert "re-sent with different content" in caplog.text
        assert ledger.num_records() == NUM
        assert ledger.append(make_event(NUM + 1), partition=0, offset=1) is True
        assert ledger.verify().is_ok


def test_event_past_64_bit_integers_is_refused_untouched(db: Path) -> None:
    event = make_event(NUM + 1, seed=2**64)
    assert unstorable_reason(event) == f"seed={2**64} does not fit a 64-bit integer"
    assert unstorable_reason(make_event(1, seed=2**63 - 1)) is None
    with Ledger(db) as ledger:
        with pytest.raises(ValueError, match="cannot be stored"):
            ledger.append(event, partition=0, offset=1)
        assert ledger.num_records() == NUM and ledger.verify().is_ok


def test_records_hold_no_raw_text(db: Path) -> None:
    data = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))  # with -wal and -shm
    assert b"prompt 3" not in data and b"output 3" not in data


def test_triggers_refuse_update_and_delete(db: Path) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute(f"UPDATE {TABLE} SET principal = 'x' WHERE seq = 1")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute(f"DELETE FROM {TABLE} WHERE seq = 1")
    conn.close()
    assert verify(db).is_ok


def test_empty_ledger_verifies(tmp_path: Path) -> None:
    with Ledger(tmp_path / "empty.sqlite") as ledger:
        report = ledger.verify()
    assert report.is_ok and report.num_records == 0 and report.head_hash == GENESIS_HASH


def test_readonly_open_of_a_missing_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="WEIR_AUDIT_DB"):
        Ledger(tmp_path / "missing.sqlite", readonly=True)
    assert not (tmp_path / "missing.sqlite").exists()


def test_ledger_of_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"CREATE TABLE {TABLE} (seq INTEGER PRIMARY KEY, event_id TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerError, match="another AuditEvent schema"):
        Ledger(path)


# --- tampering -------------------------------------------------------------------------------


def assert_broken(path: Path, seq: int, event_id: str, kind: str) -> str:
    report = verify(path)
    assert not report.is_ok
    assert (report.broken_seq, report.broken_event_id, report.kind) == (seq, event_id, kind), report.describe()
    assert report.describe().startswith(f"BROKEN at record seq={seq} (event_id={event_id}): {kind}: ")
    return report.describe()


def test_edited_column_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET principal = 'mallory' WHERE seq = 5")
    assert "principal" in assert_broken(db, 5, "ev-5", "edited")


def test_edited_column_and_json_are_found(db: Path, raw: sqlite3.Connection) -> None:
    old = row(raw, 5)
    new_json = old["canonical_json"].replace(old["output_hmac"], "0" * 64)
    raw.execute(f"UPDATE {TABLE} SET output_hmac = ?, canonical_json = ? WHERE seq = 5", ("0" * 64, new_json))
    assert "record_hash does not match" in assert_broken(db, 5, "ev-5", "edited")


def test_edited_and_rehashed_record_is_found(db: Path, raw: sqlite3.Connection) -> None:
    old = row(raw, 5)
    new_json = old["canonical_json"].replace('"principal":"user-2"', '"principal":"mallory"')
    assert new_json != old["canonical_json"]
    raw.execute(f"UPDATE {TABLE} SET principal = 'mallory', canonical_json = ?, record_hash = ? WHERE seq = 5",
                (new_json, chain_hash(old["prev_hash"], new_json)))
    assert "rewritten and rehashed" in assert_broken(db, 5, "ev-5", "edited")


def test_deleted_record_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE seq = 5")
    assert "seq=5 are missing" in assert_broken(db, 6, "ev-6", "deleted")


def test_deleted_first_record_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE seq = 1")
    assert_broken(db, 2, "ev-2", "deleted")


def test_deleted_records_hidden_by_renumbering_are_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE seq IN (5, 6)")
    raw.execute(f"UPDATE {TABLE} SET seq = seq - 2 WHERE seq > 6")
    assert "seq=5..6 are missing" in assert_broken(db, 5, "ev-7", "deleted")


def test_forged_record_inserted_in_the_middle_is_found(db: Path, raw: sqlite3.Connection) -> None:
    prev = row(raw, 4)["record_hash"]
    shift_up(raw, 5)
    insert_forged(raw, 5, prev)
    assert_broken(db, 5, "forged", "inserted")


def test_forged_record_with_a_made_up_link_is_found(db: Path, raw: sqlite3.Connection) -> None:
    shift_up(raw, 5)
    insert_forged(raw, 5, "f" * 64)
    assert_broken(db, 5, "forged", "inserted")


def test_forged_tail_with_a_wrong_link_is_found(db: Path, raw: sqlite3.Connection) -> None:
    insert_forged(raw, NUM + 1, "f" * 64)
    assert_broken(db, NUM + 1, "forged", "inserted")


def test_non_text_hash_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET prev_hash = x'00ff' WHERE seq = 3")
    assert_broken(db, 3, "ev-3", "edited")


def test_swapped_records_are_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET seq = -1 WHERE seq = 5")
    raw.execute(f"UPDATE {TABLE} SET seq = 5 WHERE seq = 6")
    raw.execute(f"UPDATE {TABLE} SET seq = 6 WHERE seq = -1")
    reason = assert_broken(db, 5, "ev-6", "reordered")
    assert "event_id=ev-5" in reason and "seq=6" in reason


def test_well_formed_forged_tail_changes_only_the_head(db: Path, raw: sqlite3.Connection) -> None:
    # A chain cannot tell a forged append from a real one; an anchored head hash can.
    head = verify(db).head_hash
    insert_forged(raw, NUM + 1, head)
    report = verify(db)
    assert report.is_ok and report.head_hash != head
