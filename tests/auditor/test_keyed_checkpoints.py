"""Keyed checkpoints and their anchors, without Kafka: the MAC of every checkpoint (of records and
of review flags), what a rewrite that recomputes the unkeyed hashes leaves behind, and
check_anchors against anchor records as the topic would hold them."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from schemas.codec import encode
from schemas.messages import AuditAnchor
from services.auditor.anchors import AnchorRecord, anchor_problem
from services.auditor.chain import checkpoint_mac
from services.auditor.ledger import CHECKPOINTS, Ledger, LedgerError
from services.auditor.reviews import FLAG_CHECKPOINTS
from weir.audit_key import AuditKeyError, checkpoint_key_file, key_file, resolve_checkpoint_key

from .factories import T0_MS, make_event, make_flag
from .tamper import ATTACKER_KEY, cut_tail, open_raw, rewrite_chain

KEY = bytes(range(32))
TOPIC = "t.audit.anchors"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Chain 0: 8 records, checkpoints over 1..4 and 5..8; flag chain 0: 5 flags, checkpoints 1..2, 3..4."""
    path = tmp_path / "audit.sqlite"
    with Ledger(path, checkpoint_every_records=4, checkpoint_every_s=3600, checkpoint_key=KEY) as ledger:
        for i in range(1, 9):
            assert ledger.append(make_event(i), partition=0, offset=i, now_ms=T0_MS + i)
    with Ledger(path, checkpoint_every_records=2, checkpoint_every_s=3600, checkpoint_key=KEY) as ledger:
        for i in range(1, 6):
            assert ledger.append_flag(make_flag(i), partition=0, offset=20 + i, now_ms=T0_MS + 20 + i)
    return path


def verify(db: Path, key: bytes = KEY):
    with Ledger(db, readonly=True, checkpoint_key=key) as ledger:
        return ledger.verify()


def anchors_of(db: Path) -> list[AnchorRecord]:
    """The newest anchor of every chain, as the auditor publishes them, as topic records."""
    with Ledger(db, readonly=True, checkpoint_key=KEY) as ledger:
        return [AnchorRecord(offset, encode(a)) for offset, a in enumerate(ledger.latest_anchors())]


def against(db: Path, anchors: list[AnchorRecord]):
    with Ledger(db, readonly=True, checkpoint_key=KEY) as ledger:
        return ledger.verify_with_anchors(TOPIC, anchors)


def test_every_checkpoint_carries_its_mac_under_the_key(db: Path) -> None:
    report = verify(db)
    assert report.is_ok, report.describe()
    with Ledger(db, readonly=True, checkpoint_key=KEY) as ledger:
        for log in ("audit", "review_flags"):
            cps = ledger.checkpoints(0, log)
            assert [(cp.first_seq, cp.last_seq) for cp in cps] == (
                [(1, 4), (5, 8)] if log == "audit" else [(1, 2), (3, 4)]
            )
            assert all(cp.mac == checkpoint_mac(KEY, log, 0, cp.checkpoint_hash) for cp in cps)
        assert sorted((a.log, a.num, a.last_seq) for a in ledger.latest_anchors()) == [
            ("audit", 2, 8),
            ("review_flags", 2, 4),
        ]
    assert "review flags chain 0: 5 flags, 2 checkpoints, intact" in report.describe()


def test_the_mac_binds_the_log_chain_and_key() -> None:
    mac = checkpoint_mac(KEY, "audit", 0, "ab" * 32)
    assert len(mac) == 64
    assert mac != checkpoint_mac(KEY, "review_flags", 0, "ab" * 32)
    assert mac != checkpoint_mac(KEY, "audit", 1, "ab" * 32)
    assert mac != checkpoint_mac(ATTACKER_KEY, "audit", 0, "ab" * 32)
    assert mac != checkpoint_mac(KEY, "audit", 0, "ac" * 32)


def test_another_key_does_not_verify(db: Path) -> None:
    report = verify(db, key=ATTACKER_KEY)
    assert not report.is_ok
    assert {(b.log, b.broken_checkpoint, b.kind) for b in report.broken} == {
        ("audit", 1, "forged"),
        ("review_flags", 1, "forged"),
    }
    assert "MAC does not match the checkpoint key" in report.describe()


