"""`weir bench path`: what the Kafka path itself costs per streamed token, process by process.

The echo model (services/worker/engine/echo_engine.py) stands for an engine that costs nothing: it
sleeps 1000 / --rate ms a step (WEIR_ECHO_STEP_DELAY_MS), so each stream gets about --rate tokens/s
as from a real model, and its sequence limit (max_num_seqs in a scratch model repository) is raised
to the most --streams. N streams each run one request after another (prompt and max_tokens of
--tokens words: the echo model's tokens are words), their starts spread over one request's length
so the engine's steps are not all first tokens at once. Two clients:

  sse    POST /v1/completions stream=true through the real gateway (one keep-alive connection a stream);
  kafka  a raw Kafka client: GenerateRequests produced straight to the request topic, the replies
         read from its own reply topic (no gateway).

Measured in a window of --duration s that opens once the streams are spread out (one request's
length after the first start): tokens that reached the client in it, and the CPU (user + system,
from /proc) that each process used in it: gateway, worker (with its engine children), batcher,
auditor, and the broker (the broker is the machine's shared one when it runs here: other users'
load lands on it too). The load generator (this process) is apart. Printed per process: CPU us per
delivered token; and delivered vs offered (N x rate) tokens/s, TTFT and inter-token p50/p95 (ms).

With --baseline REV, the same runs on a `git worktree` of REV (made in a scratch directory,
removed at the end) with its own processes started from that tree (its own cwd and PYTHONPATH),
on its own topic prefix, in the same run: rounds alternate this tree and the baseline (AB, BA,
...). Medians over --rounds are printed, with their range, and the ratio this / baseline.

Fingerprints: --fingerprints off,on runs each setting with its own stacks (WEIR_AUDIT_FINGERPRINT_MODEL
empty, or the default all-MiniLM-L6-v2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from bench.pipeline import children_of, cpu_seconds
from bench.sse_client import SseConnection
from bench.stats import percentile, print_table

if TYPE_CHECKING:  # imported where used at run time (a tree's own code may be what runs)
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from schemas.topics import Topics
    from weir.stack import Stack

REPO_ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("gateway", "worker", "batcher", "auditor", "broker")
CLIENTS = ("sse", "kafka")
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]
FINGERPRINT_MODEL = "all-MiniLM-L6-v2"


def prompt_of(i: int, tokens: int) -> str:
    """A prompt of `tokens` words (the echo model streams it back word by word)."""
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(tokens))


@dataclass
class Window:
    """What one run measured in its window."""

    tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)  # what went wrong, e.g. "HttpError 429": how often

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        kind = f"{type(exc).__name__} {getattr(exc, 'status', '')}".strip()
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class Clock:
    """The measurement window: is_open() between `opens` and `closes` (perf_counter seconds)."""

    def __init__(self, opens: float, closes: float) -> None:
        self.opens, self.closes = opens, closes

    def is_open(self, t: float | None = None) -> bool:
        t = time.perf_counter() if t is None else t
        return self.opens <= t < self.closes


class StreamMarks:
    """One request's arrivals: counts tokens, TTFT and gaps that fall inside the window."""

    def __init__(self, clock: Clock, window: Window) -> None:
        self.clock, self.window = clock, window
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        t = time.perf_counter()
        if self.clock.is_open(t):
            self.window.tokens += count
            if self.last is None:
                self.window.ttft_ms.append((t - self.start) * 1000)
            else:
                self.window.itl_ms.append((t - self.last) * 1000)
        self.last = t


# -- the two clients ------------------------------------------------------------------------------


