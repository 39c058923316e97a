"""`weir bench batcher`: what the batcher's lanes give an interactive user during a bulk job (issue 5).

For each lane_policy, fifo (one queue in arrival order: what a plain Kafka consumer gives) and
strict (interactive first), a deployment (worker, batcher, gateway as processes on a private
topic prefix and a fresh port) serves the model from a generated models.toml that differs only
in lane_policy, and runs:

(1) job: --bulk requests sent through the gateway with `X-Weir-Priority: bulk`, all at once,
    while interactive requests arrive at --rate per second until the job ends (TTFT of each);
(2) the same --bulk requests sent as interactive, closed loop at --concurrency.

Batch fill is counted exactly from the Batch records on the model's batch topic (each lists its
requests), between offsets taken before and after each phase.

The lanes can only reorder what the batcher still holds. A worker advertises its free KV cache as
room, and the batcher sends no more than that room, so the worker's KV cache is sized here
(--kv-mib) to bind, as GPU memory does in production; with the CPU default (256 MiB, 65k tokens of
this model) the whole job goes to Kafka at once and both policies queue it in the same order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.pipeline import PROMPTS, _one_http, run_http, workload
from bench.stats import RunResult, percentile, print_table
from schemas.codec import decode
from schemas.messages import Batch
from schemas.model_repo import ModelConfig, load_model_repo
from schemas.topics import BATCH_PARTITIONS, Topics
from services.batcher.planner import cost_tokens

POLICIES = ("fifo", "strict")
PRIORITY_HEADER = "x-weir-priority"  # the gateway's lane header (HTTP API; services/gateway/guard/gate.py)


@dataclass
class JobResult:
    """Phase (1): the bulk job and the interactive requests that arrived during it."""

    wall_s: float
    num_tokens: int
    interactive_ttft_ms: list[float]


@dataclass
class BatchFill:
    """Batch records of one phase: how full they were."""

    num_batches: int
    num_requests: int
    num_tokens: int  # the batcher's cost estimates (prompt / 4 + max_tokens), summed

    def per_batch(self) -> float:
        return self.num_requests / self.num_batches if self.num_batches else float("nan")


@dataclass
class PolicyResult:
    """Everything one deployment measured."""

    job: JobResult
    closed: RunResult  # phase (2): the same requests as interactive, closed loop
    job_fill: BatchFill
    closed_fill: BatchFill


def write_repo(config: ModelConfig, lane_policy: str, max_batch_size: int, max_wait_ms: int, path: Path) -> ModelConfig:
    """A one-model repository TOML at `path`: `config` with the lane policy and batch bounds set."""
    entry = config.model_copy(
        update={"lane_policy": lane_policy, "max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms}
    )
    fields = entry.model_dump(mode="json", exclude={"name", "tenant_weights"}, exclude_none=True)
    lines = [f"[models.{json.dumps(entry.name)}]"] + [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    path.write_text("\n".join(lines) + "\n")
    return entry


@asynccontextmanager
async def deployment(repo_path: Path, model: str, env: dict[str, str]) -> AsyncIterator[tuple[str, Topics, str]]:
    """Worker, batcher and gateway on a fresh topic prefix; yields (base URL, topics, bootstrap)."""
    from weir.kafka import launcher
    from weir.kafka.admin import deployment_specs, ensure_topics
    from weir.stack import Stack, free_ports, wait_http_ok

    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    topics = Topics(f"benchb{uuid.uuid4().hex[:6]}")
    await ensure_topics(broker.bootstrap, deployment_specs(topics, load_model_repo(repo_path)))
    (port,) = free_ports(1)
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-batcher-"))
    env = {
        "WEIR_KAFKA_BOOTSTRAP": broker.bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_GATEWAY_PORT": str(port),
        "WEIR_MODEL_REPO": str(repo_path),
        "WEIR_MODELS": model,
        "WEIR_AUTH_MODE": "open",
        "WEIR_AUDIT_FINGERPRINT_MODEL": "",
        **env,
    }
    stack = Stack(env, scratch)
    try:
        for name in ("worker", "batcher", "gateway"):  # no auditor: its CPU is not the batcher's
            stack.start(name)
        base = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_http_ok, f"{base}/readyz", 300, stack)
        yield base, topics, broker.bootstrap
    finally:
        stack.stop_all()


async def run_job(base: str, model: str, num_bulk: int, rate_per_s: float, max_tokens: int) -> JobResult:
    """Phase (1): num_bulk bulk requests at once; interactive ones at rate_per_s until they end."""
    ttft: list[float] = []
    limits = httpx.Limits(max_connections=num_bulk + 64)
    async with (
        httpx.AsyncClient(base_url=base, timeout=600, limits=limits, headers={PRIORITY_HEADER: "bulk"}) as bulk,
        httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as interactive,
    ):
        start = time.perf_counter()
        job = asyncio.gather(*(_one_http(bulk, model, p, seed, max_tokens, [], []) for p, seed in workload(num_bulk)))
        users: list[asyncio.Task[int]] = []
        while not job.done():
            prompt = PROMPTS[len(users) % len(PROMPTS)]
            users.append(
                asyncio.create_task(_one_http(interactive, model, prompt, 5000 + len(users), max_tokens, ttft, []))
            )
            await asyncio.wait([job], timeout=1 / rate_per_s)
        num_tokens = sum(await job)
        wall_s = time.perf_counter() - start
        await asyncio.gather(*users)
    return JobResult(wall_s, num_tokens, ttft)


class BatchReader:
    """Reads a model's batch topic (no group) to count what the batcher put in each Batch."""

    def __init__(self, bootstrap: str, topic: str, config: ModelConfig) -> None:
        self.config = config
        self.parts = [TopicPartition(topic, p) for p in range(BATCH_PARTITIONS)]
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed"
        )

    async def start(self) -> None:
        await self.consumer.start()
        self.consumer.assign(self.parts)

    async def stop(self) -> None:
        await self.consumer.stop()

    async def mark(self) -> dict[int, int]:
        """The next offset of each partition: a phase's batches lie between two marks."""
        return {tp.partition: offset for tp, offset in (await self.consumer.end_offsets(self.parts)).items()}

    async def count(self, start: dict[int, int], end: dict[int, int]) -> BatchFill:
        """Count the Batch records between two marks and what they held."""
        fill = BatchFill(0, 0, 0)
        for tp in self.parts:
            self.consumer.seek(tp, start[tp.partition])
        while [tp for tp in self.parts if await self.consumer.position(tp) < end[tp.partition]]:
            for tp, records in (await self.consumer.getmany(timeout_ms=1000)).items():
                for record in records:
                    if record.offset >= end[tp.partition]:
                        continue
                    batch = decode(Batch, record.value)
                    fill.num_batches += 1
                    fill.num_requests += len(batch.requests)
                    fill.num_tokens += sum(cost_tokens(r, self.config) for r in batch.requests)
        return fill