def test_rewrite_with_recomputed_hashes_and_checkpoints_fails_on_their_macs(db: Path) -> None:
    with open_raw(db) as conn:
        rewrite_chain(conn, "audit", 0, 3, "principal", "nobody")
    report = verify(db)
    [broken] = report.broken
    assert (broken.broken_checkpoint, broken.kind) == (1, "forged"), report.describe()
    assert (
        report.describe().splitlines()[1].startswith("BROKEN chain=0 at checkpoint 1: forged: its MAC does not match")
    )


def test_rewrite_keeping_the_old_macs_fails_too(db: Path) -> None:
    with open_raw(db) as conn:
        rewrite_chain(conn, "audit", 0, 6, "seed", 7, mac_key=None)
    [broken] = verify(db).broken
    assert (broken.broken_checkpoint, broken.kind) == (2, "forged")


def test_a_checkpoint_whose_mac_was_removed_is_named(db: Path) -> None:
    with open_raw(db) as conn:
        conn.execute(f"UPDATE {CHECKPOINTS} SET mac = NULL WHERE num = 2")
    [broken] = verify(db).broken
    assert broken.broken_checkpoint == 2 and "carries no MAC" in str(broken.reason)


def test_flag_rewrite_with_recomputed_checkpoints_is_caught(db: Path) -> None:
    with open_raw(db) as conn:
        rewrite_chain(conn, "review_flags", 0, 2, "principal", "someone-else")
    [broken] = verify(db).broken
    assert (broken.log, broken.broken_checkpoint, broken.kind) == ("review_flags", 1, "forged")
    assert broken.describe().startswith("BROKEN review flags chain=0 at checkpoint 1: forged: ")


def test_deleted_newest_flags_under_a_checkpoint_are_caught(db: Path) -> None:
    with open_raw(db) as conn:
        conn.execute("DELETE FROM review_flags WHERE seq >= 4")
    [broken] = verify(db).broken
    assert (broken.log, broken.broken_checkpoint, broken.kind) == ("review_flags", 2, "deleted")
    assert "newest flags were deleted" in str(broken.reason)


def test_a_clean_ledger_matches_its_anchors(db: Path) -> None:
    anchors = anchors_of(db)
    with Ledger(db, checkpoint_every_records=4, checkpoint_every_s=3600, checkpoint_key=KEY) as ledger:
        assert ledger.append(make_event(9), partition=0, offset=9)  # after the anchors: not anchored yet
    report, anchored = against(db, anchors)
    assert report.is_ok and anchored.is_ok, anchored.describe()
    text = anchored.describe()
    assert text.startswith(f"ANCHORS OK: the ledger matches the 2 anchor(s) in Kafka ({TOPIC})")
    assert "audit chain 0: anchored up to checkpoint 2 (seq 8, head " in text
    assert "0 checkpoint(s) and 1 record(s) after it not anchored yet" in text
    assert "review flags chain 0: anchored up to checkpoint 2 (seq 4" in text


def test_a_cut_tail_verifies_alone_but_not_against_its_anchor(db: Path) -> None:
    anchors = anchors_of(db)
    with open_raw(db) as conn:
        assert cut_tail(conn, "audit", 0, keep_checkpoints=1) == 4
    report, anchored = against(db, anchors)
    assert report.is_ok, "the database alone is consistent: only the anchor shows the cut"
    [problem] = anchored.problems
    assert problem.startswith("TRUNCATED audit chain 0: Kafka's anchor of checkpoint 2 covers seq 5..8")
    assert "the database has 1 checkpoint(s) of it, ending at seq 4, and 4 record(s)" in problem


def test_a_rewrite_by_the_keys_holder_shows_against_the_anchor(db: Path) -> None:
    anchors = anchors_of(db)
    with open_raw(db) as conn:
        rewrite_chain(conn, "review_flags", 0, 1, "tenant", "other", mac_key=KEY)
    report, anchored = against(db, anchors)
    assert report.is_ok, "with the key, the database alone can be made consistent"
    [problem] = anchored.problems
    assert problem.startswith("REWRITTEN review flags chain 0: the database's checkpoint 2 (seq 3..4)")