async def sse_lane(host: str, port: int, lane: int, args, clock: Clock, window: Window, stop_at: float) -> None:
    """One stream through the gateway: requests one after another until `stop_at`."""
    connection = SseConnection(host, port)
    i = lane
    try:
        while time.perf_counter() < stop_at:
            body = {"model": "echo", "prompt": prompt_of(i, args.tokens), "max_tokens": args.tokens, "stream": True}
            marks = StreamMarks(clock, window)
            try:
                async for data in connection.post_events("/v1/completions", orjson.dumps(body)):
                    if data == b"[DONE]":
                        continue
                    chunk = orjson.loads(data)
                    # Echo tokens are words: a chunk's tokens are its words (the output guard
                    # releases whole words).
                    marks.tokens(sum(len(c.get("text", "").split()) for c in chunk.get("choices", [])))
            except Exception as exc:  # noqa: BLE001 - counted and shown; the lane goes on
                window.failed(exc)
                await connection.close()
                await asyncio.sleep(0.2)
            i += 1009
    finally:
        await connection.close()


class KafkaClient:
    """A raw Kafka client: GenerateRequests to the request topic, replies from its own reply topic."""

    def __init__(self, bootstrap: str, topics, name: str) -> None:
        self.bootstrap, self.topics = bootstrap, topics
        self.name = name
        self.reply_topic = topics.replies(name)
        self.waiting: dict[str, tuple[StreamMarks, asyncio.Event, list[int]]] = {}
        self.producer: AIOKafkaProducer | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.reader: asyncio.Task | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        from weir.bus import partitions_of
        from weir.kafka.admin import ensure_topics

        await ensure_topics(self.bootstrap, [self.topics.reply_spec(self.name)])
        # Until its metadata names the new reply topic, aiokafka logs an error line per fetch about it.
        logging.getLogger("aiokafka.cluster").setLevel(logging.CRITICAL)
        self.producer = producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=0)
        await producer.start()
        self.consumer = consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, group_id=None
        )
        await consumer.start()
        partitions = [
            TopicPartition(self.reply_topic, p) for p in sorted(await partitions_of(consumer, self.reply_topic))
        ]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)
        self.reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        for client in (self.consumer, self.producer):
            if client is not None:
                await client.stop()

    async def _read(self) -> None:
        assert self.consumer is not None
        while True:
            batches = await self.consumer.getmany(timeout_ms=200, max_records=5000)
            for records in batches.values():
                for record in records:
                    event = orjson.loads(record.value)
                    found = self.waiting.get(event.get("request_id", ""))
                    if found is None:
                        continue
                    marks, done, have = found
                    if event.get("type") == "delta":
                        end = event["seq"] + event.get("count", 1)
                        if end > have[0]:  # positions already held (a regenerated run) are not counted twice
                            marks.tokens(end - max(have[0], event["seq"]))
                            have[0] = end
                    elif event.get("type") == "end":
                        done.set()

    async def one(self, model: str, prompt: str, max_tokens: int, clock: Clock, window: Window) -> None:
        from schemas.messages import GenerateRequest, now_ms

        assert self.producer is not None
        rid = uuid.uuid4().hex
        done = asyncio.Event()
        self.waiting[rid] = (StreamMarks(clock, window), done, [0])
        request = GenerateRequest(
            request_id=rid,
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            deadline_ms=now_ms() + 600_000,
            reply_to=self.reply_topic,
        )
        try:
            await self.producer.send(
                self.topics.requests, request.model_dump_json(exclude_none=True).encode(), key=rid.encode()
            )
            await done.wait()
        finally:
            del self.waiting[rid]


async def kafka_lane(client: KafkaClient, lane: int, args, clock: Clock, window: Window, stop_at: float) -> None:
    i = lane
    while time.perf_counter() < stop_at:
        try:
            await asyncio.wait_for(
                client.one("echo", prompt_of(i, args.tokens), args.tokens, clock, window),
                args.tokens / args.rate * 10 + 60,
            )
        except Exception as exc:  # noqa: BLE001 - counted and shown; the lane goes on
            window.failed(exc)
        i += 1009


# -- the stacks -----------------------------------------------------------------------------------