async def run_policy(args: argparse.Namespace, config: ModelConfig, policy: str) -> PolicyResult:
    """One deployment with `policy`: warm up, phase (1), phase (2), with the batches of each."""
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-repo-"))
    entry = write_repo(config, policy, args.max_batch_size, args.max_wait_ms, scratch / "models.toml")
    env = {
        "WEIR_KV_CACHE_BYTES": str(args.kv_mib << 20),
        "WEIR_HEARTBEAT_INTERVAL_MS": str(args.heartbeat_ms),
        "WEIR_MAX_IN_FLIGHT_BULK": str(args.bulk + 16),
    }
    async with deployment(scratch / "models.toml", config.name, env) as (base, topics, bootstrap):
        reader = BatchReader(bootstrap, topics.batches(config.name), entry)
        await reader.start()
        try:
            await run_http(base, config.name, 4, 8, args.max_tokens)  # warm the path
            before = await reader.mark()
            job = await run_job(base, config.name, args.bulk, args.rate, args.max_tokens)
            between = await reader.mark()
            closed = await run_http(base, config.name, args.concurrency, args.bulk, args.max_tokens)
            after = await reader.mark()
            job_fill = await reader.count(before, between)
            closed_fill = await reader.count(between, after)
        finally:
            await reader.stop()
    print(
        f"{policy}: job {job.wall_s:.1f} s, {len(job.interactive_ttft_ms)} interactive during it; "
        f"interactive closed loop {closed.wall_s:.1f} s",
        flush=True,
    )
    return PolicyResult(job, closed, job_fill, closed_fill)


