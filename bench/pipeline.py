"""`weir bench pipeline`: what the Kafka path costs against the engine called in-process.

(a) the worker's Engine driven directly in this process;
(b) the same requests over HTTP/SSE through gateway -> Kafka -> batcher -> Kafka -> worker ->
    Kafka -> gateway, with the services started here as processes on a private topic prefix.
(b) runs twice: through a gateway as deployed by default, and through one with its output guard
off. Every path at each concurrency (closed loop: a new request starts when one ends), same
prompts, same seeds, same max_tokens. After one unmeasured warm-up run of each path, the paths
run in alternating order for --rounds rounds, so that drift in this machine's speed falls on all
of them alike; the ratio is the median of the per-round ratios. Prints time-to-first-token
p50/p95, inter-token latency and tokens/s, and the CPU each process used.

At concurrency 1 the run also measures the floor under (b): one Kafka hop, measured by `weir bench
hop`'s own code (bench/kafka_hop.py: a weir.bus producer in this process, a weir.bus consumer in
a second one, one message at a time --hop-gap-ms apart, the first 10% dropped) through the same
broker, as one more entry in each round's alternating order (after the paths in even rounds,
before them in odd ones), so it sees the same drift. While it runs no request is in flight: the
services sit idle, their consumers parked in fetches on the same broker as during (b), and the
engine here is not stepping. The three-hop floor is 3 x that hop's p50 (three hops are what (b)
makes before the first token: request, batch, reply), not a measured chain of three hops: a chain
would add a third process and a relay's own code, which (b) counts as the services' work. Printed
per round and as medians over rounds: the hop p50, the floor, the path's added p50 TTFT with the
output guard off ((g)'s p50 TTFT - (a)'s, each round's own) and that as a multiple of the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.kafka_hop import measure_kafka_hop, three_hop_floor_ms
from bench.sse_client import SseConnection
from bench.stats import RunResult, percentile, print_table
from bench.ttft_breakdown import ClientMark, hop_rows, read_stamps
from schemas.messages import GenerateRequest, now_ms
from schemas.model_repo import load_model_repo
from schemas.topics import Topics

PROMPTS = [
    "def main():\n",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self",
    "for key, value in ",
    "    def __repr__(self):\n",
    "try:\n    import ",
    "if __name__ == '__main__':\n",
    "    return self.",
    "def read_file(path):\n",
    "from collections import ",
    "    raise ValueError(",
    "with open(",
    "class Error(Exception):\n",
    "    @property\n    def ",
    "async def fetch(",
    "    for i in range(",
]


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
            req = GenerateRequest(
                request_id=rid,
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.8,
                seed=seed,
                deadline_ms=now_ms() + 600_000,
                reply_to="-",
            )
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


class StreamTiming:
    """What one streamed completion measured: TTFT, the gaps between its text chunks, its tokens."""

    def __init__(self, ttft: list[float], itl: list[float], marks: list[ClientMark] | None = None) -> None:
        self.ttft, self.itl, self.marks = ttft, itl, marks
        self.start = time.perf_counter()
        self.start_wall_ms = time.time() * 1000
        self.last: float | None = None
        self.tokens = 0

    def on_data(self, data: bytes | str) -> None:
        """One SSE `data:` payload."""
        if data in (b"[DONE]", "[DONE]"):
            return
        chunk = orjson.loads(data)
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("text") for c in chunk.get("choices", [])):
            t = time.perf_counter()
            if self.last is None:
                self.ttft.append((t - self.start) * 1000)
                if self.marks is not None:
                    self.marks.append(ClientMark(chunk["id"], self.start_wall_ms, time.time() * 1000))
            else:
                self.itl.append((t - self.last) * 1000)
            self.last = t


def _stream_body(model: str, prompt: str, seed: int, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one_http(
    client: httpx.AsyncClient, model: str, prompt: str, seed: int, max_tokens: int, ttft: list[float], itl: list[float]
) -> int:
    """One streamed completion through httpx (the batcher bench's clients)."""
    timing = StreamTiming(ttft, itl)
    async with client.stream("POST", "/v1/completions", json=_stream_body(model, prompt, seed, max_tokens)) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                timing.on_data(line[6:])
    return timing.tokens


async def _one_sse(
    connection: SseConnection,
    model: str,
    prompt: str,
    seed: int,
    max_tokens: int,
    ttft: list[float],
    itl: list[float],
    marks: list[ClientMark] | None,
) -> int:
    """One streamed completion over a lean keep-alive connection."""
    timing = StreamTiming(ttft, itl, marks)
    async for data in connection.post_events(
        "/v1/completions", orjson.dumps(_stream_body(model, prompt, seed, max_tokens))
    ):
        timing.on_data(data)
    return timing.tokens


async def run_http(
    base_url: str, model: str, concurrency: int, n: int, max_tokens: int, marks: list[ClientMark] | None = None
) -> RunResult:
    """Closed loop over the gateway's SSE API: one keep-alive connection per lane; each request's
    wall-clock send and first-text times go to `marks` when given."""
    queue = workload(n)
    queue.reverse()
    ttft: list[float] = []
    itl: list[float] = []
    total = 0
    url = httpx.URL(base_url)
    host, port = url.host, url.port
    assert port is not None, f"{base_url} names no port"

    async def lane() -> None:
        nonlocal total
        connection = SseConnection(host, port)
        try:
            while queue:
                prompt, seed = queue.pop()
                tokens = await _one_sse(connection, model, prompt, seed, max_tokens, ttft, itl, marks)
                total += tokens  # not `total += await ...`: that reads total before the await
        finally:
            await connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return RunResult("gateway->Kafka->worker", concurrency, ttft, itl, total, wall)


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far; 0.0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime (fields 14, 15)


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the worker's engine processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds of each named group of processes."""
    return {name: sum(cpu_seconds(pid) for pid in group) for name, group in pids.items()}


# (b) twice: through a gateway as deployed by default, and through one with the output guard off.
# The guard holds back the trailing word of the text until it cannot be the start of an e-mail
# address or number to redact (docs/gateway.md), which delays the first visible token by about one
# token; that is a content policy, not the Kafka path, so both are shown.
PATHS = {"a": "in-process engine", "b": "gateway->Kafka->worker", "g": "  same, output guard off"}


def main(argv: list[str] | None = None) -> int:
    """Run the paths side by side at each concurrency, in alternating rounds, and print the table."""
    parser = argparse.ArgumentParser(prog="weir bench pipeline", description=__doc__)
    parser.add_argument("--model", default="weir-tiny-py")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument(
        "--requests-per-lane", type=int, default=4, help="requests per round = concurrency x this (min 12)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of every path per concurrency")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as the worker picks)")
    parser.add_argument(
        "--hop-count",
        type=int,
        default=200,
        help="Kafka hop messages per round at concurrency 1, for the three-hop floor (0: not measured)",
    )
    parser.add_argument("--hop-gap-ms", type=float, default=15.0, help="idle time between two hop messages")
    parser.add_argument(
        "--hop-warmup", type=int, default=2000, help="hop messages sent back to back in the unmeasured warm-up run"
    )
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    repo = load_model_repo(args.model_repo)
    config = repo.models[args.model]
    assert config.path is not None, f"{args.model} has no path (the echo model is not benchmarked)"
    tally, breakdowns = asyncio.run(_runs(args, levels, config))
    _report(tally.results, levels, tally.cpu, tally.ratios, args.rounds)
    for c, (hops, num_hopped) in sorted(breakdowns.items()):
        if hops:
            print(
                f"\nWhere TTFT goes on the Kafka path, concurrency {c}, output guard off ({num_hopped} requests; "
                "Kafka record timestamps, 1 ms resolution, so means; see bench/ttft_breakdown.py):"
            )
            print_table(hops, ["hop", "mean ms", "p50 ms"])
    _report_floor(tally, args)
    return 0