def model_repo_text(repo_path: Path, max_num_seqs: int, fingerprint_dir: Path) -> str:
    """A scratch model repository: the echo model with `max_num_seqs`, and the fingerprint model
    from `repo_path`'s entry, its export in `fingerprint_dir` (made once, shared by both trees)."""
    entry = tomllib.loads(repo_path.read_text())["models"][FINGERPRINT_MODEL] | {"path": str(fingerprint_dir)}

    def value(v) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)

    lines = [
        "[models.echo]",
        'engine = "echo"',
        'version = "1"',
        "max_batch_size = 32",
        "max_wait_ms = 0",
        "max_model_len = 4096",
        f"max_num_seqs = {max_num_seqs}",
        'warmup = ["hello"]',
        "",
        f"[models.{FINGERPRINT_MODEL}]",
    ] + [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


@dataclass
class TreeStack:
    """One tree's services (its own cwd and PYTHONPATH), on their own topic prefix."""

    label: str
    tree: Path
    stack: Stack
    topics: Topics
    gateway_port: int


async def start_tree(
    label: str, tree: Path, bootstrap: str, repo_file: Path, fingerprints: bool, rate: float, scratch: Path
) -> TreeStack:
    from schemas.model_repo import load_model_repo
    from schemas.topics import Topics
    from weir.kafka.admin import deployment_specs, ensure_topics
    from weir.stack import Stack, free_ports

    topics = Topics(f"bpath{uuid.uuid4().hex[:6]}")
    await ensure_topics(bootstrap, deployment_specs(topics, load_model_repo(repo_file)))
    home = scratch / f"home-{label}"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "WEIR_KAFKA_BOOTSTRAP": bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(repo_file),
        "WEIR_MODELS": "echo",
        "WEIR_AUTH_MODE": "open",
        "WEIR_HOME": str(home),
        "PYTHONPATH": str(tree),
        "WEIR_AUDIT_DB": str(home / "audit.sqlite"),
        "WEIR_AUDIT_API_PORT": "0",
        "WEIR_AUDIT_FINGERPRINT_MODEL": FINGERPRINT_MODEL if fingerprints else "",
        "WEIR_ECHO_STEP_DELAY_MS": str(round(1000 / rate)),
    }
    port = free_ports(1)[0]
    stack = Stack(env, scratch / f"logs-{label}-{'fp' if fingerprints else 'nofp'}")
    with contextlib.chdir(tree):  # `python -m` puts the cwd first on sys.path: the tree's own code runs
        for name in ("auditor", "worker", "batcher"):
            stack.start(name)
        stack.start("gateway", extra_env={"WEIR_GATEWAY_PORT": str(port)})
    return TreeStack(label, tree, stack, topics, port)


async def wait_ready(ts: TreeStack, timeout_s: float) -> None:
    from weir.stack import wait_http_ok

    for name in ("worker", "batcher", "gateway"):
        await asyncio.to_thread(wait_http_ok, f"{ts.stack.url(name)}/readyz", timeout_s, ts.stack)


def process_groups(ts: TreeStack, broker_pid: int | None) -> dict[str, list[int]]:
    procs = ts.stack.procs
    groups = {name: [procs[name].pid] for name in ("gateway", "batcher", "auditor")}
    groups["worker"] = [procs["worker"].pid, *children_of(procs["worker"].pid)]
    groups["broker"] = [broker_pid] if broker_pid is not None else []
    return groups


def find_broker_pid(broker) -> int | None:
    """The broker's pid: the one this $WEIR_HOME's launcher started, else the only Kafka server
    process on this machine (a broker started from another checkout); None when not one."""
    from weir.kafka import launcher

    if (pid := launcher.running_pid(broker)) is not None:
        return pid
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if b"kafka.Kafka" in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found[0] if len(found) == 1 else None