def main(argv: list[str] | None = None) -> int:
    """Run both policies one after the other and print the table."""
    parser = argparse.ArgumentParser(
        prog="weir bench batcher", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="weir-tiny-py")
    parser.add_argument("--model-repo", default="models.toml", help="where the model's entry is taken from")
    parser.add_argument("--bulk", type=int, default=200, help="requests in the bulk job")
    parser.add_argument("--rate", type=float, default=4.0, help="interactive requests per second during the job")
    parser.add_argument("--concurrency", type=int, default=16, help="closed loop of phase (2)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-wait-ms", type=int, default=20)
    parser.add_argument("--kv-mib", type=int, default=4, help="worker KV cache (MiB): the room the batcher sees")
    parser.add_argument("--heartbeat-ms", type=int, default=250, help="worker heartbeats: when freed room is seen")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args(argv)
    config = load_model_repo(args.model_repo).models[args.model]
    policies = args.policies.split(",")
    results = {policy: asyncio.run(run_policy(args, config, policy)) for policy in policies}
    _report(results, args)
    return 0


def _report(results: dict[str, PolicyResult], args: argparse.Namespace) -> None:
    policies = list(results)

    def row(label: str, fmt: str, value: Callable[[PolicyResult], float]) -> list[str]:
        values = [value(results[p]) for p in policies]
        ratio = values[0] / values[-1] if len(values) > 1 and values[-1] else float("nan")
        return [label, *(format(v, fmt) for v in values), f"{ratio:.2f}"]

    def fill(f: BatchFill) -> float:
        return f.per_batch() / args.max_batch_size

    rows = [
        row("interactive TTFT p50 ms, during job", ".0f", lambda r: percentile(r.job.interactive_ttft_ms, 50)),
        row("interactive TTFT p95 ms, during job", ".0f", lambda r: percentile(r.job.interactive_ttft_ms, 95)),
        row("interactive requests during job", "d", lambda r: len(r.job.interactive_ttft_ms)),
        row("job wall s", ".1f", lambda r: r.job.wall_s),
        row("job req/s", ".1f", lambda r: args.bulk / r.job.wall_s),
        row("job tokens/s", ".0f", lambda r: r.job.num_tokens / r.job.wall_s),
        row("job batches", "d", lambda r: r.job_fill.num_batches),
        row("job requests/batch", ".1f", lambda r: r.job_fill.per_batch()),
        row("job batch fill (of max_batch_size)", ".2f", lambda r: fill(r.job_fill)),
        row("job est. tokens/batch", ".0f", lambda r: r.job_fill.num_tokens / max(1, r.job_fill.num_batches)),
        row(f"same reqs interactive c={args.concurrency}: wall s", ".1f", lambda r: r.closed.wall_s),
        row("same reqs interactive: req/s", ".1f", lambda r: args.bulk / r.closed.wall_s),
        row("same reqs interactive: tokens/s", ".0f", lambda r: r.closed.tokens_per_s),
        row("same reqs interactive: requests/batch", ".1f", lambda r: r.closed_fill.per_batch()),
        row("same reqs interactive: batch fill", ".2f", lambda r: fill(r.closed_fill)),
        row("job req/s / interactive req/s", ".2f", lambda r: r.closed.wall_s / r.job.wall_s),
    ]
    print()
    print_table(rows, ["figure", *policies, "/".join(policies)])
    print()
    print(
        f"{args.bulk} bulk + interactive at {args.rate}/s, max_tokens {args.max_tokens}; max_batch_size "
        f"{args.max_batch_size}, max_wait_ms {args.max_wait_ms}; worker KV {args.kv_mib} MiB, heartbeat "
        f"{args.heartbeat_ms} ms"
    )
