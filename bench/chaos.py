"""`weir chaos`: the whole stack under load while its processes are killed with -9, on a schedule.

A bounded check of docs/design.md, "Scale-out and failover (invariant 9)", on this machine. It
starts its own Kafka cluster (`--brokers`, in a scratch data dir) or uses one (`--bootstrap`,
whose brokers it never kills), then the batcher, `--workers` workers and `--gateways` gateways as
processes on a fresh topic prefix (the auditor is not started: nothing on the serving path waits
for it). Clients stream `--requests` chat completions over plain HTTP SSE, `--concurrency` at a
time: both lanes (X-Weir-Priority), max_tokens 8..128, each with its own seed, some sampled, each
asked with a resume grace. A client whose connection drops reconnects with Last-Event-ID to the
other gateway (GET /v1/streams/{id}), as a load balancer would send it.

Faults fire as the run progresses (a share of the requests ended), each after the services the
last one killed are ready again: a worker killed three times (alternating), the batcher, a
gateway, a broker; each is restarted after a short delay, as a supervisor would. Then every
request is run again undisturbed (same body, stream=false) and its text compared.

The table: requests sent, ended once, lost (no terminal event within `--bound-s` of its start;
"interrupted": the subset whose stream no gateway could resume), failed (an error terminal),
duplicated tokens (a content event of a seq already seen), texts differing from the rerun (and
those whose rerun never succeeded: not checked), and
per fault the client-visible stall p50/p95/max: for each stream in flight at the fault, the
longest gap between consecutive events that ends after the fault. Exit status 1 when anything was
lost, failed, duplicated, differs or could not be rerun: a chaos run is a check.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.sse_client import HttpError, SseConnection
from bench.stats import percentile, print_table

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "weir-tiny-py"
PROMPTS = [
    "Write a function that parses a date.",
    "Explain list comprehensions.",
    "def fibonacci(n):",
    "Sort a dict by value.",
    "class Cache:",
    "Read a CSV file and sum a column.",
    "import asyncio\n",
    "What does `yield from` do?",
]
RESUME_GRACE_S = 60  # X-Weir-Resume-Grace-S of every stream: far longer than any restart here
WORKER_RESTART_S, BATCHER_RESTART_S, GATEWAY_RESTART_S, BROKER_RESTART_S = 2.0, 2.0, 2.0, 10.0
RESUME_404S = 6  # consecutive "no such stream" answers before a client calls its stream interrupted
RERUN_CONCURRENCY = 8  # the reruns are not the load: fewer at once, each well within its deadline
STALL_WINDOW_S = 30.0  # a stall counts for a fault when it ends within this long after it
FAULT_KINDS = ("worker", "batcher", "gateway", "broker")
# (share of the requests ended, fault): the full run; --quick keeps one worker kill and the gateway.
SCHEDULE = [
    (0.10, "worker"),
    (0.25, "batcher"),
    (0.38, "worker"),
    (0.52, "gateway"),
    (0.66, "broker"),
    (0.80, "worker"),
]
QUICK_SCHEDULE = [(0.2, "worker"), (0.55, "gateway")]


@dataclass
class Request:
    """One client request as it was asked and as the client saw it."""

    index: int
    body: dict[str, Any]
    priority: str
    started: float = 0.0
    times: list[float] = field(default_factory=list)  # when each event arrived (perf_counter)
    text: list[str] = field(default_factory=list)
    content_ids: list[int] = field(default_factory=list)  # the seq of each content event, in order
    num_ends: int = 0  # chunks with a finish_reason: exactly one, for a request that ended once
    num_duplicated: int = 0  # content events whose seq was seen before
    errors: list[str] = field(default_factory=list)
    last_id: int = -1  # the last SSE id seen: a reconnect's Last-Event-ID
    num_reconnects: int = 0
    is_interrupted: bool = False
    ended_at: float | None = None  # [DONE] received
    over_at: float | None = None  # its client was done with it, however it went

    @property
    def ended_once(self) -> bool:
        return self.ended_at is not None and self.num_ends == 1 and not self.errors


@dataclass
class Fault:
    kind: str
    target: str
    at: float  # perf_counter when the kill was sent
    note: str = ""


class Cluster:
    """The brokers chaos starts and kills: `weir/kafka/launcher.py`'s cluster (cluster_configs and
    friends) where it has one, else its single broker (then only `brokers=1` is accepted)."""

    def __init__(self, port: int, brokers: int, data_dir: Path) -> None:
        from weir.kafka import launcher

        self.launcher = launcher
        make = getattr(launcher, "cluster_configs", None)
        if make is not None:
            self.cfgs = make(port, brokers, data_dir=data_dir)
        elif brokers == 1:
            self.cfgs = [launcher.BrokerConfig(port=port, data_dir=data_dir / "broker-0")]
        else:
            raise SystemExit(f"weir chaos: --brokers {brokers}: this build's launcher runs one broker only")

    @property
    def bootstrap(self) -> str:
        if (bootstrap_of := getattr(self.launcher, "bootstrap_of", None)) is not None:
            return bootstrap_of(self.cfgs)
        return ",".join(cfg.bootstrap for cfg in self.cfgs)

    async def up(self, timeout_s: float) -> None:
        if hasattr(self.launcher, "start_cluster"):
            await asyncio.to_thread(self.launcher.start_cluster, self.cfgs)
            await self.launcher.wait_cluster_ready(self.cfgs, timeout_s)
        else:
            await self.launcher.up(self.cfgs[0], timeout_s)

    def kill(self, i: int) -> None:
        if (pid := self.launcher.running_pid(self.cfgs[i])) is not None:
            os.kill(pid, signal.SIGKILL)

    def restart(self, i: int) -> None:
        self.launcher.start(self.cfgs[i])

    def stop(self) -> None:
        if hasattr(self.launcher, "stop_cluster"):
            self.launcher.stop_cluster(self.cfgs)
        else:
            for cfg in self.cfgs:
                self.launcher.stop(cfg)


def build_parser() -> argparse.ArgumentParser:
    from weir.kafka import launcher

    parser = argparse.ArgumentParser(prog="weir chaos", description=__doc__.split("\n\n")[0])
    # 3 brokers where the launcher runs a cluster (weir/kafka/launcher.py: cluster_configs), else its one broker
    has_cluster = hasattr(launcher, "cluster_configs")
    parser.add_argument("--requests", type=int, help="requests to send (default 1000; --quick: 80)")
    parser.add_argument(
        "--brokers",
        type=int,
        default=3 if has_cluster else 1,
        help="brokers of the cluster chaos starts (default %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=24, help="streams in flight at once (default 24)")
    parser.add_argument("--seed", type=int, default=20, help="seeds the load's choices and each request's seed")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the test suite's run: 80 requests, max_tokens 8..48, one worker kill and one gateway kill",
    )
    parser.add_argument(
        "--faults", help=f"comma-separated kinds of the schedule to keep ({','.join(FAULT_KINDS)}; default all)"
    )
    parser.add_argument(
        "--bootstrap",
        help="use this running cluster instead of starting one (its brokers are "
        "never killed: the broker fault is left out)",
    )
    parser.add_argument("--kafka-port", type=int, default=39092, help="first port of the cluster chaos starts")
    parser.add_argument(
        "--http-port", type=int, default=0, help="first of the services' HTTP ports (default: free ports)"
    )
    parser.add_argument(
        "--bound-s",
        type=float,
        default=180.0,
        help="a request with no terminal event this long after its start is lost (default %(default)s)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures and every failure here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (logs, broker data)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = set(FAULT_KINDS if args.faults is None else (k.strip() for k in args.faults.split(",") if k.strip()))
    if unknown := kinds - set(FAULT_KINDS):
        print(
            f"weir chaos: --faults: unknown kind {sorted(unknown)[0]!r} (one of {', '.join(FAULT_KINDS)})",
            file=sys.stderr,
        )
        return 2
    if min(args.workers, args.gateways, args.brokers, args.concurrency) < 1:
        print("weir chaos: --brokers, --workers, --gateways and --concurrency must be at least 1", file=sys.stderr)
        return 2
    args.requests = args.requests or (80 if args.quick else 1000)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the services are stopped, not orphaned
    schedule = [(share, kind) for share, kind in (QUICK_SCHEDULE if args.quick else SCHEDULE) if kind in kinds]
    report = asyncio.run(_run(args, schedule))
    _print_report(report, args)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 1 if any(report["totals"][k] for k in ("lost", "failed", "duplicated", "differing", "not_rerun")) else 0


def make_requests(n: int, seed: int, quick: bool) -> list[Request]:
    """`n` chat completions: both lanes, max_tokens 8..128 (8..48 quick), a seed each, one in
    three sampled at temperature 0.8 (seeded: its rerun must give the same text)."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{rng.choice(PROMPTS)} ({i})"}],
            "max_tokens": rng.randint(8, 48 if quick else 128),
            "seed": seed * 100_000 + i,
            "temperature": 0.8 if i % 3 == 0 else 0.0,
        }
        requests.append(Request(i, body, "bulk" if rng.random() < 0.3 else "interactive"))
    return requests


