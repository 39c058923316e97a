"""Unit tests of the audit ledger: per-partition chains, checkpoints, idempotency, and tampering
that verify() must name."""

from __future__ import annotations

import itertools
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.auditor.chain import GENESIS_HASH, canonical_record, chain_hash, merkle_root
from services.auditor.ledger import ALL_COLUMNS, CHECKPOINTS, TABLE, Ledger, LedgerError, unstorable_reason

from .factories import T0_MS, make_event, make_flag

NUM = 10  # records in chain 0 (partition 0); chain 1 holds three more
EVERY = 4  # checkpoint every 4 records: chain 0 has checkpoints over seq 1..4 and 5..8


def open_ledger(path: Path, **kwargs) -> Ledger:
    return Ledger(path, checkpoint_every_records=EVERY, checkpoint_every_s=3600, **kwargs)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "audit.sqlite"
    with open_ledger(path) as ledger:
        for i in range(1, NUM + 1):
            assert ledger.append(make_event(i), partition=0, offset=100 + i, now_ms=T0_MS + i)
        for i in range(NUM + 1, NUM + 4):
            assert ledger.append(make_event(i), partition=1, offset=i, now_ms=T0_MS + i)
    return path


def verify(path: Path):
    with Ledger(path, readonly=True) as ledger:
        return ledger.verify()


@pytest.fixture
def raw(db: Path) -> Iterator[sqlite3.Connection]:
    """A raw connection of someone who holds the file: triggers dropped, free to rewrite rows."""
    conn = sqlite3.connect(db, isolation_level=None)
    for table in (TABLE, CHECKPOINTS):
        conn.execute(f"DROP TRIGGER {table}_no_update")
        conn.execute(f"DROP TRIGGER {table}_no_delete")
    yield conn
    conn.close()


def row(conn: sqlite3.Connection, seq: int, chain: int = 0) -> dict:
    cursor = conn.execute(f"SELECT * FROM {TABLE} WHERE chain_id = ? AND seq = ?", (chain, seq))
    return dict(zip([d[0] for d in cursor.description], cursor.fetchone(), strict=True))


def insert_forged(conn: sqlite3.Connection, seq: int, prev_hash: str, event_id: str = "forged") -> None:
    """Insert a well-formed record for a made-up event at `seq`, chained after `prev_hash`."""
    event = make_event(99, event_id=event_id, principal="mallory").model_dump(mode="json")
    canonical = canonical_record(event, seq, 0, 999, T0_MS + 99)
    values = {
        "chain_id": 0,
        "seq": seq,
        **event,
        "kafka_partition": 0,
        "kafka_offset": 999,
        "appended_ms": T0_MS + 99,
        "canonical_json": canonical,
        "prev_hash": prev_hash,
        "record_hash": chain_hash(prev_hash, canonical),
    }
    conn.execute(
        f"INSERT INTO {TABLE} ({', '.join(ALL_COLUMNS)}) VALUES ({', '.join('?' * len(ALL_COLUMNS))})",
        [values[c] for c in ALL_COLUMNS],
    )


def shift_up(conn: sqlite3.Connection, from_seq: int) -> None:
    """Renumber chain 0's rows seq >= from_seq to seq + 1 (in two steps: (chain, seq) is the key)."""
    conn.execute(f"UPDATE {TABLE} SET seq = -(seq + 1) WHERE chain_id = 0 AND seq >= ?", (from_seq,))
    conn.execute(f"UPDATE {TABLE} SET seq = -seq WHERE seq < 0")


# --- appending -------------------------------------------------------------------------------


