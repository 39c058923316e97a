"""Lookup (exact and semantic), the auditor's HTTP API (lookup, watermark, /metrics) and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from schemas.watermark import WatermarkConfig, green_mask
from services.auditor import cli
from services.auditor.api import create_api
from services.auditor.config import AuditorSettings
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger
from services.auditor.lookup import lookup
from services.auditor.watermark import WatermarkDetector
from weir.metrics import value
from weir.service import ops_app

from .factories import KEY, T0_MS, make_event

REPO = Path(__file__).resolve().parents[2]
TOKEN = "admin-token-for-tests"
WATERMARK = WatermarkConfig(gamma=0.25, delta=2.0, key=b"acme-watermark-key")
# Records 1-3 carry SimHashes: the output of 2 is 3 bits from ASKED, the prompt of 3 is 20 bits away.
ASKED = "00000000000000ff"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "audit.sqlite"
    with Ledger(path) as ledger:
        ledger.append(
            make_event(1, prompt_simhash="ffffffffffffffff", output_simhash="ffffffffffffff00"), 0, 1, now_ms=T0_MS
        )
        ledger.append(make_event(2, output_simhash="00000000000000f8", fingerprint_model="m"), 1, 1, now_ms=T0_MS + 1)
        ledger.append(make_event(3, prompt_simhash="00000000000fffff"), 0, 2, now_ms=T0_MS + 2)
        ledger.append(make_event(4, output_hmac=make_event(1).prompt_hmac), 2, 1, now_ms=T0_MS + 3)  # "prompt 1" again
    return path


def test_exact_lookup_finds_prompt_and_output_by_keyed_hmac(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        found = lookup(ledger, KEY, "  prompt   1 ")  # normalised like the worker does
        assert [(m.event_id, m.field, m.match, m.distance) for m in found] == [
            ("ev-1", "prompt", "exact", 0),
            ("ev-4", "output", "exact", 0),
        ]
        assert found[0].model_version == "weir-tiny@1" and found[0].principal == "user-1"
        assert lookup(ledger, b"another key", "prompt 1") == []


def test_semantic_lookup_ranks_by_hamming_distance(db: Path) -> None:
    with Ledger(db, readonly=True) as ledger:
        found = lookup(ledger, KEY, "not served", simhash=ASKED, max_distance=10)
        assert [(m.event_id, m.field, m.match, m.distance) for m in found] == [("ev-2", "output", "semantic", 3)]
        wide = lookup(ledger, KEY, "not served", simhash=ASKED, max_distance=20)
        assert [(m.event_id, m.distance) for m in wide] == [("ev-2", 3), ("ev-3", 12)]


@pytest.fixture
def client(db: Path) -> TestClient:
    settings = AuditorSettings(
        audit_db=db,
        audit_admin_token=SecretStr(TOKEN),
        audit_hmac_key=SecretStr(KEY.decode()),
        model_repo=str(REPO / "models.toml"),
    )
    health = HealthMetrics()
    with Ledger(db, readonly=True) as ledger:
        for record in ledger.records():
            health.observe(make_event(int(record["event_id"].split("-")[1]), mean_token_entropy=2.0, watermark_z=6.0))
    detector = WatermarkDetector(settings.model_repo, {"acme": WATERMARK})
    api = create_api(settings, lambda: Ledger(db, readonly=True), detector, lambda text: ASKED)
    return TestClient(ops_app(lambda: (True, {}), health.render, mount=api))


def test_lookup_api_needs_the_admin_token(client: TestClient) -> None:
    assert client.post("/v1/audit/lookup", json={"text": "prompt 1"}).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert client.post("/v1/audit/lookup", json={"text": "prompt 1"}, headers=bad).status_code == 401


def test_lookup_api_answers_exact_and_semantic_matches(client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = client.post("/v1/audit/lookup", json={"text": "prompt 1"}, headers=auth).json()
    assert body["simhash"] == ASKED
    assert [(m["event_id"], m["field"], m["match"], m["distance"]) for m in body["matches"]] == [
        ("ev-1", "prompt", "exact", 0),
        ("ev-4", "output", "exact", 0),
        ("ev-2", "output", "semantic", 3),
    ]
    other_key = client.post(
        "/v1/audit/lookup", json={"text": "prompt 1", "hmac_key": "wrong", "max_distance": 0}, headers=auth
    ).json()
    assert other_key["matches"] == []


def test_watermark_api_detects_a_green_text(client: TestClient) -> None:
    tokenizer = WatermarkDetector(REPO / "models.toml", {}).tokenizer(None)
    vocab = tokenizer.get_vocab_size()
    rng = np.random.default_rng(0)
    ids = [tokenizer.token_to_id("def") or 1]
    while len(ids) < 120:  # a random green token whose text re-encodes to the same ids
        candidates = np.flatnonzero(green_mask(WATERMARK, ids[-1], vocab))
        rng.shuffle(candidates)
        ids.append(
            next(int(t) for t in candidates if tokenizer.encode(tokenizer.decode(ids + [int(t)])).ids == ids + [int(t)])
        )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    marked = client.post(
        "/v1/audit/watermark", json={"text": tokenizer.decode(ids), "tenant": "acme"}, headers=auth
    ).json()
    assert marked["z_score"] > 4 and marked["p_value"] < 1e-4
    by_key = client.post(
        "/v1/audit/watermark", json={"text": tokenizer.decode(ids), "key": "other"}, headers=auth
    ).json()
    assert by_key["z_score"] < 4
    assert client.post("/v1/audit/watermark", json={"text": "x", "tenant": "nobody"}, headers=auth).status_code == 400


def test_metrics_expose_entropy_watermark_and_mix(client: TestClient) -> None:
    text = client.get("/metrics").text
    assert value(text, "weir_audit_events_total") == 4
    assert value(text, "weir_audit_requests_total", model="weir-tiny@1", tenant="default", finish_reason="stop") == 4
    assert value(text, "weir_audit_output_entropy_nats_sum", model="weir-tiny@1") == 8
    assert value(text, "weir_audit_output_entropy_nats_bucket", model="weir-tiny@1", le="2.0") == 4
    assert value(text, "weir_audit_watermark_z_count", model="weir-tiny@1") == 4


def test_cli_lookup_prints_exact_matches(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lookup", "--db", str(db), "--key", KEY.decode(), "--text", "prompt 1", "--exact", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(m["event_id"], m["field"]) for m in lines] == [("ev-1", "prompt"), ("ev-4", "output")]


def test_cli_verify_names_the_broken_chain(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sqlite3

    assert cli.main(["verify", "--db", str(db), "--no-anchor"]) == 0
    assert capsys.readouterr().out.startswith("OK: 4 records in 3 chains, 0 checkpoints, all intact")
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("DROP TRIGGER audit_log_no_update")
    conn.execute("UPDATE audit_log SET tenant = 'x' WHERE chain_id = 0 AND seq = 2")
    conn.close()
    assert cli.main(["verify", "--db", str(db), "--no-anchor"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN chain=0 at record seq=2 (event_id=ev-3): edited: column tenant='x'" in out
    assert "chain 1: 1 records, 0 checkpoints, intact" in out