class Chaos:
    """The stack, its cluster, the faults done so far."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        from weir.stack import Stack, free_ports

        self.args = args
        self.cluster = None if args.bootstrap else Cluster(args.kafka_port, args.brokers, scratch / "kafka")
        self.prefix = f"chaos{uuid.uuid4().hex[:8]}"
        num_ports = 1 + args.workers + args.gateways
        ports = iter(range(args.http_port, args.http_port + num_ports) if args.http_port else free_ports(num_ports))
        self.services = {
            "batcher": "batcher",
            **{f"worker-{i}": "worker" for i in range(1, args.workers + 1)},
            **{f"gateway-{i}": "gateway" for i in range(1, args.gateways + 1)},
        }
        self.env = {
            "WEIR_TOPIC_PREFIX": self.prefix,
            "WEIR_MODEL_REPO": str(REPO_ROOT / "models.toml"),
            "WEIR_MODELS": MODEL,
            "WEIR_AUTH_MODE": "open",
            "WEIR_AUDIT_FINGERPRINT_MODEL": "",
            "WEIR_HOME": str(scratch / "home"),
            "PYTHONUNBUFFERED": "1",
            "WEIR_KAFKA_WAIT_S": "120",
        }
        self.stack = Stack(self.env, scratch / "logs")
        for name, service in self.services.items():  # both kept across restarts by the Stack
            self.stack.http_ports[name] = next(ports)
            if service == "worker":  # its static group membership (docs/design.md, "Failover in seconds")
                self.stack.own_env[name] = {"WEIR_WORKER_INSTANCE": name}
            elif service == "gateway":  # its own reply topic, the same after a restart
                self.stack.own_env[name] = {"WEIR_GATEWAY_ID": f"{self.prefix}-{name}"}
        self.gateway_ports = [self.stack.http_ports[n] for n, s in self.services.items() if s == "gateway"]
        self.faults: list[Fault] = []
        self.restarts: dict[asyncio.Task, str] = {}  # a restart under way -> the kind of its fault
        self.num_worker_kills = 0

    @property
    def bootstrap(self) -> str:
        if self.cluster is None:  # only with --bootstrap: the cluster is the caller's
            return self.args.bootstrap
        return self.args.bootstrap or self.cluster.bootstrap

    async def up(self) -> None:
        from weir.cli import create_topics

        if self.cluster is not None:
            await self.cluster.up(180)
        self.env["WEIR_KAFKA_BOOTSTRAP"] = self.bootstrap
        await create_topics(self.bootstrap, self.prefix, REPO_ROOT / "models.toml", 120)
        for name, service in self.services.items():
            self.stack.start(name, service=service)
        await self.wait_ready(list(self.services))

    async def wait_ready(self, names: list[str]) -> None:
        from weir.stack import wait_http_ok

        for name in names:
            await asyncio.to_thread(wait_http_ok, f"{self.stack.url(name)}/readyz", 300, self.stack)

    async def inject(self, kind: str) -> Fault:
        """Kill one process of `kind` now; its restart runs in the background. A broker fault is
        skipped (a Fault with a note) on a cluster chaos does not own, or on one broker: its death
        is an outage of everything, not a failover."""
        if kind == "broker":
            if self.cluster is None:
                return Fault(kind, "-", math.nan, "skipped: chaos does not own the brokers of --bootstrap")
            if len(self.cluster.cfgs) == 1:
                return Fault(kind, "-", math.nan, "skipped: 1 broker (nothing to fail over to)")
            i = len(self.cluster.cfgs) - 1  # not the first: the one a client most likely bootstrapped from
            fault = Fault("broker", f"broker-{i}", time.perf_counter())
            self.cluster.kill(i)
            self._later("broker", BROKER_RESTART_S, lambda: self.cluster.restart(i), [])
            return fault
        if kind == "worker":
            self.num_worker_kills += 1
            name = f"worker-{(self.num_worker_kills - 1) % self.args.workers + 1}"
        else:
            name = "batcher" if kind == "batcher" else "gateway-1"
        fault = Fault(kind, name, time.perf_counter())
        self.stack.kill(name)
        delay = {"worker": WORKER_RESTART_S, "batcher": BATCHER_RESTART_S, "gateway": GATEWAY_RESTART_S}[kind]
        self._later(kind, delay, lambda: self.stack.start(name, service=self.services[name]), [name])
        return fault

    def _later(self, kind: str, delay_s: float, restart, ready: list[str]) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            await asyncio.to_thread(restart)
            await self.wait_ready(ready)

        self.restarts[asyncio.create_task(run())] = kind

    async def settled(self, kind: str | None = None) -> None:
        """Until every restart after a fault of `kind` (None: any) is done and its service ready:
        a worker is killed only while the other one serves, a gateway while the other one is up."""
        while any(kind in (None, k) for k in self.restarts.values()):
            for task in [t for t, k in self.restarts.items() if t.done() and kind in (None, k)]:
                del self.restarts[task]
                task.result()
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        for task in self.restarts:
            task.cancel()
        self.stack.stop_all()
        if self.cluster is not None:
            self.cluster.stop()


async def _run(args: argparse.Namespace, schedule: list[tuple[float, str]]) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="weir-chaos-"))
    chaos = Chaos(args, scratch)
    requests = make_requests(args.requests, args.seed, args.quick)
    try:
        print(f"weir chaos: starting the cluster and services (scratch {scratch}) ...", flush=True)
        await chaos.up()
        print(
            f"weir chaos: {args.requests} requests, concurrency {args.concurrency}, faults: "
            f"{', '.join(k for _s, k in schedule) or 'none'}",
            flush=True,
        )
        began = time.perf_counter()
        gate = asyncio.Semaphore(args.concurrency)
        clients = [asyncio.create_task(_client(r, chaos.gateway_ports, gate, args.bound_s)) for r in requests]
        faults = await _faults(chaos, requests, schedule)
        await asyncio.gather(*clients)
        load_s = time.perf_counter() - began
        await chaos.settled()
        print(f"weir chaos: load done in {load_s:.0f} s; rerunning every request undisturbed ...", flush=True)
        reruns = await _reruns(requests, chaos.gateway_ports[0], min(args.concurrency, RERUN_CONCURRENCY))
        dead = chaos.stack.dead()
    finally:
        chaos.stop()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return _summary(requests, reruns, faults, args, load_s, dead)


async def _faults(chaos: Chaos, requests: list[Request], schedule: list[tuple[float, str]]) -> list[Fault]:
    """Fire each fault once its share of the requests ended and the last fault of its kind is repaired."""
    faults = []
    for share, kind in schedule:
        while sum(r.over_at is not None for r in requests) < share * len(requests):  # noqa: ASYNC110 - a count
            await asyncio.sleep(0.1)
        await chaos.settled(kind)
        fault = await chaos.inject(kind)
        what = f"{kind}: {fault.note}" if fault.note else f"kill -9 {fault.target}"
        print(f"  {what} ({sum(r.ended_at is not None for r in requests)} ended)", flush=True)
        faults.append(fault)
    return faults


async def _client(request: Request, ports: list[int], gate: asyncio.Semaphore, bound_s: float) -> None:
    try:
        async with gate:
            await _stream(request, ports, bound_s)
    finally:
        request.over_at = time.perf_counter()


async def _stream(request: Request, ports: list[int], bound_s: float) -> None:
    """Stream `request` to its end, reconnecting at the next gateway whenever a connection drops."""
    request.started = time.perf_counter()
    deadline = request.started + bound_s
    g = request.index % len(ports)
    request_id: str | None = None
    not_found = 0
    while time.perf_counter() < deadline and request.ended_at is None:
        connection = SseConnection("127.0.0.1", ports[g])
        try:
            if request_id is None:
                headers = {"X-Weir-Priority": request.priority, "X-Weir-Resume-Grace-S": str(RESUME_GRACE_S)}
                body = orjson.dumps({**request.body, "stream": True})
                events = connection.events("POST", "/v1/chat/completions", body, headers)
            else:
                seen = {"Last-Event-ID": str(request.last_id)} if request.last_id >= 0 else {}  # none: from the start
                events = connection.events("GET", f"/v1/streams/{request_id}", headers=seen)
            async for event_id, data in events:
                request_id = request_id or connection.headers.get("x-request-id")
                _on_event(request, event_id, data)
            not_found = 0
        except HttpError as exc:
            if exc.status == 404 and request_id is not None:
                not_found += 1
                if not_found >= RESUME_404S:
                    request.is_interrupted = True
                    return
            elif exc.status not in (429, 502, 503):
                request.errors.append(str(exc)[:300])
                return
            await asyncio.sleep(min(5.0, float(exc.headers.get("retry-after", "1") or 1)))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            # a dropped or refused connection: go on at the other gateway, by the request's id
            # once its 200 came (it may have dropped before the first event)
            request_id = request_id or connection.headers.get("x-request-id")
            await asyncio.sleep(0.2)
        finally:
            await connection.close()
        if request.ended_at is None:
            request.num_reconnects += 1
            g = (g + 1) % len(ports)


def _on_event(request: Request, event_id: bytes | None, data: bytes) -> None:
    now = time.perf_counter()
    request.times.append(now)
    if event_id is not None:
        request.last_id = int(event_id)
    if data == b"[DONE]":
        request.ended_at = now
        return
    chunk = orjson.loads(data)
    if "error" in chunk:
        request.errors.append(str(chunk["error"].get("message"))[:300])
        return
    for choice in chunk.get("choices", []):
        if content := (choice.get("delta") or {}).get("content"):
            seq = int(event_id) if event_id is not None else -1
            if request.content_ids and seq <= request.content_ids[-1]:
                request.num_duplicated += 1
            request.content_ids.append(seq)
            request.text.append(content)
        if choice.get("finish_reason"):
            request.num_ends += 1


async def _reruns(requests: list[Request], port: int, concurrency: int) -> dict[int, str]:
    """Each request that ended once, asked again undisturbed (same body, stream=false): its text.
    A rerun refused or past its deadline (a loaded machine) is asked again, up to 5 times; one
    that never succeeded is missing (`not rerun`: the check could not be made)."""
    gate = asyncio.Semaphore(concurrency)
    texts: dict[int, str] = {}

    async def one(client: httpx.AsyncClient, request: Request) -> None:
        async with gate:
            for _attempt in range(5):
                resp = await client.post(
                    "/v1/chat/completions", json=request.body, headers={"X-Weir-Priority": request.priority}
                )
                if resp.status_code == 200:
                    texts[request.index] = resp.json()["choices"][0]["message"]["content"] or ""
                    return
                print(f"  rerun of request {request.index}: {resp.status_code} {resp.text[:200]}", flush=True)
                if resp.status_code not in (429, 503, 504):
                    return
                await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        await asyncio.gather(*(one(client, r) for r in requests if r.ended_once))
    return texts


def stall_s(request: Request, at: float) -> float | None:
    """The longest gap between consecutive events of `request` (its start first) that ends after
    `at` and begins within STALL_WINDOW_S of it (one that never ended: until its client gave up);
    None when it was not in flight at `at`."""
    if not request.started or request.started > at or (request.ended_at is not None and request.ended_at <= at):
        return None
    gave_up = [request.over_at] if request.ended_at is None and request.over_at is not None else []
    marks = [request.started, *request.times, *gave_up]
    gaps = [b - a for a, b in itertools.pairwise(marks) if b > at and a < at + STALL_WINDOW_S]
    return max(gaps, default=None)


def _summary(
    requests: list[Request],
    reruns: dict[int, str],
    faults: list[Fault],
    args: argparse.Namespace,
    load_s: float,
    dead: list[str],
) -> dict[str, Any]:
    """The figures of the run, and each request that went wrong (what its client saw)."""
    sent = [r for r in requests if r.started]
    lost = [r for r in sent if r.ended_at is None and not r.errors]
    failed = [r for r in sent if r.errors or (r.ended_at is not None and r.num_ends != 1)]
    differing = [r for r in sent if r.index in reruns and "".join(r.text) != reruns[r.index]]
    not_rerun = [r for r in sent if r.ended_once and r.index not in reruns]
    wrong = {r.index for r in (*lost, *failed, *differing, *not_rerun)} | {r.index for r in sent if r.num_duplicated}
    per_fault = []
    for fault in faults:
        stalls = [s for r in sent if not math.isnan(fault.at) and (s := stall_s(r, fault.at)) is not None]
        per_fault.append(
            {
                "kind": fault.kind,
                "target": fault.target,
                "note": fault.note,
                "in_flight": len(stalls),
                "stall_s": {
                    "p50": percentile(stalls, 50),
                    "p95": percentile(stalls, 95),
                    "max": max(stalls, default=float("nan")),
                },
            }
        )
    problems = [
        {
            "index": r.index,
            "body": r.body,
            "priority": r.priority,
            "errors": r.errors,
            "ends": r.num_ends,
            "ended": r.ended_at is not None,
            "interrupted": r.is_interrupted,
            "duplicated": r.num_duplicated,
            "reconnects": r.num_reconnects,
            "text": "".join(r.text),
            "rerun": reruns.get(r.index),
        }
        for r in sent
        if r.index in wrong
    ]
    totals = {
        "sent": len(sent),
        "ended_once": sum(r.ended_once for r in sent),
        "lost": len(lost),
        "interrupted": sum(r.is_interrupted for r in lost),
        "failed": len(failed),
        "duplicated": sum(r.num_duplicated for r in sent),
        "differing": len(differing),
        "compared": len(reruns),
        "not_rerun": len(not_rerun),
        "reconnected": sum(r.num_reconnects > 0 for r in sent),
    }
    return {
        "config": {
            "requests": args.requests,
            "brokers": 0 if args.bootstrap else args.brokers,
            "bootstrap": args.bootstrap,
            "workers": args.workers,
            "gateways": args.gateways,
            "concurrency": args.concurrency,
            "seed": args.seed,
            "quick": args.quick,
        },
        "load_s": load_s,
        "totals": totals,
        "faults": per_fault,
        "dead_at_end": dead,
        "problems": problems,
    }


def _print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    config, totals = report["config"], report["totals"]
    brokers = f"the cluster at {config['bootstrap']}" if config["bootstrap"] else f"{config['brokers']} broker(s)"
    print(
        f"\nweir chaos: {brokers}, {config['workers']} workers, {config['gateways']} gateways, "
        f"{config['requests']} requests ({config['concurrency']} at a time), load {report['load_s']:.0f} s"
    )
    print_table(
        [
            [
                str(totals[k])
                for k in (
                    "sent",
                    "ended_once",
                    "lost",
                    "interrupted",
                    "failed",
                    "duplicated",
                    "differing",
                    "compared",
                    "not_rerun",
                    "reconnected",
                )
            ]
        ],
        [
            "sent",
            "ended once",
            "lost",
            "(interrupted)",
            "failed",
            "duplicated tokens",
            "differing",
            "(compared)",
            "not rerun",
            "(reconnected)",
        ],
    )
    print()
    rows = []
    for f in report["faults"]:
        stall = f["stall_s"]
        figures = [f"{stall[k]:.2f}" if stall[k] == stall[k] else "-" for k in ("p50", "p95", "max")]
        rows.append([f"kill -9 {f['kind']}", f["target"], str(f["in_flight"]), *figures, f["note"]])
    print_table(rows, ["fault", "target", "streams in flight", "stall p50 s", "p95 s", "max s", "note"])
    for p in report["problems"][:10]:
        print(
            f"  request {p['index']}: errors {p['errors'][:1]}, ends {p['ends']}, interrupted {p['interrupted']}, "
            f"duplicated {p['duplicated']}, reconnects {p['reconnects']}, text {p['text'][:60]!r} / rerun "
            f"{(p['rerun'] or '')[:60]!r}"
        )
    if report["dead_at_end"]:
        print(f"  services dead at the end: {', '.join(report['dead_at_end'])}")


if __name__ == "__main__":
    sys.exit(main())
