"""`weir bench pipeline`: what the Kafka path costs against the engine called in-process.

(a) the worker's Engine driven directly in this process;
(b) the same requests over HTTP/SSE through gateway -> Kafka -> batcher -> Kafka -> worker ->
    Kafka -> gateway, with the services started here as processes on a private topic prefix.
Both at each concurrency (closed loop: a new request starts when one ends), same prompts, same
seeds, same max_tokens. Prints time-to-first-token p50/p95, inter-token latency and tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import orjson

from schemas.messages import GenerateRequest, now_ms
from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from weir.bench.stats import RunResult, percentile, print_table

PROMPTS = [
    "def main():\n", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "for key, value in ",
    "    def __repr__(self):\n", "try:\n    import ", "if __name__ == '__main__':\n", "    return self.",
    "def read_file(path):\n", "from collections import ", "    raise ValueError(", "with open(",
    "class Error(Exception):\n", "    @property\n    def ", "async def fetch(", "    for i in range(",
]  # fmt: skip


def workload(n: int) -> list[tuple[str, int]]:
    """n (prompt, seed) pairs, the same for every configuration."""
    return [(PROMPTS[i % len(PROMPTS)], 1000 + i) for i in range(n)]


def run_inprocess(engine, model: str, concurrency: int, n: int, max_tokens: int) -> RunResult:
    """Closed loop over the Engine: keep `concurrency` requests in flight."""
    pending = workload(n)
    pending.reverse()
    submitted: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    num_tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work:
        while pending and len(submitted) < concurrency:
            prompt, seed = pending.pop()
            rid = uuid.uuid4().hex
            req = GenerateRequest(request_id=rid, model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.8,
                                  seed=seed, deadline_ms=now_ms() + 600_000, reply_to="-")  # fmt: skip
            submitted[rid] = time.perf_counter()
            engine.add(req, now_ms())
        outputs = engine.step(now_ms())
        t = time.perf_counter()
        for out in outputs:
            if out.text:
                if out.request_id in last:
                    itl.append((t - last[out.request_id]) * 1000)
                else:
                    ttft.append((t - submitted[out.request_id]) * 1000)
                last[out.request_id] = t
            if out.is_final:
                num_tokens += out.completion_tokens
                submitted.pop(out.request_id, None)
                last.pop(out.request_id, None)
    return RunResult("in-process engine", concurrency, ttft, itl, num_tokens, time.perf_counter() - start)


async def _one_http(client: httpx.AsyncClient, model: str, prompt: str, seed: int, max_tokens: int,
                    ttft: list[float], itl: list[float]) -> int:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    last: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                t = time.perf_counter()
                if last is None:
                    ttft.append((t - start) * 1000)
                else:
                    itl.append((t - last) * 1000)
                last = t
    return tokens


async def run_http(base_url: str, model: str, concurrency: int, n: int, max_tokens: int) -> RunResult:
    """Closed loop over the gateway's SSE API."""
    queue = workload(n)
    queue.reverse()
    ttft: list[float] = []
    itl: list[float] = []
    total = 0
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def lane() -> None:
            nonlocal total
            while queue:
                prompt, seed = queue.pop()
                tokens = await _one_http(client, model, prompt, seed, max_tokens, ttft, itl)
                total += tokens  # not `total += await ...`: that reads total before the await

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return RunResult("gateway->Kafka->worker", concurrency, ttft, itl, total, wall)


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads) so far; 0.0 once it is gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        fields = open(path).read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime (fields 14, 15)


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each named process, and of the worker's event-loop thread (its main thread)."""
    snap = {name: cpu_seconds(pid) for name, pid in pids.items()}
    if "worker" in pids:
        snap["worker loop"] = cpu_seconds(pids["worker"], pids["worker"])
    return snap


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Run both paths at each concurrency and print the table with ratios."""
    parser = argparse.ArgumentParser(prog="weir bench pipeline", description=__doc__)
    parser.add_argument("--model", default="weir-tiny-py")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests-per-lane", type=int, default=6, help="requests = concurrency x this (min 12)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as the worker picks)")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    repo = load_model_repo(args.model_repo)
    config = repo.models[args.model]

    import torch

    from services.worker.hardware import cpu_threads

    torch.set_num_threads(cpu_threads(args.threads))

    from services.worker.app import warm_up
    from services.worker.engine import Engine, EngineConfig

    results: dict[tuple[str, int], RunResult] = {}
    assert config.path is not None, f"{args.model} has no path (the echo model is not benchmarked)"
    engine = Engine(config.path, EngineConfig(max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs))
    warm_up(engine, config)
    print(f"model {args.model} on {engine.device}, torch threads {torch.get_num_threads()}", flush=True)
    for c in levels:
        results[("a", c)] = run_inprocess(engine, args.model, c, max(12, c * args.requests_per_lane), args.max_tokens)
    del engine

    pipeline_results, cpu = asyncio.run(_pipeline_runs(args, levels))
    results.update(pipeline_results)
    _report(results, levels, cpu)
    return 0


async def _pipeline_runs(
    args, levels: list[int]
) -> tuple[dict[tuple[str, int], RunResult], dict[int, dict[str, float]]]:
    """(b) at each level, and the CPU seconds each process used during each level's run."""
    from weir.kafka import launcher
    from weir.kafka.admin import deployment_specs, ensure_topics
    from weir.launcher import Stack, wait_http_ok

    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    topics = Topics(f"bench{uuid.uuid4().hex[:6]}")
    await ensure_topics(broker.bootstrap, deployment_specs(topics, load_model_repo(args.model_repo)))
    port = _free_port()
    env = {"WEIR_KAFKA_BOOTSTRAP": broker.bootstrap, "WEIR_TOPIC_PREFIX": topics.prefix, "WEIR_GATEWAY_PORT": str(port),
           "WEIR_MODEL_REPO": str(Path(args.model_repo).resolve()), "WEIR_MODELS": args.model,
           "WEIR_AUTH_MODE": "open"}  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-"))
    # Audit fingerprints (MiniLM embeddings of every prompt and output) share the worker's CPU;
    # they are measured by `weir bench audit`, and left out here so (b) differs from (a) only by
    # the Kafka path.
    env |= {"WEIR_AUDIT_DB": str(scratch / "audit.sqlite"), "WEIR_AUDIT_API_PORT": "0",
            "WEIR_AUDIT_FINGERPRINT_MODEL": ""}  # fmt: skip
    stack = Stack(env, scratch)
    results = {}
    cpu: dict[int, dict[str, float]] = {}
    try:
        for name in ("auditor", "worker", "batcher", "gateway"):
            stack.start(name)
        base = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_http_ok, f"{base}/readyz", 300, stack)
        await run_http(base, args.model, 2, 4, args.max_tokens)  # warm the path
        pids = {name: proc.pid for name, proc in stack.procs.items()} | {"bench client": os.getpid()}
        if (broker_pid := launcher.running_pid(broker)) is not None:
            pids["broker"] = broker_pid
        for c in levels:
            before = cpu_snapshot(pids)
            result = await run_http(base, args.model, c, max(12, c * args.requests_per_lane), args.max_tokens)
            after = cpu_snapshot(pids)
            results[("b", c)] = result
            cpu[c] = {name: after[name] - before[name] for name in before}
    finally:
        stack.stop_all()
    return results, cpu