def cpu_now(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


async def run_round(ts: TreeStack, client: str, streams: int, args, bootstrap: str, broker_pid: int | None) -> Window:
    """One measured run: `streams` lanes, starts spread over one request's length, a --duration window."""
    window = Window()
    request_s = args.tokens / args.rate
    begin = time.perf_counter()
    clock = Clock(begin + request_s, begin + request_s + args.duration)
    groups = process_groups(ts, broker_pid)
    kafka = None
    if client == "kafka":
        kafka = KafkaClient(bootstrap, ts.topics, f"benchpath{uuid.uuid4().hex[:6]}")
        await kafka.start()

    async def lane(i: int) -> None:
        await asyncio.sleep(request_s * i / streams)
        if kafka is not None:
            await kafka_lane(kafka, i, args, clock, window, clock.closes)
        else:
            await sse_lane("127.0.0.1", ts.gateway_port, i, args, clock, window, clock.closes)

    async def sample_cpu() -> None:
        await asyncio.sleep(max(0.0, clock.opens - time.perf_counter()))
        before, t0 = cpu_now(groups), time.perf_counter()
        await asyncio.sleep(max(0.0, clock.closes - time.perf_counter()))
        after = cpu_now(groups)
        window.wall_s = time.perf_counter() - t0
        window.cpu_s = {name: after[name] - before[name] for name in groups}

    try:
        lanes = [asyncio.create_task(lane(i)) for i in range(streams)]
        await sample_cpu()
        # Requests begun in the window finish (or give up) before the next run starts.
        await asyncio.wait_for(asyncio.gather(*lanes), request_s * 10 + 120)
    finally:
        if kafka is not None:
            await kafka.stop()
    return window


# -- the report -----------------------------------------------------------------------------------


def figures(w: Window, offered: float) -> dict[str, float]:
    """One run's figures: CPU us per delivered token by process and in total, tokens/s, latencies."""
    tokens = max(1, w.tokens)
    out = {f"{name} us/token": 1e6 * w.cpu_s.get(name, 0.0) / tokens for name in GROUPS}
    out["path us/token"] = sum(out[f"{name} us/token"] for name in GROUPS)
    out |= {
        "delivered tok/s": w.tokens / w.wall_s if w.wall_s else 0.0,
        "offered tok/s": offered,
        "TTFT p50 ms": percentile(w.ttft_ms, 50) if w.ttft_ms else float("nan"),
        "TTFT p95 ms": percentile(w.ttft_ms, 95) if w.ttft_ms else float("nan"),
        "ITL p50 ms": percentile(w.itl_ms, 50) if w.itl_ms else float("nan"),
        "ITL p95 ms": percentile(w.itl_ms, 95) if w.itl_ms else float("nan"),
        "errors": float(w.errors),
    }
    return out


COLUMNS = [f"{name} us/token" for name in GROUPS] + [
    "path us/token",
    "delivered tok/s",
    "offered tok/s",
    "TTFT p50 ms",
    "TTFT p95 ms",
    "ITL p50 ms",
    "ITL p95 ms",
    "errors",
]
HEADER = ["tree", "client", "fingerprints", "streams", "rounds"] + COLUMNS


def table_rows(results: dict[tuple[str, str, str, int], list[dict[str, float]]]) -> list[list[str]]:
    """One row per (tree, client, fingerprints, streams): the median of its rounds, each figure."""
    rows = []
    for (tree, client, fp, streams), runs in results.items():
        row = [tree, client, fp, str(streams), str(len(runs))]
        for column in COLUMNS:
            values = [r[column] for r in runs]
            med = statistics.median(values)
            row.append(f"{med:.0f}" if abs(med) >= 10 or column == "errors" else f"{med:.1f}")
        rows.append(row)
    return rows


def spread_lines(results, labels: list[str]) -> list[str]:
    """Per configuration: path us/token and delivered tokens/s, median and range, this / baseline."""
    lines = []
    keys = sorted({(c, fp, n) for (_t, c, fp, n) in results})
    for client, fp, n in keys:
        parts = []
        per_tree = {}
        for tree in labels:
            runs = results.get((tree, client, fp, n))
            if not runs:
                continue
            cost = [r["path us/token"] for r in runs]
            rate = [r["delivered tok/s"] for r in runs]
            per_tree[tree] = (statistics.median(cost), statistics.median(rate))
            parts.append(
                f"{tree}: {statistics.median(cost):.0f} us/token ({min(cost):.0f}-{max(cost):.0f}), "
                f"{statistics.median(rate):.0f} tok/s ({min(rate):.0f}-{max(rate):.0f})"
            )
        if len(per_tree) == 2:
            (a_cost, a_rate), (b_cost, b_rate) = per_tree[labels[0]], per_tree[labels[1]]
            parts.append(
                f"ratio {labels[0]}/{labels[1]}: CPU {a_cost / b_cost:.2f}x, tokens/s {a_rate / max(b_rate, 1e-9):.2f}x"
            )
        lines.append(f"{client:5} fingerprints {fp:3} {n:>5} streams: " + "; ".join(parts))
    lines += fingerprint_share_lines(results, labels)
    return lines


def fingerprint_share_lines(results, labels: list[str]) -> list[str]:
    """Where both settings ran: the fingerprints' share of the path's CPU per token, taken as the
    worker's us/token with them on minus off (medians of rounds; the worker holds all of it)."""
    lines = []
    for tree in labels:
        for client, n in sorted({(c, n) for (t, c, _fp, n) in results if t == tree}):
            on, off = results.get((tree, client, "on", n)), results.get((tree, client, "off", n))
            if not on or not off:
                continue
            worker_on = statistics.median(r["worker us/token"] for r in on)
            share = worker_on - statistics.median(r["worker us/token"] for r in off)
            path_on = statistics.median(r["path us/token"] for r in on)
            lines.append(
                f"{tree}: {client} {n} streams, fingerprints on: path {path_on:.0f} us/token, of which "
                f"fingerprints ~{share:.0f} us/token ({share / path_on:.0%}; worker on - off)"
            )
    return lines


# -- main -----------------------------------------------------------------------------------------


def add_worktree(rev: str, scratch: Path) -> Path:
    """A detached `git worktree` of `rev` under `scratch` (removed by remove_worktree)."""
    where = scratch / f"baseline-{rev[:12]}"
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(where), rev], check=True, capture_output=True
    )
    return where


