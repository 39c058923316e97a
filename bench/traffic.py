"""`weir bench traffic`: live TTFT with a 100% mirror on and off, mirror copies completed, canary share.

The services run here as processes on a private topic prefix, as in bench/swap.py (auditor,
worker, batcher, gateway), seeded with version 1 of the model; versions 2 (the mirror) and 3 (the
canary), copies of the same directory, are pushed (`--no-goldens`) and the bench waits until a
worker has both ready. Each round runs `--phase-s` seconds of a steady interactive load
(`--concurrency` closed-loop streams for the bare name) with `weir models route N --mirror 2=100`,
and as long with `--clear-mirror`; the order alternates between rounds, so warm-up favours
neither. A route change applies within a second (docs/design.md, "Traffic policies"): the load of
a phase starts `--settle-s` after it and stops before the next change, so every live request of a
mirror phase is mirrored.

It prints, per round, live TTFT p50/p95 with the mirror on and off and the p95 ratio (target <=
1.2x), and its median and spread over the rounds; the share of mirror copies completed (the
auditor's TrafficCounts: requests of N@2 assigned "mirror", read once they stop growing, against
the live requests of the mirror phases); then the canary: `--canary-pct`% to version 3 and
`--canary-requests` requests (2,000), each from a user of its own, and the share version 3 served
against the weight (target within +-1 point).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench.sse_client import SseConnection
from bench.stats import percentile, print_table
from bench.swap import PROMPTS, Outcome, _model_dirs, _run, _until_heartbeats, stream_once
from schemas.topics import Topics


@dataclass
class Phase:
    """One load phase: the mirror on or off, and its live requests."""

    mirror: bool
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def done(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is None and o.ttft_ms is not None]

    def ttfts(self) -> list[float]:
        return [o.ttft_ms for o in self.outcomes if o.error is None and o.ttft_ms is not None]

    def p95(self) -> float:
        return percentile(self.ttfts(), 95)


@dataclass
class Result:
    phases: list[Phase] = field(default_factory=list)
    mirrored_before: int = 0  # N@2 "mirror" requests the auditor counted before the first phase
    mirrored_after: int = 0  # ... and once they stopped growing after the last
    canary: list[Outcome] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench traffic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="weir-tiny-py", help="model entry of --model-repo (default %(default)s)")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--concurrency", type=int, default=16, help="live streams of the steady load")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of load with the mirror on, and off")
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait after a route change before the load")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--canary-pct", type=float, default=5.0, help="the canary's weight, percent")
    parser.add_argument("--canary-requests", type=int, default=2000)
    parser.add_argument(
        "--http-ports",
        type=int,
        metavar="BASE",
        help="HTTP ports BASE (gateway), BASE+1 (auditor), BASE+2 (batcher), BASE+3 (worker); default: free ones",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.concurrency < 1 or args.phase_s <= 0 or args.canary_requests < 1:
        parser.error("--rounds, --concurrency, --canary-requests must be >= 1 and --phase-s > 0")
    if not 0 < args.canary_pct < 100:
        parser.error("--canary-pct must be in (0, 100)")
    result = asyncio.run(_bench(args))
    _report(result, args)
    return 0


async def _bench(args) -> Result:
    from schemas.model_repo import load_model_repo
    from weir.kafka import launcher
    from weir.kafka.admin import delete_prefixed_topics
    from weir.stack import HTTP_PORT_ENV, Stack, free_ports, wait_http_ok

    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    config = load_model_repo(args.model_repo).models[args.model]
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-traffic-"))
    topics = Topics(f"benchtraffic{uuid.uuid4().hex[:6]}")
    _v1, v2, repo = _model_dirs(config, scratch)
    v3 = scratch / "v3"
    shutil.copytree(v2, v3)
    env = {
        "WEIR_KAFKA_BOOTSTRAP": broker.bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(repo),
        "WEIR_AUTH_MODE": "open",
        "WEIR_AUDIT_DB": str(scratch / "audit.sqlite"),
        "WEIR_AUDIT_API_PORT": "0",
        "WEIR_AUDIT_FINGERPRINT_MODEL": "",
        "WEIR_HOME": str(scratch / "home"),
        "WEIR_TRAFFIC_EVERY_S": "1",
    }
    port = args.http_ports if args.http_ports is not None else free_ports(1)[0]
    if args.http_ports is not None:
        env.update({HTTP_PORT_ENV[s]: str(port + i) for i, s in enumerate(("gateway", "auditor", "batcher", "worker"))})
    stack = Stack(env, scratch / "logs")
    weir = _Weir(config.name, broker.bootstrap, topics, {**os.environ, **env})
    result = Result()
    try:
        for name in ("auditor", "worker", "batcher"):
            stack.start(name)
        stack.start("gateway", extra_env={"WEIR_GATEWAY_PORT": str(port)})
        for name in ("worker", "batcher", "gateway"):
            await asyncio.to_thread(wait_http_ok, f"{stack.url(name)}/readyz", 300, stack)
        for version, where in (("2", v2), ("3", v3)):
            await weir(
                "push",
                str(where),
                "--name",
                config.name,
                "--version",
                version,
                "--from-toml",
                str(repo),
                "--no-goldens",
                name=False,
            )
        await _until_heartbeats(
            broker.bootstrap,
            topics,
            lambda hbs: any(
                all((s := hb.versions.get(f"{config.name}@{v}")) is not None and s.state == "ready" for v in ("2", "3"))
                for hb in hbs
            ),
        )
        result.mirrored_before = await _mirrored(broker.bootstrap, topics, config.name)
        for r in range(args.rounds):
            for mirror in (True, False) if r % 2 == 0 else (False, True):
                await weir("route", "--mirror", "2=100") if mirror else await weir("route", "--clear-mirror")
                await asyncio.sleep(args.settle_s)
                result.phases.append(await _phase(port, config.name, args, mirror))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        await weir("route", "--clear-mirror", "--canary", f"3={args.canary_pct:g}")
        result.mirrored_after = await _settled(broker.bootstrap, topics, config.name)
        await asyncio.sleep(args.settle_s)
        result.canary = await _canary(port, config.name, args)
    finally:
        stack.stop_all()
        await delete_prefixed_topics(broker.bootstrap, topics.prefix)
        shutil.rmtree(scratch, ignore_errors=True)
    return result


class _Weir:
    """`weir models ACTION ...` on the bench's deployment, as a process (as bench/swap.py)."""

    def __init__(self, model: str, bootstrap: str, topics: Topics, env: dict) -> None:
        self.model, self.env = model, env
        self.where = ["--bootstrap", bootstrap, "--topic-prefix", topics.prefix]

    async def __call__(self, action: str, *argv: str, name: bool = True) -> None:
        command = [sys.executable, "-m", "weir.cli", "models", action, *([self.model] if name else []), *argv]
        await _run([*command, *self.where], self.env)


