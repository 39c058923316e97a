"""`weir bench failover`: a worker killed -9 under concurrent seeded streams: what clients saw.

The services run here as processes on a private topic prefix (auditor, batcher, gateway, and the
workers of each scenario, all serving `--model`). Each scenario starts its workers, waits until
they own the partitions of the model's batch topic, opens `--streams` concurrent seeded streams,
kills with -9 the worker running the most of them half a second after the first token, and waits
for every stream to end; then it asks each request again, whole and unstreamed, and compares.

Scenarios, side by side in one run (docs/design.md, "Scale-out and failover"):
- failover: two workers, one killed, not restarted: the survivor takes its partitions once the
  group session expires and regenerates its batches (static and dynamic membership; and the
  session timeout before this bench, 6000 ms, for comparison).
- restart in place: one worker, killed and started again at once under the same name (static:
  the same group.instance.id) or as a new member (dynamic).

Per scenario it prints: streams, in flight at the kill, ended once (one finish and [DONE], no
error), differing from the seeded rerun, the stall (the largest gap between two consecutive
tokens a client saw after the kill, over the streams in flight, the survivor's own included)
p50/p95/max, and the median time from the kill to the token that ended each such gap (when the
stream resumed; for a restart in place, its first new token).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.sse_client import SseConnection
from bench.stats import percentile, print_table
from schemas.codec import decode
from schemas.messages import WorkerHeartbeat, now_ms
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
class Stream:
    """One client stream: when each token chunk arrived, its text, how it ended."""

    body: dict
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    def ended_once(self) -> bool:
        return self.done and self.error is None and len(self.finishes) == 1

    def stall_after(self, t: float) -> tuple[float, float] | None:
        """The largest gap between consecutive tokens with the later one after `t`, and when (after
        `t`) that later token came: the stream resumed then (None: it had ended, or not started, by `t`)."""
        if not self.arrivals or self.arrivals[0] > t or self.arrivals[-1] < t:
            return None
        gaps = [(b - a, b - t) for a, b in zip(self.arrivals, self.arrivals[1:], strict=False) if b >= t]
        return max(gaps, default=None)


@dataclass
class Scenario:
    name: str
    workers: int
    static: bool
    session_ms: int
    restart: bool
    streams: list[Stream] = field(default_factory=list)
    killed_at: float = 0.0
    differing: int = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weir bench failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="weir-tiny-py", help="model entry of --model-repo (default %(default)s)")
    parser.add_argument("--model-repo", default="models.toml")
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--session-ms", type=int, default=2000, help="WEIR_WORKER_SESSION_TIMEOUT_MS of the workers")
    parser.add_argument(
        "--baseline-session-ms",
        type=int,
        default=6000,
        help="the session of the comparison failover scenario (0: skip it)",
    )
    parser.add_argument("--kinds", default="failover,restart", help="which scenarios: failover, restart or both")
    args = parser.parse_args(argv)
    kinds = {k.strip() for k in args.kinds.split(",")}
    if not kinds or not kinds <= {"failover", "restart"}:
        parser.error(f"--kinds takes failover and/or restart, not {args.kinds!r}")
    scenarios = [
        Scenario("failover, static", 2, True, args.session_ms, restart=False),
        Scenario("failover, dynamic", 2, False, args.session_ms, restart=False),
        Scenario("restart in place, static", 1, True, args.session_ms, restart=True),
        Scenario("restart in place, dynamic", 1, False, args.session_ms, restart=True),
    ]
    if args.baseline_session_ms:
        scenarios.insert(2, Scenario("failover, dynamic", 2, False, args.baseline_session_ms, restart=False))
    scenarios = [s for s in scenarios if ("restart" if s.restart else "failover") in kinds]
    asyncio.run(_run(args, scenarios))
    _report(scenarios)
    return 0


async def _run(args, scenarios: list[Scenario]) -> None:
    from schemas.model_repo import load_model_repo
    from weir.kafka import launcher
    from weir.kafka.admin import delete_prefixed_topics, deployment_specs, ensure_topics
    from weir.stack import Stack, free_ports, wait_http_ok

    broker = launcher.BrokerConfig.from_env()
    await launcher.up(broker, 120)
    topics = Topics(f"benchfail{uuid.uuid4().hex[:6]}")
    repo = load_model_repo(args.model_repo)
    await ensure_topics(broker.bootstrap, deployment_specs(topics, repo))
    scratch = Path(tempfile.mkdtemp(prefix="weir-bench-failover-"))
    env = {
        "WEIR_KAFKA_BOOTSTRAP": broker.bootstrap,
        "WEIR_TOPIC_PREFIX": topics.prefix,
        "WEIR_MODEL_REPO": str(Path(args.model_repo).resolve()),
        "WEIR_MODELS": args.model,
        "WEIR_AUTH_MODE": "open",
        "WEIR_AUDIT_DB": str(scratch / "audit.sqlite"),
        "WEIR_AUDIT_API_PORT": "0",
        "WEIR_AUDIT_FINGERPRINT_MODEL": "",
        "PYTHONUNBUFFERED": "1",
    }
    stack = Stack(env, scratch / "logs")
    port = free_ports(1)[0]
    try:
        for name in ("auditor", "batcher"):
            stack.start(name)
        stack.start("gateway", extra_env={"WEIR_GATEWAY_PORT": str(port)})
        await asyncio.to_thread(wait_http_ok, f"{stack.url('batcher')}/readyz", 300, stack)
        await asyncio.to_thread(wait_http_ok, f"{stack.url('gateway')}/healthz", 300, stack)  # ready once a worker is
        for n, scenario in enumerate(scenarios):
            names = [f"w{n}-{k}" for k in range(scenario.workers)]
            for name in names:
                stack.own_env[name] = {
                    "WEIR_WORKER_SESSION_TIMEOUT_MS": str(scenario.session_ms),
                    **({"WEIR_WORKER_INSTANCE": name} if scenario.static else {}),
                }
                stack.start(name, service="worker")
            for name in names:
                await asyncio.to_thread(wait_http_ok, f"{stack.url(name)}/readyz", 300, stack)
            await _until_owners(broker.bootstrap, topics, args.model, names, stack)
            await asyncio.to_thread(wait_http_ok, f"{stack.url('gateway')}/readyz", 60, stack)
            await _scenario(scenario, stack, names, port, args)
            for name in names:
                if name in stack.procs:
                    stack.kill(name, signal.SIGTERM)
            _report([scenario])  # as it ends: a later scenario that fails loses nothing
            print(flush=True)
    except BaseException:
        for name in stack.procs:
            print(f"--- {name} ---\n{stack.log_tail(name)}")
        raise
    finally:
        stack.stop_all()
        await delete_prefixed_topics(broker.bootstrap, topics.prefix)
        shutil.rmtree(scratch, ignore_errors=True)


async def _until_owners(
    bootstrap: str, topics: Topics, model: str, names: list[str], stack, timeout_s: float = 120
) -> None:
    """Until as many fresh heartbeats as `names` list partitions of the model's batch topic, and no
    other fresh one does (the previous scenario's workers are gone): the group settled on them."""
    from weir.bus import BusSettings, read_topic

    settings = BusSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        latest: dict[str, WorkerHeartbeat] = {}
        for _key, value in await read_topic(settings, topics.workers, client_id="bench-failover"):
            hb = decode(WorkerHeartbeat, value)
            latest[hb.worker_id] = hb
        owners = [
            hb
            for hb in latest.values()
            if now_ms() - hb.sent_ms < 2500
            and any(served_id.startswith(f"{model}@") and parts for served_id, parts in hb.partitions.items())
        ]
        if len(owners) == len(names) and sum(len(p) for hb in owners for p in hb.partitions.values()) > 0:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"workers {names} never owned the batch topic's partitions: {stack.log_tail(names[0])}")