def test_forged_and_malformed_anchors_are_named(db: Path) -> None:
    genuine = anchors_of(db)
    anchor = AuditAnchor.model_validate_json(genuine[0].value or b"")
    forged = anchor.model_copy(update={"mac": checkpoint_mac(ATTACKER_KEY, "audit", 0, anchor.checkpoint_hash)})
    edited = anchor.model_copy(update={"last_seq": 10})  # the genuine MAC, a claim it does not cover
    records = [*genuine, AnchorRecord(7, encode(forged)), AnchorRecord(8, encode(edited)), AnchorRecord(9, b"{}")]
    report, anchored = against(db, records)
    assert report.is_ok and not anchored.is_ok
    assert anchored.problems[0] == (
        "FORGED anchor at offset 7 (audit chain 0, checkpoint 2): its MAC does not match the checkpoint key"
    )
    assert anchored.problems[1].endswith("its fields do not hash to its checkpoint_hash")
    assert anchored.problems[2].startswith("FORGED anchor at offset 9: it is not an AuditAnchor")
    assert anchor_problem(anchor, KEY) is None and anchor_problem(anchor, ATTACKER_KEY) is not None


def test_a_chain_without_any_anchor_is_unanchored(db: Path) -> None:
    report, anchored = against(db, [])
    assert report.is_ok
    assert [p.split(":")[0] for p in anchored.problems] == [
        "UNANCHORED audit chain 0",
        "UNANCHORED review flags chain 0",
    ]


def test_a_ledger_whose_checkpoints_predate_macs_is_migrated_and_named(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with Ledger(path, checkpoint_every_records=2, checkpoint_every_s=3600, checkpoint_key=KEY) as ledger:
        for i in range(1, 4):
            ledger.append(make_event(i), partition=0, offset=i)
    with open_raw(path) as conn:  # the checkpoints table of the previous auditor: no mac column
        conn.execute(f"ALTER TABLE {CHECKPOINTS} DROP COLUMN mac")
        conn.execute(f"DROP TABLE {FLAG_CHECKPOINTS}")
    with pytest.raises(LedgerError, match="mac"):
        Ledger(path, readonly=True)
    with Ledger(path, checkpoint_every_records=2, checkpoint_every_s=3600, checkpoint_key=KEY) as ledger:
        assert ledger.latest_anchors() == []  # an unkeyed checkpoint cannot be anchored
        ledger.append(make_event(4), partition=0, offset=4)  # the next checkpoint is keyed
        assert [(a.num, a.last_seq) for a in ledger.latest_anchors()] == [(2, 4)]
        report = ledger.verify()
        assert [cp.mac is None for cp in ledger.checkpoints(0)] == [True, False]
    [broken] = report.broken
    assert broken.broken_checkpoint == 1 and "written before checkpoints were keyed" in str(broken.reason)


def test_the_checkpoint_key_is_made_once_apart_from_the_fingerprint_key(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(AuditKeyError, match="no checkpoint key"):
        resolve_checkpoint_key(None, create=False, home=home)  # verify never makes one
    key = resolve_checkpoint_key(None, create=True, home=home)
    path = checkpoint_key_file(home)
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (
        resolve_checkpoint_key(None, create=True, home=home)
        == key
        == resolve_checkpoint_key(None, create=False, home=home)
    )
    assert not key_file(home).exists(), "a separate file from the fingerprint key"
    os.chmod(path, 0o644)
    with pytest.raises(AuditKeyError, match=r"checkpoint key .* has mode 0644"):
        resolve_checkpoint_key(None, create=False, home=home)
    assert resolve_checkpoint_key("hex:" + "11" * 32, create=False, home=home) == b"\x11" * 32
    with pytest.raises(AuditKeyError, match="shorter than 16 bytes"):
        resolve_checkpoint_key("short", create=False, home=home)


def test_a_readonly_ledger_without_a_key_cannot_verify(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_HOME", str(tmp_path / "empty-home"))
    with Ledger(db, readonly=True) as ledger, pytest.raises(LedgerError, match="no checkpoint key"):
        ledger.verify()
    assert not sqlite3.connect(db).execute(f"SELECT count(*) FROM {CHECKPOINTS} WHERE mac IS NULL").fetchone()[0]