async def _runs(args, levels: list[int], config):
    """Start the stack, load the engine here, then at each level warm up and run the rounds."""
    import torch

    from services.worker.config import WorkerSettings
    from services.worker.hosts.engine_factory import build_engine, warm_up
    from services.worker.hosts.hardware import choose_device, cpu_threads
    from weir.kafka import launcher
    from weir.kafka.admin import delete_prefixed_topics, deployment_specs, ensure_topics
    from weir.stack import Stack, free_ports, wait_http_ok

    torch.set_num_threads(cpu_threads(args.threads))
    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    topics = Topics(f"bench{uuid.uuid4().hex[:6]}")
    await ensure_topics(broker.bootstrap, deployment_specs(topics, load_model_repo(args.model_repo)))
    ports = dict(zip("bg", free_ports(2), strict=True))
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-"))
    stack = Stack(_stack_env(args, broker.bootstrap, topics, scratch), scratch)
    tally = _Tally()
    breakdowns: dict[int, tuple[list[list[str]], int]] = {}
    try:
        _start_services(stack, ports)
        # The worker's own engine: built by the worker's code from the same model entry and settings.
        settings = WorkerSettings()
        device = choose_device(settings.device)
        engine = build_engine(config, settings, device)
        warm_up(engine, config)
        bases = {path: f"http://127.0.0.1:{port}" for path, port in ports.items()}
        for base in bases.values():
            await asyncio.to_thread(wait_http_ok, f"{base}/readyz", 300, stack)
        print(
            f"model {args.model} on {device}, torch threads {torch.get_num_threads()}; "
            f"{args.rounds} rounds per concurrency, paths in alternating order",
            flush=True,
        )
        pids = _process_groups(stack, broker)

        async def one(path: str, c: int, n: int, marks: list[ClientMark] | None = None) -> RunResult:
            if path == "a":
                return await asyncio.to_thread(run_inprocess, engine, args.model, c, n, args.max_tokens)
            return await run_http(bases[path], args.model, c, n, args.max_tokens, marks)

        async def hop(num_warmup: int) -> list[float]:
            """One Kafka hop through this run's broker, as `weir bench hop` measures it (ms per message)."""
            return (await measure_kafka_hop(broker.bootstrap, args.hop_count, args.hop_gap_ms / 1000, num_warmup))[
                "hop"
            ]

        for c in levels:
            floor = _HopFloor(hop, args.hop_warmup) if c == 1 and args.hop_count > 0 else None
            await _run_level(one, c, max(12, c * args.requests_per_lane), args.rounds, pids, tally, floor)
        for c, marks in tally.hop_marks.items():
            breakdowns[c] = await _hop_breakdown(broker.bootstrap, topics, config.served_id, marks)
    finally:
        stack.stop_all()
        await delete_prefixed_topics(broker.bootstrap, topics.prefix)
    return tally, breakdowns


