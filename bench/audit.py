"""`weir bench audit`: the audit path's costs, measured side by side in one run.

1. Ingestion: AuditEvents appended per second by the ledger core (SQLite, synchronous=FULL, one
   fsync per event, checkpoints on) and through the real path (Kafka -> auditor -> ledger).
2. Fingerprinting: the worker's SimHash cost per request (prompt + output through all-MiniLM-L6-v2,
   alone and batched as the FingerprintBatcher does) against that request's own generation time
   on the default model (weir-tiny-py, in-process Engine).
3. Watermark: z-scores of watermarked and plain outputs, and the quality cost as perplexity of the
   outputs under the unwatermarked model (teacher-forced with transformers), same prompts and seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from bench.stats import print_table
from schemas.codec import encode
from schemas.messages import GenerateRequest, now_ms
from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from schemas.watermark import WatermarkConfig, detect

PROMPTS = [
    "def main():",
    "import os\n",
    "class Stack:\n",
    "# parse the arguments\n",
    "def add(a, b):\n",
    "for i in range(10):\n",
    "with open(path) as f:\n",
    "try:\n",
]


def make_events(n: int):
    from schemas.fingerprint import key_id, keyed_hmac
    from schemas.messages import AuditEvent
    from services.auditor.config import AuditorSettings

    key = AuditorSettings().hmac_key()  # the deployment's key, as its workers use it
    return [
        AuditEvent(
            event_id=f"bench-{i}",
            request_id=f"req-{i}",
            model="weir-tiny-py",
            model_version="weir-tiny-py@1",
            weights_sha256="ab" * 32,
            principal="bench",
            tenant="default",
            prompt_hmac=keyed_hmac(key, f"p{i}"),
            output_hmac=keyed_hmac(key, f"o{i}"),
            hmac_key_id=key_id(key),
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=64,
            seed=i,
            prompt_tokens=5,
            completion_tokens=64,
            finish_reason="length",
            worker_id="bench",
            request_created_ms=now_ms(),
            received_ms=now_ms(),
            finished_ms=now_ms(),
            prompt_simhash="0123456789abcdef",
            output_simhash="fedcba9876543210",
            fingerprint_model="bench",
            mean_token_entropy=2.0,
        )
        for i in range(n)
    ]


def ingest_core(n: int, batch: int) -> float:
    """Events/s of the Ledger alone: append() per event (batch 1), or append_batch() of `batch`."""
    from services.auditor.ledger import Ledger

    items = [(event, i % 4, i) for i, event in enumerate(make_events(n))]
    with tempfile.TemporaryDirectory() as tmp, Ledger(Path(tmp) / "a.sqlite", checkpoint_every_records=100) as ledger:
        started = time.perf_counter()
        if batch == 1:
            for event, partition, offset in items:
                ledger.append(event, partition=partition, offset=offset)
        else:
            for i in range(0, n, batch):
                assert not ledger.append_batch(items[i : i + batch]).failed
        elapsed = time.perf_counter() - started
        assert ledger.verify().is_ok
    return n / elapsed


async def ingest_kafka(bootstrap: str, n: int) -> float:
    """Events/s from the first event appended to the last, through the auditor app (a group commit
    per fetched batch)."""
    from aiokafka import AIOKafkaProducer

    from services.auditor.app import create_app
    from services.auditor.config import AuditorSettings
    from services.auditor.ledger import Ledger
    from weir.kafka.admin import delete_topics, ensure_topics

    topics = Topics(prefix=f"bench{uuid.uuid4().hex[:8]}")
    specs = [s for s in topics.core_specs() if s.name in (topics.audit, topics.audit_anchors, topics.dead_letter)]
    await ensure_topics(bootstrap, specs)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5)
    await producer.start()
    try:
        for event in make_events(n):
            await producer.send(topics.audit, encode(event), key=event.request_id.encode())
        await producer.flush()
    finally:
        await producer.stop()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "a.sqlite"
        settings = AuditorSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, audit_db=db)
        async with create_app(settings):
            while True:
                await asyncio.sleep(0.2)
                if db.exists():
                    with Ledger(db, readonly=True) as ledger:
                        if ledger.num_records() >= n:
                            appended = [int(r["appended_ms"]) for r in ledger.records()]
                            break
        # From the start of the first batch's append to the start of the last one's (a batch's
        # records share its appended_ms), over the records before the last batch: the consumer
        # group's join time is not ingestion.
        last_ms = max(appended)
        elapsed = max(last_ms - min(appended), 1) / 1000
        num_before_last = sum(1 for ms in appended if ms < last_ms)
    await delete_topics(bootstrap, [s.name for s in specs])
    return num_before_last / elapsed if num_before_last else float("nan")


def generate(engine, tenant: str, max_tokens: int) -> dict:
    outs = {}
    for i, prompt in enumerate(PROMPTS):
        request = GenerateRequest(
            request_id=f"{tenant}-{i}",
            model="weir-tiny-py",
            prompt=prompt,
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=1.0,
            tenant=tenant,
            deadline_ms=now_ms() + 3_600_000,
            reply_to="-",
        )
        assert engine.add(request, now_ms()) is None
    ids: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step(now_ms()):
            ids.setdefault(out.request_id, []).extend(out.token_ids)
            if out.is_final:
                outs[out.request_id] = out
    for rid, out in outs.items():
        out.token_ids = ids[rid]  # every output id, not only the final event's
    return outs


def perplexity(hf, tokenizer, prompt: str, output_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of the output tokens given the prompt), unwatermarked model."""
    prompt_ids = tokenizer.encode(prompt)
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt_ids) - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(output_ids))
    return math.exp(float(nll))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="weir bench audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=2000, help="events to ingest (default %(default)s)")
    parser.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka for the end-to-end ingestion")
    parser.add_argument("--no-kafka", action="store_true", help="skip the ingestion through Kafka")
    parser.add_argument(
        "--max-tokens", type=int, default=200, help="tokens per generated request (default %(default)s)"
    )
    parser.add_argument("--model-repo", default="models.toml")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, (torch.get_num_threads() or 2) // 2))
    print_ingestion(args.events, None if args.no_kafka else args.bootstrap)

    from services.worker.engine import Engine, EngineConfig
    from services.worker.engine.watermark import Watermarker
    from weir.embedding.fingerprints import build_fingerprinter

    repo = load_model_repo(args.model_repo)
    config = repo.models["weir-tiny-py"]
    assert config.path is not None
    mark = WatermarkConfig(gamma=0.25, delta=2.0, key=b"bench-watermark-key")
    engine = Engine(config.path, EngineConfig(), torch.device("cpu"), Watermarker({"marked": mark}))
    generate(engine, "warmup", 8)
    plain, marked = generate(engine, "plain", args.max_tokens), generate(engine, "marked", args.max_tokens)

    fingerprinter = build_fingerprinter("all-MiniLM-L6-v2", repo)
    if fingerprinter is None:
        print("\n(no fingerprint model: all-MiniLM-L6-v2 cannot load here; fingerprint table skipped)")
    else:
        print_fingerprint_cost(fingerprinter, list(plain.values()), args.max_tokens)
    print_watermark_quality(
        config.path,
        engine.tokenizer,
        mark,
        {"plain": plain, "watermarked (gamma .25, delta 2)": marked},
        args.max_tokens,
    )
    return 0