def test_append_builds_one_intact_chain_per_partition(db: Path) -> None:
    report = verify(db)
    assert report.is_ok, report.describe()
    assert report.num_records == NUM + 3
    assert [c.chain_id for c in report.chains] == [0, 1]
    assert report.describe().startswith(f"OK: {NUM + 3} records in 2 chains, 2 checkpoints, all intact")
    with Ledger(db, readonly=True) as ledger:
        zero, one = ledger.records(chain_id=0), ledger.records(chain_id=1)
    assert [r["seq"] for r in zero] == list(range(1, NUM + 1))
    assert [r["seq"] for r in one] == [1, 2, 3]
    assert [r["event_id"] for r in zero] == [f"ev-{i}" for i in range(1, NUM + 1)]
    for chain in (zero, one):
        assert chain[0]["prev_hash"] == GENESIS_HASH
        for before, after in itertools.pairwise(chain):
            assert after["prev_hash"] == before["record_hash"]
    assert report.chain(0).head_hash == zero[-1]["record_hash"]
    assert report.chain(1).head_hash == one[-1]["record_hash"]
    first = zero[0]
    assert (first["chain_id"], first["kafka_partition"], first["kafka_offset"], first["appended_ms"]) == (
        0,
        0,
        101,
        T0_MS + 1,
    )
    assert first["first_token_ms"] == T0_MS + 21 and zero[1]["first_token_ms"] is None