@dataclass
class _Tally:
    """What the rounds measured: runs and CPU per (path, concurrency), tokens/s ratios, hop marks,
    and one Kafka hop's times (ms) per round at concurrency 1."""

    results: dict[tuple[str, int], list[RunResult]] = field(default_factory=dict)
    cpu: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    ratios: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    hop_marks: dict[int, list[ClientMark]] = field(default_factory=dict)  # concurrency -> the guard-off path's
    hop_ms: list[list[float]] = field(default_factory=list)


@dataclass
class _HopFloor:
    """The Kafka hop measurement that joins the rounds at concurrency 1: `measure(num_warmup)`."""

    measure: Callable[[int], Awaitable[list[float]]]
    warmup: int


def _stack_env(args, bootstrap: str, topics: Topics, scratch: Path) -> dict[str, str]:
    """The services' environment: this run's broker, topics and model, open auth, a scratch audit log."""
    env = {
        "WEIR_KAFKA_BOOTSTRAP": bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(Path(args.model_repo).resolve()),
        "WEIR_MODELS": args.model,
        "WEIR_AUTH_MODE": "open",
    }
    # Audit fingerprints (MiniLM embeddings of every prompt and output) share the worker's CPU;
    # they are measured by `weir bench audit`, and left out here so (b) differs from (a) only by
    # the Kafka path.
    env |= {
        "WEIR_AUDIT_DB": str(scratch / "audit.sqlite"),
        "WEIR_AUDIT_API_PORT": "0",
        "WEIR_AUDIT_FINGERPRINT_MODEL": "",
    }
    return env


def _start_services(stack, ports: dict[str, int]) -> None:
    """Auditor, worker, batcher, and two gateways: (b) as deployed by default, (g) output guard off."""
    for name in ("auditor", "worker", "batcher"):
        stack.start(name)
    stack.start("gateway", extra_env={"WEIR_GATEWAY_PORT": str(ports["b"])})
    stack.start("gateway-noguard", "gateway", {"WEIR_GATEWAY_PORT": str(ports["g"]), "WEIR_OUTPUT_GUARD": "off"})