def _report(
    results: dict[tuple[str, int], RunResult], levels: list[int], cpu: dict[int, dict[str, float]]
) -> None:
    header = ["path", "conc", "reqs-tokens", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "tokens/s"]
    rows = []
    for c in levels:
        for path in ("a", "b"):
            r = results[(path, c)]
            rows.append([r.label, str(c), f"{len(r.ttft_ms)}-{r.num_tokens}", f"{percentile(r.ttft_ms, 50):.1f}",
                         f"{percentile(r.ttft_ms, 95):.1f}", f"{percentile(r.itl_ms, 50):.1f}",
                         f"{percentile(r.itl_ms, 95):.1f}", f"{r.tokens_per_s:.1f}"])  # fmt: skip
    print()
    print_table(rows, header)
    print()
    for c in levels:
        a, b = results[("a", c)], results[("b", c)]
        added = percentile(b.ttft_ms, 50) - percentile(a.ttft_ms, 50)
        ratio = b.tokens_per_s / a.tokens_per_s if a.tokens_per_s else float("nan")
        print(f"concurrency {c:>3}: Kafka path adds {added:+.1f} ms to p50 TTFT; keeps {ratio:.0%} of in-process tokens/s")
    for c in levels:
        b = results[("b", c)]
        print(f"concurrency {c:>3}: CPU during (b), cores (ms per token): " + ", ".join(
            f"{name} {used / b.wall_s:.2f} ({1000 * used / max(1, b.num_tokens):.2f})" for name, used in cpu[c].items()))
    print("targets: <= +10 ms p50 TTFT at concurrency 1; >= 80% of in-process tokens/s at concurrency 16")
    print("(b) runs without audit fingerprints (see `weir bench audit` for their cost)")
