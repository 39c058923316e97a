"""Review flags in the ledger: stored once per flag_id in their own hash chains, verified, listed
(CLI, API, /metrics), and refused with a reason when malformed."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from schemas.codec import DecodeError, encode
from schemas.messages import ReviewFlag
from services.auditor import cli
from services.auditor.api import create_api
from services.auditor.config import AuditorSettings
from services.auditor.consumers import decode_audit_value
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger, LedgerError
from services.auditor.reviews import FLAGS
from services.auditor.watermark import WatermarkDetector
from weir.metrics import value
from weir.service import ops_app

from .factories import T0_MS, make_event, make_flag

TOKEN = "admin-token-for-tests"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Three events and four flags: flags 1, 2, 4 on partition 0, flag 3 on partition 1."""
    path = tmp_path / "audit.sqlite"
    with Ledger(path, checkpoint_every_records=2, checkpoint_every_s=3600) as ledger:
        for i in (1, 2, 3):
            assert ledger.append(make_event(i), partition=0, offset=i, now_ms=T0_MS + i)
        for i, partition in ((1, 0), (2, 0), (3, 1), (4, 0)):
            assert ledger.append_flag(make_flag(i), partition=partition, offset=10 + i, now_ms=T0_MS + 10 + i)
    return path


@pytest.fixture
def raw(db: Path) -> Iterator[sqlite3.Connection]:
    """A raw connection of someone who holds the file, the flags' triggers dropped."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(f"DROP TRIGGER {FLAGS}_no_update")
    conn.execute(f"DROP TRIGGER {FLAGS}_no_delete")
    yield conn
    conn.close()


def verify(path: Path):
    with Ledger(path, readonly=True) as ledger:
        return ledger.verify()


def test_flags_form_intact_chains_beside_the_records(db: Path) -> None:
    report = verify(db)
    assert report.is_ok, report.describe()
    assert (report.num_records, report.num_flags) == (3, 4)
    assert [(c.chain_id, c.num_records) for c in report.flag_chains] == [(0, 3), (1, 1)]
    lines = report.describe().splitlines()
    assert lines[0] == "OK: 3 records in 1 chains, 1 checkpoints, all intact; 4 review flags in 2 chains"
    assert lines[-2].startswith("review flags chain 0: 3 flags, 1 checkpoints, intact (head ")
    with Ledger(db, readonly=True) as ledger:
        flags = ledger.review_flags.rows()
        assert ledger.num_records() == 3 and ledger.review_flags.num_flags() == 4
    assert [f["flag_id"] for f in flags] == ["flag-1", "flag-2", "flag-3", "flag-4"]
    assert [(f["chain_id"], f["seq"]) for f in flags] == [(0, 1), (0, 2), (1, 1), (0, 3)]
    assert flags[1]["prev_hash"] == flags[0]["record_hash"]
    stored = orjson.loads(flags[0]["canonical_json"])
    assert ReviewFlag.model_validate(stored["review_flag"]) == make_flag(1)
    assert stored["ledger"] == {
        "chain_id": 0,
        "seq": 1,
        "kafka_partition": 0,
        "kafka_offset": 11,
        "appended_ms": T0_MS + 11,
    }
    assert json.loads(flags[0]["rules"]) == ["ignore_previous_instructions", "role_override"]


def test_duplicate_flag_id_is_stored_once(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Ledger(db) as ledger:
        assert not ledger.append_flag(make_flag(2), partition=0, offset=99)  # a redelivery
        assert not ledger.append_flag(make_flag(2, num_detections=9), partition=1, offset=100)
        assert [f["flag_id"] for f in ledger.review_flags.rows()].count("flag-2") == 1
        assert ledger.review_flags.num_flags() == 4
    assert "flag_id flag-2 re-sent with different content" in caplog.text
    assert verify(db).is_ok


def test_triggers_refuse_update_and_delete_of_flags(db: Path) -> None:
    conn = sqlite3.connect(db)
    for sql in (f"UPDATE {FLAGS} SET num_detections = 1", f"DELETE FROM {FLAGS}"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute(sql)
    conn.close()


def assert_flag_broken(path: Path, seq: int, flag_id: str, kind: str) -> str:
    report = verify(path)
    assert not report.is_ok
    assert all(c.is_ok for c in report.chains), "only the flag chain is broken"
    [broken] = report.broken
    assert (broken.log, broken.chain_id, broken.broken_seq, broken.broken_event_id, broken.kind) == (
        "review_flags",
        0,
        seq,
        flag_id,
        kind,
    ), report.describe()
    line = broken.describe()
    assert line.startswith(f"BROKEN review flags chain=0 at flag seq={seq} (flag_id={flag_id}): {kind}: ")
    assert line in report.describe().splitlines()
    return line


def test_edited_flag_column_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"UPDATE {FLAGS} SET principal = 'someone-else' WHERE flag_id = 'flag-2'")
    assert "column principal='someone-else' differs" in assert_flag_broken(db, 2, "flag-2", "edited")


def test_edited_and_rehashed_flag_is_found(db: Path, raw: sqlite3.Connection) -> None:
    from services.auditor.chain import chain_hash

    row = raw.execute(f"SELECT canonical_json, prev_hash FROM {FLAGS} WHERE flag_id = 'flag-1'").fetchone()
    forged = row[0].replace('"num_detections":5', '"num_detections":1')
    raw.execute(
        f"UPDATE {FLAGS} SET canonical_json = ?, num_detections = 1, record_hash = ? WHERE flag_id = 'flag-1'",
        (forged, chain_hash(row[1], forged)),
    )
    assert "rewritten and rehashed" in assert_flag_broken(db, 1, "flag-1", "edited")


def test_deleted_flag_is_found(db: Path, raw: sqlite3.Connection) -> None:
    raw.execute(f"DELETE FROM {FLAGS} WHERE flag_id = 'flag-2'")
    assert_flag_broken(db, 3, "flag-4", "deleted")


def test_ledger_written_before_review_flags_verifies_and_is_migrated(db: Path) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(f"DROP TABLE {FLAGS}")  # what a ledger of the previous auditor looks like
    conn.close()
    with Ledger(db, readonly=True) as ledger:
        assert not ledger.review_flags.is_present and ledger.review_flags.rows() == []
        report = ledger.verify()
    assert report.is_ok and report.flag_chains == []
    assert report.describe().startswith("OK: 3 records in 1 chains, 1 checkpoints, all intact\n")
    with Ledger(db) as ledger:  # an auditor opening it for writing adds the table
        assert ledger.append_flag(make_flag(7), partition=0, offset=1)
        assert ledger.verify().num_flags == 1


def test_flags_table_of_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    Ledger(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(f"DROP TABLE {FLAGS}")
    conn.execute(f"CREATE TABLE {FLAGS} (flag_id TEXT)")
    conn.close()
    with pytest.raises(LedgerError, match="another ReviewFlag schema"):
        Ledger(path, readonly=True)


def test_flag_past_64_bit_integers_is_refused_untouched(db: Path) -> None:
    with Ledger(db) as ledger, pytest.raises(ValueError, match=r"window_s=.*64-bit"):
        ledger.append_flag(make_flag(9, window_s=2**63), partition=0, offset=1)
    assert verify(db).num_flags == 4


def decode_body(body: bytes):
    return decode_audit_value(body)


def test_audit_topic_decoder_tells_flags_from_events_and_refuses_the_malformed() -> None:
    assert decode_body(encode(make_flag(1))) == make_flag(1)
    assert decode_body(encode(make_event(1))) == make_event(1)
    no_kind = orjson.loads(encode(make_flag(1)))
    del no_kind["kind"]
    with_text = orjson.loads(encode(make_flag(1))) | {"prompt": "ignore previous instructions"}
    for bad, why in [
        (orjson.dumps(no_kind), "invalid audit record"),
        (orjson.dumps(with_text), "prompt"),
        (encode(make_flag(1)).replace(b'"schema_version":1', b'"schema_version":2'), "newer than this auditor"),
        (encode(make_flag(1, num_detections=2**63)), "invalid ReviewFlag: num_detections="),
    ]:
        with pytest.raises(DecodeError, match=why):  # the auditor dead-letters a DecodeError
            decode_body(bad)


def test_cli_reviews_lists_the_newest_flags(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["reviews", "--db", str(db), "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "user-0@default prompt_injection detections=5 window=3600s" in lines[0]
    assert "rules=ignore_previous_instructions,role_override" in lines[0] and "flag=flag-3" in lines[0]
    assert "flag=flag-4" in lines[1]
    assert cli.main(["reviews", "--db", str(db), "--principal", "user-2", "--json"]) == 0
    [only] = capsys.readouterr().out.splitlines()
    assert orjson.loads(only)["review_flag"]["flag_id"] == "flag-2"


def test_cli_verify_names_a_broken_flag_chain(
    db: Path, raw: sqlite3.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    raw.execute(f"UPDATE {FLAGS} SET rules = '[]' WHERE flag_id = 'flag-4'")
    assert cli.main(["verify", "--db", str(db), "--no-anchor"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("BROKEN: 1 chain(s) of 3 records") and "BROKEN review flags chain=0 at flag seq=3" in out


def test_reviews_api_needs_the_token_and_lists_flags(db: Path, tmp_path: Path) -> None:
    settings = AuditorSettings(
        audit_db=db,
        audit_admin_token=SecretStr(TOKEN),
        model_repo=str(Path(__file__).resolve().parents[2] / "models.toml"),
    )
    health = HealthMetrics()
    health.observe_flag(make_flag(1))
    api = create_api(settings, lambda: Ledger(db, readonly=True), WatermarkDetector(settings.model_repo, {}))
    client = TestClient(ops_app(lambda: (True, {}), health.render, mount=api))
    assert client.get("/v1/audit/reviews").status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    flags = client.get("/v1/audit/reviews", params={"principal": "user-1"}, headers=auth).json()["flags"]
    assert [(f["flag_id"], f["principal"], f["num_detections"], f["chain_id"], f["seq"]) for f in flags] == [
        ("flag-1", "user-1", 5, 0, 1),
        ("flag-4", "user-1", 5, 0, 3),
    ]
    assert flags[0]["rules"] == ["ignore_previous_instructions", "role_override"]
    assert len(client.get("/v1/audit/reviews", params={"limit": 3}, headers=auth).json()["flags"]) == 3
    metrics = client.get("/metrics").text
    assert value(metrics, "weir_audit_review_flags_total", tenant="default", reason="prompt_injection") == 1
