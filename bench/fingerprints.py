"""`weir bench fingerprints`: the audit fingerprints' CPU per request and lookup quality, int8 beside float32.

CPU: one request's fingerprints are the SimHashes of its prompt and its output, 200 tokens each
(--tokens) by default. Fingerprinted as the worker does (TextFingerprinter.simhash on one thread,
onnxruntime with one intra-op thread), one request per call and --batch requests per call (the
worker's FingerprintBatcher gathers the requests that finished within 20 ms), for float32 and int8
in alternating order over --rounds rounds; CPU is this process's user + system time (nothing else
runs in it meanwhile), per request; medians of rounds, with their range.

Quality, on the fixed paraphrase pairs of tests/data/fingerprints/paraphrases.jsonl: the SimHash
bits that differ between int8 and float32 for every text of the set; and the paraphrase recall of
the auditor's lookup (services/auditor/lookup.py, at its default distance): a ledger holds one
record per pair whose prompt is its first text, and each second text is looked up; a hit is its own
pair's record among the matches, a false match any other record. Three ways: float32 records asked
with float32 (before this change), int8 with int8 (after), and float32 records asked with int8 (a
ledger written before the change, asked after it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.stats import print_table

PARAPHRASES = Path(__file__).resolve().parent.parent / "tests" / "data" / "fingerprints" / "paraphrases.jsonl"


def load_pairs(path: Path = PARAPHRASES) -> list[tuple[str, str]]:
    """The fixed paraphrase pairs: (text, its paraphrase)."""
    return [(row["a"], row["b"]) for row in map(json.loads, path.read_text().splitlines()) if row]


def text_of_tokens(fingerprinter, num_tokens: int, offset: int) -> str:
    """A text of the paraphrase set's words, `num_tokens` tokens long for the fingerprint model."""
    words = " ".join(a + " " + b for a, b in load_pairs()).split()
    ids = fingerprinter.embedder.encode([" ".join(words[offset:] + words[:offset])])[0][:num_tokens]
    return fingerprinter.embedder.tokenizer.decode(ids)


def cpu_per_request_ms(fingerprinter, requests: list[tuple[str, str]], per_call: int) -> float:
    """Process CPU ms per request, fingerprinting `requests` `per_call` requests at a time."""
    started = time.process_time()
    for start in range(0, len(requests), per_call):
        fingerprinter.simhash([text for request in requests[start : start + per_call] for text in request])
    return (time.process_time() - started) * 1000 / len(requests)


def recall(records: list[str], asked: list[str], max_distance: int) -> tuple[int, int]:
    """(hits, false matches) of the auditor's lookup: record i's prompt has SimHash records[i]; the
    i-th asked text has SimHash asked[i] and is not in the ledger (no exact match)."""
    from schemas.fingerprint import key_id, keyed_hmac
    from schemas.messages import AuditEvent
    from services.auditor.ledger import Ledger
    from services.auditor.lookup import lookup

    key = b"bench-fingerprints-key"
    hits = false = 0
    with tempfile.TemporaryDirectory() as scratch:
        ledger = Ledger(Path(scratch) / "audit.sqlite", checkpoint_key=b"bench-checkpoint-key-0123")
        for i, simhash in enumerate(records):
            ledger.append(
                AuditEvent(
                    event_id=f"ev-{i}",
                    request_id=f"req-{i}",
                    model="m",
                    model_version="m@1",
                    weights_sha256="ab" * 32,
                    principal="p",
                    tenant="default",
                    prompt_hmac=keyed_hmac(key, f"record {i}"),
                    output_hmac=keyed_hmac(key, f"output {i}"),
                    hmac_key_id=key_id(key),
                    temperature=0.0,
                    top_p=1.0,
                    top_k=0,
                    max_tokens=16,
                    seed=i,
                    prompt_tokens=1,
                    completion_tokens=1,
                    finish_reason="stop",
                    worker_id="w",
                    request_created_ms=1,
                    received_ms=1,
                    first_token_ms=None,
                    finished_ms=2,
                    prompt_simhash=simhash,
                ),
                0,
                i,
            )
        for i, simhash in enumerate(asked):
            found = {
                m.request_id for m in lookup(ledger, key, f"asked {i}", simhash=simhash, max_distance=max_distance)
            }
            hits += f"req-{i}" in found
            false += len(found - {f"req-{i}"})
        ledger.close()
    return hits, false