async def _scenario(scenario: Scenario, stack, names: list[str], port: int, args) -> None:
    scenario.streams = [
        Stream(
            {
                "model": args.model,
                "prompt": PROMPTS[i % len(PROMPTS)] + f"# task {i}\n",
                "max_tokens": args.max_tokens,
                "temperature": 0.8,
                "seed": 7000 + i,
                "stream": True,
            }
        )
        for i in range(args.streams)
    ]
    first = asyncio.Event()
    tasks = [asyncio.create_task(_stream(port, s, first)) for s in scenario.streams]
    await asyncio.wait_for(first.wait(), 120)
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(timeout=5) as client:
        running = {name: await _num_running(client, stack.url(name)) for name in names}
    victim = max(running, key=lambda name: running[name])
    stack.kill(victim)
    scenario.killed_at = time.perf_counter()
    if scenario.restart:
        stack.start(victim, service="worker")
    await asyncio.wait_for(asyncio.gather(*tasks), 300)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        again = await asyncio.gather(
            *(client.post("/v1/completions", json={**s.body, "stream": False}) for s in scenario.streams)
        )
    scenario.differing = sum(
        1
        for s, r in zip(scenario.streams, again, strict=True)
        if r.status_code != 200 or r.json()["choices"][0]["text"] != s.text
    )


async def _num_running(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("weir_worker_num_running{")
    )


async def _stream(port: int, stream: Stream, first: asyncio.Event) -> None:
    connection = SseConnection("127.0.0.1", port)
    try:
        async for data in connection.post_events("/v1/completions", orjson.dumps(stream.body)):
            if data == b"[DONE]":
                stream.done = True
                continue
            chunk = orjson.loads(data)
            if "error" in chunk:
                stream.error = str(chunk["error"].get("message"))[:200]
                continue
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stream.arrivals.append(time.perf_counter())
                    stream.text += choice["text"]
                    first.set()
                if choice.get("finish_reason"):
                    stream.finishes.append(choice["finish_reason"])
    except Exception as exc:  # noqa: BLE001 - a cut connection is a failed stream: counted, not raised
        stream.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        await connection.close()


def _report(scenarios: list[Scenario]) -> None:
    rows = []
    for s in scenarios:
        stalls = [g for st in s.streams if (g := st.stall_after(s.killed_at)) is not None]
        gaps, resumed = [g for g, _ in stalls], [r for _, r in stalls]
        rows.append(
            [
                s.name,
                str(s.session_ms),
                str(len(s.streams)),
                str(len(stalls)),
                str(sum(st.ended_once() for st in s.streams)),
                str(s.differing),
                *(f"{percentile(gaps, q):.2f}" for q in (50, 95, 100)),
                f"{percentile(resumed, 50):.2f}",
            ]
        )
    print_table(
        rows,
        [
            "scenario",
            "session ms",
            "streams",
            "in flight",
            "ended once",
            "differing",
            "stall p50 s",
            "stall p95 s",
            "stall max s",
            "resumed after kill p50 s",
        ],
    )
