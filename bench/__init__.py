"""Weir's benchmarks: `python -m bench NAME ...` (or `weir bench NAME ...`, which runs it).

Each bench prints tables of figures measured side by side in one run; docs/benchmarks.md has the
latest figures and the command behind each. This package is the top floor: it may import
services/, weir/, schemas/ and kernels/, and none of those imports it.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "pipeline": ("bench.pipeline", "in-process engine vs gateway -> Kafka -> batcher -> worker -> gateway"),
    "engine": ("bench.engine", "Weir's engine vs transformers generate(), one at a time and static batches"),
    "engine-step": (
        "bench.engine_step",
        "one decode step at batch c: CPU time and its shares, or an older engine's side by side",
    ),
    "batcher": ("bench.batcher", "interactive TTFT during a bulk job, fifo vs lanes; batch fill; job throughput"),
    "gateway": ("bench.gateway", "gateway's added latency and streams held vs a bare uvicorn SSE endpoint"),
    "audit": ("bench.audit", "auditor ingestion rate, fingerprint cost vs generation time, watermark z and perplexity"),
    "fingerprints": (
        "bench.fingerprints",
        "audit fingerprints int8 vs float32: CPU per request, SimHash bits moved, lookup recall",
    ),
    "path": (
        "bench.path",
        "the Kafka path's own CPU per delivered token, per process, echo model paced; beside a baseline commit",
    ),
    "startup": ("bench.startup", "`weir up` start after start: seconds until ready, and when each phase ended"),
    "hop": ("bench.kafka_hop", "one Kafka hop between two processes, split at the sockets, beside loopback TCP"),
    "injection": (
        "bench.injection",
        "prompt-injection detector latency: wall and thread CPU p50/p95/p99/max by length",
    ),
    "guards": (
        "bench.guards",
        (
            "input/output guards on the multilingual set (tests/data/guards): detection and "
            "false positives per language, beside an older commit"
        ),
    ),
    "qlinear": (
        "bench.qlinear",
        "CPU quantized linear candidates (int8/int4 kernels, torch, onnxruntime) at SmolLM2 shapes",
    ),
    "kernels": ("bench.triton_kernels", "CUDA: each Triton kernel against its PyTorch reference, timed and checked"),
    "failover": (
        "bench.failover",
        "a worker killed -9 under 20 seeded streams: ended once, differing, stall p50/p95/max, restart in place",
    ),
    "swap": (
        "bench.swap",
        "a new model version pushed, loaded and promoted while 32 streams run: failures, TTFT, time to serve",
    ),
    "traffic": (
        "bench.traffic",
        "live TTFT with a 100% mirror on vs off, mirror copies completed, canary share of 2,000 users",
    ),
    "tracing": (
        "bench.tracing",
        "tokens/s at concurrency 16 with trace sampling 0 vs 1, alternating rounds: what tracing costs",
    ),
    "gpu-llama": (
        "bench.gpu_llama",
        "CUDA: the engine on a 1B-class Llama, batch-1 vs bandwidth bound, batch 64 vs HF",
    ),
    "chaos": (
        "bench.chaos",
        "kill -9 workers, the batcher, a gateway, a broker under 1,000 streams: lost, duplicated, "
        "differing from a seeded rerun, stall per fault (also `weir chaos`)",
    ),
    "grammar-libs": (
        "bench.grammar_libs",
        "xgrammar vs llguidance vs outlines-core per vocabulary: compile cold/cached, mask fill",
    ),
}


def main(argv: list[str] | None = None) -> int:
    listing = "\n".join(f"  {name:10} {text}" for name, (_module, text) in BENCHES.items())
    parser = argparse.ArgumentParser(
        prog="weir bench",
        description="Weir benchmarks.",
        epilog="benchmarks:\n" + listing,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(BENCHES[args.name][0])
    return module.main(rest)