def _process_groups(stack, broker) -> dict[str, list[int]]:
    """The processes whose CPU is counted, by name: each service (the worker with its engine
    process), this client, and the broker when it runs on this machine."""
    from weir.kafka import launcher

    pids = {name: [proc.pid] for name, proc in stack.procs.items()} | {"bench client": [os.getpid()]}
    pids["worker"] += children_of(stack.procs["worker"].pid)  # its engine process
    if (broker_pid := launcher.running_pid(broker)) is not None:
        pids["broker"] = [broker_pid]
    return pids


async def _run_level(
    one: Callable[..., Awaitable[RunResult]],
    c: int,
    n: int,
    rounds: int,
    pids: dict[str, list[int]],
    tally: _Tally,
    floor: _HopFloor | None = None,
) -> None:
    """At one concurrency: an unmeasured warm-up run of every path, then the rounds, in alternating
    order; with `floor`, the Kafka hop is one more entry of that order (last, then first, ...)."""
    for path in PATHS:  # warm-up: JIT in the broker, caches everywhere
        await one(path, c, n)
    if floor is not None:  # its warm-up: the back-to-back messages of `weir bench hop --warmup`
        await floor.measure(floor.warmup)
    for r in range(rounds):
        order = list(PATHS) + ["hop"] * (floor is not None)
        if r % 2:
            order.reverse()
        round_results = {}
        for path in order:
            if path == "hop":
                assert floor is not None
                tally.hop_ms.append(await floor.measure(0))
                continue
            round_results[path] = await _measured(one, path, c, n, pids, tally)
        for path in ("b", "g"):
            tally.ratios.setdefault((path, c), []).append(
                round_results[path].tokens_per_s / round_results["a"].tokens_per_s
            )


async def _measured(
    one: Callable[..., Awaitable[RunResult]], path: str, c: int, n: int, pids: dict[str, list[int]], tally: _Tally
) -> RunResult:
    """One run of one path; its result and the CPU each process group used meanwhile go to the tally."""
    before = cpu_snapshot(pids)
    # The hop breakdown follows the guard-off path at every concurrency: there the first
    # delta with text is the first text the client sees.
    marks = tally.hop_marks.setdefault(c, []) if path == "g" else None
    result = await one(path, c, n, marks)
    after = cpu_snapshot(pids)
    tally.results.setdefault((path, c), []).append(result)
    used = tally.cpu.setdefault((path, c), {})
    for name in before:
        used[name] = used.get(name, 0.0) + after[name] - before[name]
    return result


async def _hop_breakdown(
    bootstrap: str, topics: Topics, served_id: str, marks: list[ClientMark]
) -> tuple[list[list[str]], int]:
    """Where TTFT went, hop by hop, from the records this run left on its request, batch and reply
    topics (the batch topic is the served version's, `name@version`, as the worker reads it)."""
    from weir.kafka.admin import list_topic_names

    names = [topics.requests, topics.batches(served_id)]
    names += [t for t in await list_topic_names(bootstrap) if t.startswith(f"{topics.prefix}.replies.")]
    return hop_rows(marks, await read_stamps(bootstrap, names))


def _pooled(runs: list[RunResult]) -> RunResult:
    first = runs[0]
    return RunResult(
        first.label,
        first.concurrency,
        [x for r in runs for x in r.ttft_ms],
        [x for r in runs for x in r.itl_ms],
        sum(r.num_tokens for r in runs),
        sum(r.wall_s for r in runs),
    )