def main(argv: list[str] | None = None) -> int:
    from schemas.fingerprint import hamming_distance
    from schemas.model_repo import load_model_repo
    from services.auditor.lookup import DEFAULT_MAX_DISTANCE
    from weir.embedding.fingerprints import PRECISIONS, TextFingerprinter, build_fingerprinter

    parser = argparse.ArgumentParser(
        prog="weir bench fingerprints", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--tokens", type=int, default=200, help="tokens of each request's prompt and of its output")
    parser.add_argument("--requests", type=int, default=16, help="requests fingerprinted per round and precision")
    parser.add_argument("--batch", type=int, default=8, help="requests per call in the batched runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-distance", type=int, default=DEFAULT_MAX_DISTANCE, help="the lookup's distance")
    args = parser.parse_args(argv)
    repo = load_model_repo(args.model_repo)
    fingerprinters: dict[str, TextFingerprinter] = {}
    for precision in PRECISIONS:
        fp = build_fingerprinter(args.model, repo, precision=precision)
        if fp is None or fp.precision != precision:
            print(f"the {precision} fingerprinter did not load (see the log line above)")
            return 1
        fingerprinters[precision] = fp
    some = fingerprinters["float32"]
    requests = [
        (text_of_tokens(some, args.tokens, 7 * i), text_of_tokens(some, args.tokens, 7 * i + 3000))
        for i in range(args.requests)
    ]
    for fp in fingerprinters.values():  # warm-up: first-call allocations
        cpu_per_request_ms(fp, requests[:2], 1)
    cpu: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = list(PRECISIONS) if r % 2 == 0 else list(reversed(PRECISIONS))
        for precision in order:
            for per_call in (1, args.batch):
                cpu.setdefault((precision, per_call), []).append(
                    cpu_per_request_ms(fingerprinters[precision], requests, per_call)
                )
    print(
        f"Fingerprint CPU per request ({args.tokens}-token prompt + {args.tokens}-token output), one onnxruntime "
        f"thread, {args.requests} requests x {args.rounds} rounds, float32 and int8 alternating:"
    )
    rows = []
    for per_call in (1, args.batch):
        base = statistics.median(cpu[("float32", per_call)])
        for precision in ("float32", "int8"):
            each = cpu[(precision, per_call)]
            med = statistics.median(each)
            rows.append(
                [precision, str(per_call), f"{med:.1f}", f"{min(each):.1f}-{max(each):.1f}", f"{med / base:.2f}x"]
            )
    print_table(rows, ["precision", "requests per call", "CPU ms/request (median)", "range", "vs float32"])

    pairs = load_pairs()
    texts = [t for pair in pairs for t in pair]
    hashes = {p: fp.simhash(texts) for p, fp in fingerprinters.items()}
    bits = sorted(hamming_distance(a, b) for a, b in zip(hashes["float32"], hashes["int8"], strict=True))
    pair_bits = {
        p: sorted(hamming_distance(h[2 * i], h[2 * i + 1]) for i in range(len(pairs))) for p, h in hashes.items()
    }
    print(
        f"\nSimHash bits of 64 that differ, int8 vs float32, over the {len(texts)} texts of {PARAPHRASES.name}: "
        f"mean {statistics.mean(bits):.2f}, median {statistics.median(bits)}, max {bits[-1]}; "
        f"{sum(b == 0 for b in bits)} texts identical"
    )
    for p in ("float32", "int8"):
        d = pair_bits[p]
        print(f"  bits between a text and its paraphrase, {p:7}: median {statistics.median(d)}, max {d[-1]}")
    print(f"\nParaphrase recall of `weir audit lookup` (max distance {args.max_distance}) on {len(pairs)} pairs:")
    rows = []
    for label, rec, ask in (
        ("float32 records, float32 asked (before)", "float32", "float32"),
        ("int8 records, int8 asked (after)", "int8", "int8"),
        ("float32 records, int8 asked (old ledger)", "float32", "int8"),
    ):
        hits, false = recall(hashes[rec][0::2], hashes[ask][1::2], args.max_distance)
        rows.append([label, f"{hits}/{len(pairs)}", f"{hits / len(pairs):.0%}", str(false)])
    print_table(rows, ["records / asked", "found", "recall", "false matches"])
    print("target (issue 31): <= 50 ms CPU per request; recall no worse than float32's")
    return 0