def print_ingestion(num_events: int, bootstrap: str | None) -> None:
    """Events/s into the ledger: its core alone, per event and in batches, and through Kafka unless bootstrap is None."""
    rows = [
        ["ledger core, append per event (one fsync each)", f"{ingest_core(num_events, 1):,.0f}"],
        ["ledger core, append_batch of 100 (one fsync per chain)", f"{ingest_core(num_events, 100):,.0f}"],
    ]
    if bootstrap is not None:
        rows.append(["Kafka -> auditor -> ledger", f"{asyncio.run(ingest_kafka(bootstrap, num_events)):,.0f}"])
    print(f"\nIngestion of {num_events} AuditEvents (4 partitions = 4 chains, checkpoint every 100 records)")
    print_table(rows, ["path", "events/s"])


def print_fingerprint_cost(fingerprinter, finished: list, max_tokens: int) -> None:
    """Fingerprint cost per request, alone and batched, against the time generating that request took."""
    fingerprinter.simhash(["warm up"])
    alone = []
    for out in finished:
        started = time.perf_counter()
        fingerprinter.simhash([out.prompt_text or "", out.output_text or ""])
        alone.append((time.perf_counter() - started) * 1000)
    started = time.perf_counter()
    fingerprinter.simhash([t for out in finished for t in (out.prompt_text or "", out.output_text or "")])
    batched = (time.perf_counter() - started) * 1000 / len(finished)
    gen_ms = [(out.finished_ms or 0) - (out.received_ms or 0) for out in finished]
    print(
        f"\nFingerprinting vs generation ({len(finished)} requests of {max_tokens} tokens, generated together "
        "in one continuous batch; fingerprints on one thread)"
    )
    print_table(
        [
            ["generation time per request (ms)", f"{statistics.mean(gen_ms):.0f}", "100%"],
            [
                "fingerprint, one request alone (ms)",
                f"{statistics.mean(alone):.1f}",
                f"{100 * statistics.mean(alone) / statistics.mean(gen_ms):.1f}%",
            ],
            [
                f"fingerprint, batched {len(finished)} (ms per request)",
                f"{batched:.1f}",
                f"{100 * batched / statistics.mean(gen_ms):.1f}%",
            ],
        ],
        ["", "ms", "of generation"],
    )


def print_watermark_quality(
    model_path: Path, tokenizer, mark: WatermarkConfig, outputs: dict[str, dict], max_tokens: int
) -> None:
    """Per set of outputs: perplexity under the unwatermarked model, mean and least watermark z."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    table = []
    for name, outs in outputs.items():
        ppl = [
            perplexity(hf, tokenizer, PROMPTS[int(rid.split("-")[1])], out.token_ids)
            for rid, out in sorted(outs.items())
        ]
        zs = [detect(mark, tokenizer.encode(out.output_text or "")).z_score for out in outs.values()]
        table.append([name, f"{statistics.mean(ppl):.2f}", f"{statistics.mean(zs):.2f}", f"{min(zs):.2f}"])
    print(
        f"\nWatermark: {len(PROMPTS)} outputs of {max_tokens} tokens each, temperature 1; perplexity under the "
        "unwatermarked model; z of the re-tokenized text"
    )
    print_table(table, ["outputs", "perplexity", "mean z", "min z"])
