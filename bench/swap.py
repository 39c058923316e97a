"""`weir bench swap`: a new model version pushed, loaded and promoted while 32 streams run.

The services run here as processes on a private topic prefix (auditor, worker, batcher, gateway),
seeded with version 1 of the model (a copy of its directory). Closed-loop clients keep
`--concurrency` streams in flight through the gateway's SSE API for the whole run, asking for the
bare name. After `--before-s` seconds the bench pushes version 2 (`weir models push`: pack,
verify, record goldens, register), waits until a worker reports it ready, promotes it
(`weir models promote`), and waits until version 1 has drained and left every heartbeat; then the
clients run `--after-s` seconds more.

Every request is classified by when it started: before the push, during (push to version 1
gone), after. It prints the requests that failed (anything but a complete stream: target 0), the
requests each version served (each stream's `model` names the exact version), TTFT p50/p95 in
each phase with the ratio during/before (target p95 <= 2x), and the time from the push to the
first request served by version 2. `--rounds` repeats the whole swap on fresh topics (v1 -> v2
each time) and reports the median and spread of the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench.sse_client import SseConnection
from bench.stats import percentile, print_table
from schemas.codec import decode
from schemas.messages import WorkerHeartbeat
from schemas.topics import Topics

PROMPTS = [
    "def main():\n",
    "import os\n",
    "class Parser:\n",
    "for key, value in ",
    "try:\n    import ",
    "with open(",
    "async def fetch(",
    "    for i in range(",
]


@dataclass
class Outcome:
    """One client request: when it started, its TTFT, the version that served it, or its failure."""

    started: float
    ttft_ms: float | None = None
    version: str | None = None
    error: str | None = None


@dataclass
class Swap:
    """The marks of one swap (perf_counter seconds) and the requests run around it."""

    outcomes: list[Outcome] = field(default_factory=list)
    push_at: float = 0.0
    ready_at: float = 0.0
    promoted_at: float = 0.0
    drained_at: float = 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench swap", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="weir-tiny-py", help="model entry of --model-repo to swap (default %(default)s)"
    )
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--before-s", type=float, default=20.0)
    parser.add_argument("--after-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1, help="swaps, each on fresh topics (default %(default)s)")
    args = parser.parse_args(argv)
    swaps = asyncio.run(_rounds(args))
    _report(swaps, args)
    return 0


async def _rounds(args) -> list[Swap]:
    from schemas.model_repo import load_model_repo
    from weir.kafka import launcher
    from weir.kafka.admin import delete_prefixed_topics

    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    config = load_model_repo(args.model_repo).models[args.model]
    swaps = []
    for r in range(args.rounds):
        scratch = Path(tempfile.mkdtemp(prefix="weir-bench-swap-"))
        topics = Topics(f"benchswap{uuid.uuid4().hex[:6]}")
        try:
            swaps.append(await _one_swap(args, config, broker.bootstrap, topics, scratch))
        finally:
            await delete_prefixed_topics(broker.bootstrap, topics.prefix)
            shutil.rmtree(scratch, ignore_errors=True)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    return swaps


def _model_dirs(config, scratch: Path) -> tuple[Path, Path, Path]:
    """Two copies of the model's directory (v1, v2: same weights, distinct versions) and a models.toml
    serving v1 from the first."""
    assert config.path is not None, f"{config.name}: the swap bench needs a model with a directory"
    v1, v2 = scratch / "v1", scratch / "v2"
    shutil.copytree(config.path, v1)
    shutil.copytree(config.path, v2)
    repo = scratch / "models.toml"
    repo.write_text(
        f'[models.{config.name}]\npath = "{v1}"\nengine = "{config.engine}"\nversion = "1"\n'
        f"max_model_len = {config.max_model_len}\nmax_num_seqs = {config.max_num_seqs}\n"
        f"max_batch_size = {config.max_batch_size}\nmax_wait_ms = {config.max_wait_ms}\n"
    )
    return v1, v2, repo


async def _one_swap(args, config, bootstrap: str, topics: Topics, scratch: Path) -> Swap:
    from weir.stack import Stack, free_ports, wait_http_ok

    _v1, v2, repo = _model_dirs(config, scratch)
    env = {
        "WEIR_KAFKA_BOOTSTRAP": bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(repo),
        "WEIR_AUTH_MODE": "open",
        "WEIR_AUDIT_DB": str(scratch / "audit.sqlite"),
        "WEIR_AUDIT_API_PORT": "0",
        "WEIR_AUDIT_FINGERPRINT_MODEL": "",
        "WEIR_HOME": str(scratch / "home"),
    }
    stack = Stack(env, scratch / "logs")
    port = free_ports(1)[0]
    swap = Swap()
    try:
        for name in ("auditor", "worker", "batcher"):
            stack.start(name)
        stack.start("gateway", extra_env={"WEIR_GATEWAY_PORT": str(port)})
        for name in ("worker", "batcher", "gateway"):
            await asyncio.to_thread(wait_http_ok, f"{stack.url(name)}/readyz", 300, stack)
        stop = asyncio.Event()
        clients = [
            asyncio.create_task(_lane(port, config.name, i, args.max_tokens, stop, swap))
            for i in range(args.concurrency)
        ]
        await asyncio.sleep(args.before_s)
        await _swap(config.name, v2, repo, bootstrap, topics, swap, {**os.environ, **env})
        await asyncio.sleep(args.after_s)
        stop.set()
        await asyncio.gather(*clients)
    finally:
        stack.stop_all()
    return swap


async def _swap(name: str, v2: Path, repo: Path, bootstrap: str, topics: Topics, swap: Swap, env: dict) -> None:
    """Push v2, wait until a worker has it ready, promote it, wait until v1 left every heartbeat."""
    cli = [sys.executable, "-m", "weir.cli", "models"]
    where = ["--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
    swap.push_at = time.perf_counter()
    await _run([*cli, "push", str(v2), "--name", name, "--version", "2", "--from-toml", str(repo), *where], env)
    await _until_heartbeats(
        bootstrap,
        topics,
        lambda hbs: any((s := hb.versions.get(f"{name}@2")) is not None and s.state == "ready" for hb in hbs),
    )
    swap.ready_at = time.perf_counter()
    await _run([*cli, "promote", f"{name}@2", *where], env)
    swap.promoted_at = time.perf_counter()
    await _until_heartbeats(bootstrap, topics, lambda hbs: hbs and all(f"{name}@1" not in hb.versions for hb in hbs))
    swap.drained_at = time.perf_counter()


async def _run(command: list[str], env: dict) -> None:
    proc = await asyncio.create_subprocess_exec(*command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:5])} failed ({proc.returncode}):\n{out.decode(errors='replace')}")


async def _until_heartbeats(bootstrap: str, topics: Topics, done, timeout_s: float = 300) -> None:
    """Follow the workers topic until `done(latest heartbeat of every worker)` holds."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    latest: dict[str, WorkerHeartbeat] = {}
    deadline = time.monotonic() + timeout_s
    try:
        tp = TopicPartition(topics.workers, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    if record.value is None:
                        latest.pop(record.key.decode(), None)
                        continue
                    hb = decode(WorkerHeartbeat, record.value)
                    latest[hb.worker_id] = hb
            live = [hb for hb in latest.values() if time.time() * 1000 - hb.sent_ms < 10_000]
            if done(live):
                return
        raise TimeoutError(f"heartbeats never reached the state the swap waits for within {timeout_s} s")
    finally:
        await consumer.stop()


async def _lane(port: int, name: str, lane: int, max_tokens: int, stop: asyncio.Event, swap: Swap) -> None:
    connection = SseConnection("127.0.0.1", port)
    i = 0
    try:
        while not stop.is_set():
            body = {
                "model": name,
                "prompt": PROMPTS[(lane + i) % len(PROMPTS)],
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "seed": lane * 100_000 + i,
                "stream": True,
            }
            i += 1
            outcome = Outcome(time.perf_counter())
            swap.outcomes.append(outcome)
            connection = await stream_once(connection, port, body, outcome)
    finally:
        await connection.close()


async def stream_once(connection: SseConnection, port: int, body: dict, outcome: Outcome) -> SseConnection:
    """One streamed completion into `outcome` (TTFT, the version that served it, or its failure);
    returns the connection to go on with (a fresh one after a refused or cut connection)."""
    finished = False
    try:
        async for data in connection.post_events("/v1/completions", orjson.dumps(body)):
            if data == b"[DONE]" or data == "[DONE]":
                finished = True
                continue
            chunk = orjson.loads(data)
            if "error" in chunk:
                outcome.error = str(chunk["error"].get("message"))[:200]
                continue
            outcome.version = outcome.version or chunk.get("model")
            if outcome.ttft_ms is None and any(c.get("text") for c in chunk.get("choices", [])):
                outcome.ttft_ms = (time.perf_counter() - outcome.started) * 1000
        if not finished and outcome.error is None:
            outcome.error = "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - a refused or cut connection is a failed request: counted, not raised
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
        await connection.close()
        connection = SseConnection("127.0.0.1", port)
    return connection


def _phase(swap: Swap, o: Outcome) -> str:
    if o.started < swap.push_at:
        return "before"
    return "during" if o.started < swap.drained_at else "after"


def _report(swaps: list[Swap], args) -> None:
    rows, ratios = [], []
    for n, swap in enumerate(swaps, 1):
        done = [o for o in swap.outcomes if o.error is not None or o.version is not None]
        failed = [o for o in done if o.error is not None]
        ttft = {
            p: [o.ttft_ms for o in done if _phase(swap, o) == p and o.ttft_ms is not None]
            for p in ("before", "during", "after")
        }
        by_version: dict[str, int] = {}
        for o in done:
            if o.error is None:
                by_version[o.version or "?"] = by_version.get(o.version or "?", 0) + 1
        first_v2 = min(
            (
                o.started + o.ttft_ms / 1000
                for o in done
                if o.version and o.version.endswith("@2") and o.ttft_ms is not None
            ),
            default=float("nan"),
        )
        ratio = percentile(ttft["during"], 95) / percentile(ttft["before"], 95)
        ratios.append(ratio)
        rows.append(
            [
                str(n),
                str(len(done)),
                str(len(failed)),
                ", ".join(f"{v}: {c}" for v, c in sorted(by_version.items())),
                *(
                    f"{percentile(ttft[p], 50):.0f}/{percentile(ttft[p], 95):.0f}"
                    for p in ("before", "during", "after")
                ),
                f"{ratio:.2f}x",
                f"{first_v2 - swap.push_at:.1f}",
                f"{swap.ready_at - swap.push_at:.1f}",
                f"{swap.drained_at - swap.promoted_at:.1f}",
            ]
        )
        for o in failed[:5]:
            print(f"  failed request (round {n}): {o.error}")
    print(
        f"\nweir bench swap: {args.model}, {args.concurrency} streams, max_tokens {args.max_tokens}, "
        f"{args.before_s:.0f} s before the push, {args.after_s:.0f} s after version 1 drained"
    )
    print_table(
        rows,
        [
            "round",
            "requests",
            "failed",
            "served by",
            "TTFT ms p50/p95 before",
            "during",
            "after",
            "p95 during/before",
            "push->first v2 s",
            "push->v2 ready s",
            "promote->v1 gone s",
        ],
    )
    if len(ratios) > 1:
        print(
            f"p95 during/before: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x "
            f"over {len(ratios)} rounds (target <= 2x)"
        )
