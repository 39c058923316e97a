"""`weir bench ...`: benchmarks that print tables of figures measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "pipeline": ("weir.bench.pipeline", "in-process engine vs gateway -> Kafka -> batcher -> worker -> gateway"),
    "engine": ("weir.bench.engine", "Weir's engine vs transformers generate(), one at a time and static batches"),
    "batcher": ("weir.bench.batcher", "interactive TTFT during a bulk job, fifo vs lanes; batch fill; job throughput"),
    "gateway": ("weir.bench.gateway", "gateway's added latency and streams held vs a bare uvicorn SSE endpoint"),
    "audit": ("weir.bench.audit", "auditor ingestion rate, fingerprint cost vs generation time, watermark z and perplexity"),
    "hop": ("weir.bench.hop", "one Kafka hop between two processes, split at the sockets, beside loopback TCP"),
    "injection": ("weir.bench.injection", "prompt-injection detector latency: wall and thread CPU p50/p95/p99/max by length"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench", description="Weir benchmarks.")
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(BENCHES[args.name][0])
    return module.main(rest)