async def _phase(port: int, name: str, args, mirror: bool) -> Phase:
    """`--phase-s` seconds of closed-loop streams; every request started is finished before it returns."""
    phase = Phase(mirror)
    stop = asyncio.Event()

    async def lane(lane_no: int) -> None:
        connection = SseConnection("127.0.0.1", port)
        i = 0
        try:
            while not stop.is_set():
                body = {
                    "model": name,
                    "prompt": PROMPTS[(lane_no + i) % len(PROMPTS)],
                    "max_tokens": args.max_tokens,
                    "temperature": 0.8,
                    "seed": lane_no * 100_000 + i,
                    "stream": True,
                    "user": f"live-{lane_no}",
                }
                i += 1
                outcome = Outcome(time.perf_counter())
                phase.outcomes.append(outcome)
                connection = await stream_once(connection, port, body, outcome)
        finally:
            await connection.close()

    lanes = [asyncio.create_task(lane(n)) for n in range(args.concurrency)]
    await asyncio.sleep(args.phase_s)
    stop.set()
    await asyncio.gather(*lanes)
    return phase


async def _canary(port: int, name: str, args) -> list[Outcome]:
    """`--canary-requests` short requests, each from its own user, `--concurrency` at a time."""
    queue = list(range(args.canary_requests))
    outcomes: list[Outcome] = []

    async def lane() -> None:
        connection = SseConnection("127.0.0.1", port)
        try:
            while queue:
                user = queue.pop()
                body = {
                    "model": name,
                    "prompt": "def main():\n",
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "stream": True,
                    "user": f"bench-user-{user}",
                }
                outcome = Outcome(time.perf_counter())
                outcomes.append(outcome)
                connection = await stream_once(connection, port, body, outcome)
        finally:
            await connection.close()

    await asyncio.gather(*(lane() for _ in range(args.concurrency)))
    return outcomes