def _report(results, levels: list[int], cpu, ratios, rounds: int) -> None:
    header = ["path", "conc", "reqs-tokens", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "tokens/s"]
    rows = []
    pooled = {key: _pooled(runs) for key, runs in results.items()}
    for c in levels:
        for path, label in PATHS.items():
            r = pooled[(path, c)]
            rows.append(
                [
                    label,
                    str(c),
                    f"{len(r.ttft_ms)}-{r.num_tokens}",
                    f"{percentile(r.ttft_ms, 50):.1f}",
                    f"{percentile(r.ttft_ms, 95):.1f}",
                    f"{percentile(r.itl_ms, 50):.1f}",
                    f"{percentile(r.itl_ms, 95):.1f}",
                    f"{r.tokens_per_s:.1f}",
                ]
            )
    print()
    print_table(rows, header)
    print()
    for c in levels:
        a = pooled[("a", c)]
        for path in ("b", "g"):
            b = pooled[(path, c)]
            added = percentile(b.ttft_ms, 50) - percentile(a.ttft_ms, 50)
            each = ratios[(path, c)]
            print(
                f"concurrency {c:>3}, {PATHS[path].strip()}: adds {added:+.1f} ms to p50 TTFT; keeps "
                f"{statistics.median(each):.0%} of in-process tokens/s (median of {rounds} rounds: "
                + " ".join(f"{x:.0%}" for x in each)
                + ")"
            )
    for c in levels:
        for path in ("a", "b"):
            used, r = cpu[(path, c)], pooled[(path, c)]
            print(
                f"concurrency {c:>3}, CPU during {PATHS[path].strip()}, cores (ms per token): "
                + ", ".join(
                    f"{name} {seconds / r.wall_s:.2f} ({1000 * seconds / max(1, r.num_tokens):.2f})"
                    for name, seconds in used.items()
                )
            )
    print("targets: <= +10 ms p50 TTFT at concurrency 1; >= 80% of in-process tokens/s at concurrency 16")
    print("(b) runs without audit fingerprints (see `weir bench audit` for their cost)")


def added_ttft_by_round(inprocess: list[RunResult], path: list[RunResult]) -> list[float]:
    """The path's added p50 TTFT in each round: its p50 minus the in-process p50 of the same round."""
    return [percentile(b.ttft_ms, 50) - percentile(a.ttft_ms, 50) for a, b in zip(inprocess, path, strict=True)]


FLOOR_HEADER = ["round", "one hop p50 ms", "three-hop floor ms", "added p50 TTFT ms", "added / floor"]


def floor_table(hop_ms: list[list[float]], added_ms: list[float]) -> tuple[list[list[str]], dict[str, float]]:
    """Rows of FLOOR_HEADER, one per round and a last one of each column's median over rounds,
    and those medians ("hop", "floor", "added", "multiple") with the multiples' range ("low", "high")."""
    hop_p50 = [percentile(h, 50) for h in hop_ms]
    floors = [three_hop_floor_ms(h) for h in hop_ms]
    multiples = [a / f for a, f in zip(added_ms, floors, strict=True)]
    rows = [
        [str(r + 1), f"{h:.2f}", f"{f:.2f}", f"{a:+.1f}", f"{m:.2f}x"]
        for r, (h, f, a, m) in enumerate(zip(hop_p50, floors, added_ms, multiples, strict=True))
    ]
    med = {
        "hop": statistics.median(hop_p50),
        "floor": statistics.median(floors),
        "added": statistics.median(added_ms),
        "multiple": statistics.median(multiples),
        "low": min(multiples),
        "high": max(multiples),
    }
    rows.append(
        ["median", f"{med['hop']:.2f}", f"{med['floor']:.2f}", f"{med['added']:+.1f}", f"{med['multiple']:.2f}x"]
    )
    return rows, med


def _report_floor(tally: _Tally, args) -> None:
    """The three-hop floor measured in this run, against the guard-off path's added TTFT at concurrency 1."""
    if not tally.hop_ms:
        why = "--hop-count 0" if args.hop_count <= 0 else "no concurrency 1 in --concurrency"
        print(f"\nthree-hop floor: not measured ({why})")
        return
    added = added_ttft_by_round(tally.results[("a", 1)], tally.results[("g", 1)])
    rows, med = floor_table(tally.hop_ms, added)
    print(
        f"\nThe three-hop floor, measured in this run: one Kafka hop as `weir bench hop` measures it, through "
        f"this broker, {args.hop_count} messages {args.hop_gap_ms:.0f} ms apart in each round (the first 10% "
        "dropped) while no request is in flight; floor = 3 x the hop's p50. Against it, the Kafka path's added "
        "p50 TTFT at concurrency 1, output guard off (its p50 minus the in-process p50 of the same round):"
    )
    print_table(rows, FLOOR_HEADER)
    print(
        f"concurrency   1, {PATHS['g'].strip()}: adds {med['added']:+.1f} ms to p50 TTFT, {med['multiple']:.2f}x "
        f"the three-hop floor of {med['floor']:.2f} ms (one hop {med['hop']:.2f} ms p50); medians of "
        f"{len(rows) - 1} rounds, multiples {med['low']:.2f}x-{med['high']:.2f}x"
    )
    print("target (issue 21): added p50 TTFT <= 1.3x the three-hop floor at concurrency 1, output guard off")