def remove_worktree(where: Path) -> None:
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(where)], capture_output=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir bench path", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="64,256,1024", help="comma-separated stream counts")
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream (the echo model's pace)")
    parser.add_argument("--tokens", type=int, default=100, help="prompt words = max_tokens of each request")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of each measured window")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per configuration (trees alternate in each)")
    parser.add_argument("--fingerprints", default="off,on", help="off, on, or both")
    parser.add_argument("--clients", default="sse,kafka", help="sse (through the gateway), kafka (raw), or both")
    parser.add_argument(
        "--baseline", default=None, metavar="REV", help="also run a worktree of this commit, alternating"
    )
    parser.add_argument(
        "--model-repo", default=str(REPO_ROOT / "models.toml"), help="where the fingerprint model's entry is read"
    )
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the services to get ready")
    return parser


def parse_args(argv: list[str] | None):
    args = build_parser().parse_args(argv)
    try:
        args.stream_counts = [int(s) for s in args.streams.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"weir bench path: --streams {args.streams!r} is not a list of numbers") from None
    args.fp_settings = [s.strip() for s in args.fingerprints.split(",") if s.strip()]
    args.client_list = [s.strip() for s in args.clients.split(",") if s.strip()]
    problems = [f"--fingerprints {s!r} (off or on)" for s in args.fp_settings if s not in ("off", "on")]
    problems += [f"--clients {s!r} (sse or kafka)" for s in args.client_list if s not in CLIENTS]
    problems += ["--streams must name counts >= 1" for n in args.stream_counts if n < 1][:1]
    problems += ["--rate, --tokens, --duration, --rounds must be > 0"] * (
        min(args.rate, args.tokens, args.duration, args.rounds) <= 0
    )
    if not args.stream_counts or not args.fp_settings or not args.client_list:
        problems.append("--streams, --fingerprints and --clients each need at least one value")
    if problems:
        raise SystemExit("weir bench path: " + "; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report(run_all_sync(args), args)
    return 0


def run_all_sync(args) -> dict[tuple[str, str, str, int], list[dict[str, float]]]:
    return asyncio.run(run_all(args))


def report(results: dict[tuple[str, str, str, int], list[dict[str, float]]], args) -> None:
    labels = ["this"] + ([f"base {args.baseline}"] if args.baseline else [])
    print(
        f"\nweir bench path: echo model at {args.rate:g} tokens/s per stream, {args.tokens}-token requests, "
        f"{args.duration:g} s windows, medians of {args.rounds} rounds; CPU from /proc per process "
        "(worker with its engine children; broker: this machine's, shared with anything else using it)"
    )
    print_table(table_rows(results), HEADER)
    print()
    for line in spread_lines(results, labels):
        print(line)


async def run_all(args) -> dict[tuple[str, str, str, int], list[dict[str, float]]]:
    from bench.gateway import raise_open_files_limit
    from schemas.model_repo import load_model_repo
    from weir.embedding.onnx_export import default_export_dir, ensure_export
    from weir.kafka import launcher

    # 1,024 SSE streams are 1,024 sockets here and in the gateway (which inherits the limit).
    if raise_open_files_limit() < max(args.stream_counts) + 256:
        print(f"(the open-files limit is below {max(args.stream_counts)} streams' sockets: expect connection errors)")
    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    broker_pid = find_broker_pid(broker)
    if broker_pid is None:
        print("(no broker process found on this machine: its CPU is not counted)", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-path-"))
    trees = {"this": REPO_ROOT}
    if args.baseline:
        trees[f"base {args.baseline}"] = add_worktree(args.baseline, scratch)
    results: dict[tuple[str, str, str, int], list[dict[str, float]]] = {}
    try:
        fingerprint_dir = default_export_dir(FINGERPRINT_MODEL)
        if "on" in args.fp_settings:  # exported once here, shared by both trees' workers and auditors
            fingerprint_dir = ensure_export(load_model_repo(args.model_repo).models[FINGERPRINT_MODEL])
        repo_file = scratch / "models.toml"
        repo_file.write_text(model_repo_text(Path(args.model_repo), max(args.stream_counts) + 16, fingerprint_dir))
        for fp in args.fp_settings:
            stacks = [
                await start_tree(label, tree, broker.bootstrap, repo_file, fp == "on", args.rate, scratch)
                for label, tree in trees.items()
            ]
            try:
                for ts in stacks:
                    await wait_ready(ts, args.start_timeout)
                for streams in args.stream_counts:
                    for client in args.client_list:
                        for r in range(args.rounds):
                            for ts in stacks if r % 2 == 0 else list(reversed(stacks)):
                                window = await run_round(ts, client, streams, args, broker.bootstrap, broker_pid)
                                row = figures(window, streams * args.rate)
                                results.setdefault((ts.label, client, fp, streams), []).append(row)
                                print(
                                    f"{ts.label:>16} {client:5} fingerprints {fp:3} {streams:>5} streams round {r + 1}: "
                                    f"{row['path us/token']:.0f} us/token, {row['delivered tok/s']:.0f} of "
                                    f"{row['offered tok/s']:.0f} tok/s, TTFT p50 {row['TTFT p50 ms']:.0f} ms, "
                                    f"errors {window.errors} {window.error_kinds or ''}",
                                    flush=True,
                                )
            finally:
                for ts in stacks:
                    ts.stack.stop_all()
                    await _delete_topics(broker.bootstrap, ts.topics.prefix)
    finally:
        for label, tree in trees.items():
            if label != "this":
                remove_worktree(tree)
        shutil.rmtree(scratch, ignore_errors=True)
    return results


async def _delete_topics(bootstrap: str, prefix: str) -> None:
    from weir.kafka.admin import delete_prefixed_topics

    with contextlib.suppress(Exception):
        await delete_prefixed_topics(bootstrap, prefix)