async def _mirrored(bootstrap: str, topics: Topics, name: str) -> int:
    """The mirror copies of N@2 the auditor has counted (its latest TrafficCounts)."""
    from weir.bus import BusSettings
    from weir.models.registry_cli import read_traffic

    counts, _skipped = await read_traffic(BusSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix), name)
    return 0 if counts is None else counts.counts.get(f"{name}@2", {}).get("mirror", 0)


async def _settled(bootstrap: str, topics: Topics, name: str, quiet_s: float = 5.0, timeout_s: float = 120.0) -> int:
    """The mirror count once it has not grown for `quiet_s` (bulk copies finish after the live load)."""
    deadline = time.monotonic() + timeout_s
    last, since = await _mirrored(bootstrap, topics, name), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        await asyncio.sleep(1.0)
        now = await _mirrored(bootstrap, topics, name)
        if now != last:
            last, since = now, time.monotonic()
    return last


def summarize(result: Result, name: str, canary_pct: float) -> dict:
    """The figures the table prints: per-round p95s and ratios, mirror completion, canary share."""
    rounds = [(result.phases[i], result.phases[i + 1]) for i in range(0, len(result.phases) - 1, 2)]
    ratios = []
    for a, b in rounds:
        on, off = (a, b) if a.mirror else (b, a)
        ratios.append(on.p95() / off.p95())
    mirrored_live = sum(len(p.outcomes) for p in result.phases if p.mirror)  # a failed live request is copied too
    copies = result.mirrored_after - result.mirrored_before
    served = [o for o in result.canary if o.error is None and o.version]
    share = 100 * sum(1 for o in served if o.version == f"{name}@3") / len(served) if served else float("nan")
    return {
        "ratios": ratios,
        "mirrored_live": mirrored_live,
        "copies_completed": copies,
        "completed_share": copies / mirrored_live if mirrored_live else float("nan"),
        "canary_served": len(served),
        "canary_failed": len(result.canary) - len(served),
        "canary_share": share,
        "canary_error_pts": share - canary_pct,
    }


def _failed(phase: Phase) -> int:
    """Live requests that ended in an error (shown below the table)."""
    return sum(o.error is not None for o in phase.outcomes)


def _textless(phase: Phase) -> int:
    """Live requests that finished without an error but produced no text (the model's first token
    ended it): they have no time to first token, so they are not in the TTFT columns."""
    return sum(o.error is None and o.ttft_ms is None for o in phase.outcomes)


def _report(result: Result, args) -> None:
    s = summarize(result, args.model, args.canary_pct)
    rows = []
    for n, ratio in enumerate(s["ratios"], 1):
        on, off = sorted(result.phases[2 * n - 2 : 2 * n], key=lambda p: not p.mirror)
        rows.append(
            [
                str(n),
                *(f"{len(p.done)} ({_failed(p)} failed, {_textless(p)} without text)" for p in (on, off)),
                *(f"{percentile(p.ttfts(), 50):.0f}/{p.p95():.0f}" for p in (on, off)),
                f"{ratio:.2f}x",
            ]
        )
    print(
        f"\nweir bench traffic: {args.model}, {args.concurrency} live streams, max_tokens {args.max_tokens}, "
        f"{args.phase_s:.0f} s per phase, {args.rounds} rounds"
    )
    print_table(
        rows,
        ["round", "live requests, mirror on", "mirror off", "TTFT ms p50/p95 mirror on", "mirror off", "p95 on/off"],
    )
    ratios = s["ratios"]
    print(
        f"p95 on/off: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x over "
        f"{len(ratios)} rounds (target <= 1.2x)"
    )
    for o in [o for p in result.phases for o in p.outcomes if o.error is not None][:5]:
        print(f"  failed live request: {o.error}")
    print(
        f"mirror copies completed: {s['copies_completed']} of {s['mirrored_live']} live requests of the mirror phases "
        f"({s['completed_share']:.1%}; the rest dropped under load or unfinished)"
    )
    print(
        f"canary: {s['canary_share']:.2f}% of {s['canary_served']} requests ({s['canary_failed']} failed) served by "
        f"{args.model}@3 against a weight of {args.canary_pct:g}%: {s['canary_error_pts']:+.2f} points "
        "(target within +-1)"
    )