def test_checkpoints_hold_the_merkle_root_of_the_records_since_the_last(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        cps = ledger.checkpoints(0)
        hashes = [r["record_hash"] for r in ledger.records(chain_id=0)]
        assert ledger.checkpoints(1) == []
    assert [(c.num, c.first_seq, c.last_seq) for c in cps] == [(1, 1, 4), (2, 5, 8)]
    assert cps[0].merkle_root == merkle_root(hashes[0:4]) and cps[1].merkle_root == merkle_root(hashes[4:8])
    assert cps[0].prev_hash == GENESIS_HASH and cps[1].prev_hash == cps[0].checkpoint_hash
    assert cps[1].last_record_hash == hashes[7]


def test_merkle_root_follows_rfc6962() -> None:
    import hashlib

    leaf = [hashlib.sha256(b"\x00" + bytes([i]) * 32).digest() for i in range(3)]
    node = lambda a, b: hashlib.sha256(b"\x01" + a + b).digest()  # noqa: E731
    hexes = [(bytes([i]) * 32).hex() for i in range(3)]
    assert merkle_root(hexes[:1]) == leaf[0].hex()
    assert merkle_root(hexes) == node(node(leaf[0], leaf[1]), leaf[2]).hex()
    assert merkle_root([]) == hashlib.sha256(b"").hexdigest()


def test_a_quiet_chain_gets_its_checkpoint_after_the_interval(tmp_path: Path) -> None:
    with Ledger(tmp_path / "a.sqlite", checkpoint_every_records=100, checkpoint_every_s=10) as ledger:
        ledger.append(make_event(1), partition=2, offset=1, now_ms=T0_MS)
        ledger.append(make_event(2), partition=2, offset=2, now_ms=T0_MS + 1000)
        assert ledger.checkpoint_due(now_ms=T0_MS + 9_999) == 0
        assert ledger.checkpoint_due(now_ms=T0_MS + 10_000) == 1
        assert ledger.checkpoint_due(now_ms=T0_MS + 60_000) == 0  # nothing new since
        assert [(c.first_seq, c.last_seq) for c in ledger.checkpoints(2)] == [(1, 2)]
        ledger.append(make_event(3), partition=2, offset=3, now_ms=T0_MS + 70_000)
        ledger.append(make_event(4), partition=2, offset=4, now_ms=T0_MS + 80_000)  # due at append time
        assert [(c.first_seq, c.last_seq) for c in ledger.checkpoints(2)] == [(1, 2), (3, 4)]
        assert ledger.verify().is_ok


def test_records_limit_gives_the_newest_oldest_first(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        assert [r["event_id"] for r in ledger.records(limit=3)] == [f"ev-{NUM + i}" for i in (1, 2, 3)]
        assert [r["seq"] for r in ledger.records(limit=3, chain_id=0)] == [NUM - 2, NUM - 1, NUM]


def test_canonical_json_is_sorted_and_compact(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        canonical = ledger.records(limit=1)[0]["canonical_json"]
    assert canonical.startswith('{"event":{"assignment":null,"cached_prompt_tokens":null,"completion_tokens":')
    assert '"ledger":{"appended_ms":' in canonical and '"chain_id":1,' in canonical and ", " not in canonical


def test_a_ledger_from_before_an_optional_field_gets_its_column_and_stays_verifiable(db: Path, raw) -> None:
    for name in ("assignment", "shadow_of"):  # as a ledger written before traffic policies was
        raw.execute(f"ALTER TABLE {TABLE} DROP COLUMN {name}")
    raw.close()
    with pytest.raises(LedgerError, match="another AuditEvent schema"):
        Ledger(db, readonly=True).__enter__()  # read-only: nothing is migrated, it says why
    with open_ledger(db) as ledger:  # the auditor's open adds the columns, NULL in the old rows
        assert ledger.append(make_event(NUM + 10), partition=0, offset=999, now_ms=T0_MS + 999)
    report = verify(db)
    assert report.is_ok, report.describe()
    assert report.num_records == NUM + 4


def test_redelivered_event_is_not_a_second_record(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    with open_ledger(db) as ledger:
        assert ledger.append(make_event(3), partition=0, offset=103) is False
        assert ledger.append(make_event(3), partition=2, offset=555) is False  # other origin, same event
        with caplog.at_level(logging.WARNING):
            assert ledger.append(make_event(3, principal="someone-else"), partition=0, offset=103) is False
        assert "re-sent with different content" in caplog.text
        assert ledger.num_records() == NUM + 3
        assert ledger.append(make_event(NUM + 10), partition=0, offset=1) is True
        assert ledger.verify().is_ok


def test_event_past_64_bit_integers_is_refused_untouched(db: Path) -> None:
    # the wire takes up to 2^64 - 1 (an unsigned seed); SQLite stores signed 64-bit integers
    event = make_event(NUM + 10, seed=2**64 - 1)
    assert unstorable_reason(event) == f"seed={2**64 - 1} does not fit a 64-bit integer"
    assert unstorable_reason(make_event(1, seed=2**63 - 1)) is None
    with Ledger(db) as ledger:
        with pytest.raises(ValueError, match="cannot be stored"):
            ledger.append(event, partition=0, offset=1)
        assert ledger.num_records() == NUM + 3 and ledger.verify().is_ok


def test_records_hold_no_raw_text(db: Path) -> None:
    data = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))  # with -wal and -shm
    assert b"prompt 3" not in data and b"output 3" not in data


def test_triggers_refuse_update_and_delete(db: Path) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    for table in (TABLE, CHECKPOINTS):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute(f"UPDATE {table} SET chain_id = 7 WHERE chain_id = 0")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute(f"DELETE FROM {table} WHERE chain_id = 0")
    conn.close()
    assert verify(db).is_ok


def test_empty_ledger_verifies(tmp_path: Path) -> None:
    with Ledger(tmp_path / "empty.sqlite") as ledger:
        report = ledger.verify()
    assert report.is_ok and report.num_records == 0 and report.chains == []


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


def assert_broken(path: Path, seq: int | None, event_id: str | None, kind: str, chain: int = 0) -> str:
    """verify names the record in `chain` (and only that chain is broken); returns its line."""
    report = verify(path)
    assert not report.is_ok
    assert [c.chain_id for c in report.broken] == [chain], report.describe()
    broken = report.chain(chain)
    assert (broken.broken_seq, broken.broken_event_id, broken.kind) == (seq, event_id, kind), report.describe()
    assert report.describe().startswith("BROKEN: 1 chain(s) of ")
    line = broken.describe()
    if broken.broken_checkpoint is None:
        assert line.startswith(f"BROKEN chain={chain} at record seq={seq} (event_id={event_id}): {kind}: ")
    assert line in report.describe().splitlines()
    return line


def test_edited_column_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET principal = 'mallory' WHERE chain_id = 0 AND seq = 5")
    assert "principal" in assert_broken(db, 5, "ev-5", "edited")


def test_edited_record_in_another_chain_is_found_there(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET principal = 'mallory' WHERE chain_id = 1 AND seq = 2")
    assert "principal" in assert_broken(db, 2, f"ev-{NUM + 2}", "edited", chain=1)


def test_record_moved_to_another_chain_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET chain_id = 1, seq = 4 WHERE chain_id = 0 AND seq = 10")
    assert "chain_id" in assert_broken(db, 4, "ev-10", "edited", chain=1)


def test_edited_column_and_json_are_found(db: Path, raw: sqlite3.Connection) -> None:
    old = row(raw, 5)
    new_json = old["canonical_json"].replace(old["output_hmac"], "0" * 64)
    raw.execute(
        f"UPDATE {TABLE} SET output_hmac = ?, canonical_json = ? WHERE chain_id = 0 AND seq = 5", ("0" * 64, new_json)
    )
    assert "record_hash does not match" in assert_broken(db, 5, "ev-5", "edited")


def test_edited_and_rehashed_record_is_found(db: Path, raw: sqlite3.Connection) -> None:
    old = row(raw, 5)
    new_json = old["canonical_json"].replace('"principal":"user-2"', '"principal":"mallory"')
    assert new_json != old["canonical_json"]
    raw.execute(
        f"UPDATE {TABLE} SET principal = 'mallory', canonical_json = ?, record_hash = ? WHERE chain_id = 0 AND seq = 5",
        (new_json, chain_hash(old["prev_hash"], new_json)),
    )
    assert "rewritten and rehashed" in assert_broken(db, 5, "ev-5", "edited")


def rehash_from(conn: sqlite3.Connection, seq: int) -> None:
    """Rewrite chain 0's record `seq` and rehash every record after it: the chain itself looks intact."""
    prev = row(conn, seq - 1)["record_hash"]
    for s in range(seq, NUM + 1):
        old = row(conn, s)
        canonical = old["canonical_json"]
        if s == seq:
            canonical = canonical.replace(f'"principal":"{old["principal"]}"', '"principal":"mallory"')
        new_hash = chain_hash(prev, canonical)
        conn.execute(
            f"UPDATE {TABLE} SET principal = ?, canonical_json = ?, prev_hash = ?, record_hash = ? "
            "WHERE chain_id = 0 AND seq = ?",
            ("mallory" if s == seq else old["principal"], canonical, prev, new_hash, s),
        )
        prev = new_hash


def test_record_rewritten_with_the_chain_rehashed_is_caught_by_its_checkpoint(
    db: Path, raw: sqlite3.Connection
) -> None:
    rehash_from(raw, 6)
    line = assert_broken(db, 5, "ev-5", "edited")
    assert line.startswith(
        "BROKEN chain=0 at checkpoint 2: edited: the records seq=5..8 no longer hash to its Merkle root"
    )


def test_rewrite_after_the_last_checkpoint_is_not_caught_without_an_anchor(db: Path, raw: sqlite3.Connection) -> None:
    head = verify(db).chain(0).head_hash
    rehash_from(raw, 9)  # seq 9 and 10 are not covered by a checkpoint yet
    report = verify(db)
    assert report.is_ok and report.chain(0).head_hash != head  # an anchored head hash shows it


def test_deleted_record_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE chain_id = 0 AND seq = 5")
    assert "seq=5 are missing" in assert_broken(db, 6, "ev-6", "deleted")


def test_deleted_first_record_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE chain_id = 0 AND seq = 1")
    assert_broken(db, 2, "ev-2", "deleted")


def test_deleted_records_hidden_by_renumbering_are_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE chain_id = 0 AND seq IN (5, 6)")
    raw.execute(f"UPDATE {TABLE} SET seq = seq - 2 WHERE chain_id = 0 AND seq > 6")
    assert "seq=5..6 are missing" in assert_broken(db, 5, "ev-7", "deleted")


def test_deleted_newest_records_are_caught_by_a_checkpoint(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {TABLE} WHERE chain_id = 0 AND seq >= 7")
    line = assert_broken(db, 7, None, "deleted")
    assert "covers seq=5..8 but the chain ends at seq=6" in line


def test_deleted_checkpoint_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {CHECKPOINTS} WHERE chain_id = 0 AND num = 1")
    assert assert_broken(db, None, None, "deleted").startswith("BROKEN chain=0 at checkpoint 2: deleted")


def test_edited_checkpoint_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {CHECKPOINTS} SET merkle_root = ? WHERE chain_id = 0 AND num = 2", ("0" * 64,))
    assert assert_broken(db, None, None, "edited").startswith("BROKEN chain=0 at checkpoint 2: edited")


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
    raw.execute(f"UPDATE {TABLE} SET prev_hash = x'00ff' WHERE chain_id = 0 AND seq = 3")
    assert_broken(db, 3, "ev-3", "edited")


def test_swapped_records_are_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {TABLE} SET seq = -1 WHERE chain_id = 0 AND seq = 5")
    raw.execute(f"UPDATE {TABLE} SET seq = 5 WHERE chain_id = 0 AND seq = 6")
    raw.execute(f"UPDATE {TABLE} SET seq = 6 WHERE chain_id = 0 AND seq = -1")
    reason = assert_broken(db, 5, "ev-6", "reordered")
    assert "event_id=ev-5" in reason and "seq=6" in reason


def test_well_formed_forged_tail_changes_only_the_head(db: Path, raw: sqlite3.Connection) -> None:
    # A chain cannot tell a forged append from a real one; an anchored head hash can.
    head = verify(db).chain(0).head_hash
    insert_forged(raw, NUM + 1, head)
    report = verify(db)
    assert report.is_ok and report.chain(0).head_hash != head


def test_append_batch_is_one_commit_per_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.sqlite"
    items = [(make_event(i), i % 2, 100 + i) for i in range(1, 9)] + [(make_flag(1), 0, 200)]
    items.append((make_event(3), 1, 300))  # a redelivery within the batch
    with open_ledger(path) as ledger:
        statements: list[str] = []
        ledger._store._conn.set_trace_callback(statements.append)
        outcome = ledger.append_batch(items, now_ms=T0_MS)
        assert statements.count("COMMIT") == 2  # one fsync per chain, not per record
        assert outcome.failed == {}
        assert outcome.is_new == {i: i != len(items) - 1 for i in range(len(items))}
        assert [r["event_id"] for r in ledger.records(chain_id=0)] == ["ev-2", "ev-4", "ev-6", "ev-8"]
        assert [r["event_id"] for r in ledger.records(chain_id=1)] == ["ev-1", "ev-3", "ev-5", "ev-7"]
        assert ledger.review_flags.num_flags() == 1
        assert [(c.first_seq, c.last_seq) for c in ledger.checkpoints(0)] == [(1, 4)]
    assert verify(path).is_ok


def test_append_batch_stops_a_chain_at_its_refused_record(tmp_path: Path) -> None:
    path = tmp_path / "audit.sqlite"
    open_ledger(path).close()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute(
        f"CREATE TRIGGER refuse_ev6 BEFORE INSERT ON {TABLE} WHEN NEW.event_id = 'ev-6' "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
    )
    items = [(make_event(i), i % 2, 100 + i) for i in range(1, 9)] + [(make_flag(1), 0, 200)]
    with open_ledger(path) as ledger:
        outcome = ledger.append_batch(items, now_ms=T0_MS)
        index, exc = outcome.failed[0]
        assert list(outcome.failed) == [0] and items[index][0].event_id == "ev-6"
        assert "injected failure" in str(exc)
        # Chain 0 holds what came before ev-6; chain 1 was not held back by it.
        assert [r["event_id"] for r in ledger.records(chain_id=0)] == ["ev-2", "ev-4"]
        assert [r["event_id"] for r in ledger.records(chain_id=1)] == ["ev-1", "ev-3", "ev-5", "ev-7"]
        assert ledger.review_flags.num_flags() == 0
        assert sorted(outcome.is_new) == [0, 1, 2, 3, 4, 6]  # ev-1 .. ev-5, ev-7
        raw.execute("DROP TRIGGER refuse_ev6")
        outcome = ledger.append_batch(items, now_ms=T0_MS + 1)  # redelivered from ev-6 on, and more
        assert outcome.failed == {}
        assert [r["event_id"] for r in ledger.records(chain_id=0)] == ["ev-2", "ev-4", "ev-6", "ev-8"]
        assert ledger.review_flags.num_flags() == 1
    raw.close()
    assert verify(path).is_ok


def test_a_new_ledger_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "audit.sqlite"
    Ledger(path).close()
    assert path.stat().st_mode & 0o777 == 0o600


def test_the_default_ledger_lives_in_weir_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.auditor.config import AuditorSettings

    monkeypatch.setenv("WEIR_HOME", str(tmp_path))
    monkeypatch.delenv("WEIR_AUDIT_DB", raising=False)
    assert AuditorSettings().audit_db == tmp_path / "audit.sqlite"
