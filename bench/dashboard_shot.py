"""`python -m bench.dashboard_shot`: a screenshot of the live dashboard (docs/dashboard.png).

A gateway runs in this process on a fresh topic prefix of a running broker (`--bootstrap`, e.g.
`weir kafka up`), with WEIR_GATEWAY_ADMIN_TOKEN set. The dashboard's inputs are then written where
the gateway reads them, and nowhere else: worker heartbeats, UsageTotals and HealthAlerts to their
topics, and latency/token observations to the gateway's own instruments (the names of
services/gateway/dashboard_data.py). Those figures are made up here, with no worker or model
behind them: the picture shows the page, not a measurement. Headless Chromium (bench/chromium.py)
opens /dashboard#token=..., waits until every panel holds data, and saves the page as PNG.

The test of the page (tests/gateway/test_dashboard_browser.py) feeds the same records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvicorn
from aiokafka import AIOKafkaProducer
from opentelemetry.metrics import Counter, Histogram

from schemas.codec import encode
from schemas.messages import VersionStatus, WorkerHeartbeat, now_ms
from schemas.telemetry import HealthAlert, UsageTotals
from schemas.topics import Topics
from weir.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, ServiceMetrics

REPO = Path(__file__).resolve().parents[1]
PANELS = ("throughput", "latency", "queue", "kv", "versions", "tenants", "alerts")
# True once every panel of the page shows data (data-state="ok").
ALL_PANELS_OK = "[...document.querySelectorAll('[data-panel]')].every(p => p.dataset.state === 'ok')"
MODELS = ("smollm2-135m-instruct@1", "weir-tiny-py@1")


def heartbeats(sent_ms: int) -> list[WorkerHeartbeat]:
    """Two workers with queues, KV usage and prefix-cache counts, and their versions' states."""
    ready = VersionStatus(state="ready", engine="torch-cpu")
    return [
        WorkerHeartbeat(
            worker_id="worker-a",
            models=list(MODELS),
            is_ready=True,
            num_running=6,
            num_waiting=3,
            max_num_seqs=8,
            free_kv_blocks=120,
            block_size_tokens=16,
            kv_cache_usage_perc=0.62,
            prefix_cache_queries=48_000,
            prefix_cache_hits=30_500,
            versions={MODELS[0]: ready, MODELS[1]: ready},
            sent_ms=sent_ms,
        ),
        WorkerHeartbeat(
            worker_id="worker-b",
            models=[MODELS[0]],
            is_ready=True,
            num_running=2,
            num_waiting=0,
            max_num_seqs=8,
            free_kv_blocks=400,
            block_size_tokens=16,
            kv_cache_usage_perc=0.18,
            prefix_cache_queries=9_000,
            prefix_cache_hits=2_100,
            versions={MODELS[0]: ready, "weir-tiny-py@2": VersionStatus(state="loading")},
            sent_ms=sent_ms,
        ),
    ]


def usage(day: str) -> list[UsageTotals]:
    """Today's totals of a few tenants (one with no price)."""
    rows = [
        ("acme", "svc-chat", MODELS[0], 410, 182_000, 64_000, 0.92),
        ("acme", "alice", MODELS[1], 35, 9_000, 4_100, 0.05),
        ("globex", "etl", MODELS[0], 120, 95_000, 22_000, 0.41),
        ("initech", "bob", MODELS[1], 12, 3_000, 900, None),
    ]
    return [
        UsageTotals(
            day=day,
            tenant=tenant,
            principal=principal,
            model_version=version,
            requests=requests,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cost_usd=cost,
        )
        for tenant, principal, version, requests, prompt, completion, cost in rows
    ]


def alerts(created_ms: int) -> list[HealthAlert]:
    """An entropy drift raised and open, a staleness raised and cleared."""
    return [
        HealthAlert(
            alert_id=f"a-{uuid.uuid4().hex[:8]}",
            model_version=MODELS[1],
            signal="freshness",
            state="raised",
            value=610.0,
            threshold=300.0,
            detail="no audited request for 610 s",
            created_ms=created_ms - 90_000,
        ),
        HealthAlert(
            alert_id=f"a-{uuid.uuid4().hex[:8]}",
            model_version=MODELS[1],
            signal="freshness",
            state="cleared",
            value=4.0,
            threshold=300.0,
            detail="audited requests again",
            created_ms=created_ms - 30_000,
        ),
        HealthAlert(
            alert_id=f"a-{uuid.uuid4().hex[:8]}",
            model_version=MODELS[0],
            signal="entropy",
            state="raised",
            value=3.9,
            baseline=2.1,
            threshold=3.5,
            detail="output entropy 3.9 nats against 2.1 at load",
            created_ms=created_ms - 12_000,
        ),
    ]


async def feed(bootstrap: str, topics: Topics, stop: asyncio.Event, ready: asyncio.Event) -> None:
    """Write today's usage totals and the alerts once, then the heartbeats every second (a worker
    is live for 10 s after its last one) until `stop`; `ready` is set after the first round."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        sent = now_ms()
        for totals in usage(today(sent)):
            await producer.send_and_wait(topics.token_usage, encode(totals), key=totals.key().encode())
        for alert in alerts(sent):
            await producer.send_and_wait(topics.health, encode(alert), key=alert.model_version.encode())
        while True:
            for heartbeat in heartbeats(now_ms()):
                await producer.send_and_wait(topics.workers, encode(heartbeat), key=heartbeat.worker_id.encode())
            ready.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set():
                return
    finally:
        await producer.stop()


@dataclass
class Instruments:
    """The gateway's latency histograms and token counter (the ones it has, else made here)."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    tokens: Counter
    lag: dict[tuple[str, str], float] = field(default_factory=dict)


def instruments(service: ServiceMetrics, owner: object) -> Instruments:
    """The gateway's own instruments of the dashboard's names when `owner` (its GatewayMetrics)
    holds them, else new ones on its ServiceMetrics, so the exposition never names one twice."""
    have = {getattr(value, "name", None): value for value in vars(owner).values()}

    def get(name: str, make: Callable[[], Any]) -> Any:
        return have.get(name) or make()

    found = Instruments(
        ttft=get(
            "weir_gateway_time_to_first_token_seconds",
            lambda: service.histogram("weir_gateway_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
        ),
        itl=get(
            "weir_gateway_inter_token_latency_seconds",
            lambda: service.histogram("weir_gateway_inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS),
        ),
        e2e=get(
            "weir_gateway_e2e_request_latency_seconds",
            lambda: service.histogram("weir_gateway_e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS),
        ),
        tokens=get(
            "weir_gateway_generation_tokens",
            lambda: service.counter("weir_gateway_generation_tokens", "Generated tokens."),
        ),
    )
    if "kafka_consumergroup_lag" not in have:
        service.gauge(
            "kafka_consumergroup_lag",
            "Records not yet consumed, per group and topic.",
            lambda: [(value, {"consumergroup": g, "topic": t}) for (g, t), value in found.lag.items()],
        )
    return found


def observe_request(found: Instruments, rng: random.Random, model: str) -> None:
    """One made-up streamed request: TTFT, its tokens' gaps, its latency and token count."""
    tokens = rng.randint(20, 120)
    ttft = rng.lognormvariate(-2.3, 0.5)
    gaps = [rng.lognormvariate(-3.6, 0.3) for _ in range(tokens - 1)]
    labels = {"model_name": model}
    found.ttft.record(ttft, labels)
    for gap in gaps:
        found.itl.record(gap, labels)
    found.e2e.record(ttft + sum(gaps), labels)
    found.tokens.add(tokens, labels)


async def traffic(found: Instruments, topics: Topics, stop: asyncio.Event, per_s: float = 8.0) -> None:
    """Made-up requests at `per_s` a second, and a lag that moves, until `stop`."""
    rng = random.Random(7)
    while not stop.is_set():
        observe_request(found, rng, rng.choice(MODELS))
        found.lag[(topics.batcher_group, topics.requests)] = float(rng.randint(0, 40))
        found.lag[(topics.auditor_group, topics.audit)] = float(rng.randint(0, 12))
        for model in MODELS:  # the longest names a deployment shows: a version's worker group and batch topic
            found.lag[(topics.worker_group(model), topics.batches(model))] = float(rng.randint(0, 6))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1 / per_s)


def today(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d")


async def shoot(bootstrap: str, out: Path, warm_s: float, port: int) -> None:
    from bench.chromium import Browser, find_browser
    from services.gateway.app import create_app
    from services.gateway.config import GatewaySettings
    from weir.kafka.admin import delete_prefixed_topics, ensure_topics

    binary = find_browser()
    if binary is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    topics, token = Topics(prefix=f"shot{uuid.uuid4().hex[:6]}"), uuid.uuid4().hex
    await ensure_topics(bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO / "models.toml"),
        gateway_admin_token=token,
        auth_mode="open",
    )
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    stop = asyncio.Event()
    try:
        while not server.started:
            if serving.done():
                raise SystemExit("the gateway did not start")
            await asyncio.sleep(0.1)
        found = instruments(app.state.guard.metrics.service, app.state.guard.metrics)
        fed = asyncio.Event()
        load = [
            asyncio.create_task(traffic(found, topics, stop)),
            asyncio.create_task(feed(bootstrap, topics, stop, fed)),
        ]
        await asyncio.wait_for(fed.wait(), 30)
        await asyncio.sleep(warm_s)
        async with Browser(binary, width=1400, height=1150) as browser:
            await browser.goto(f"http://127.0.0.1:{port}/dashboard#token={token}")
            await browser.wait_for(ALL_PANELS_OK, timeout_s=30)
            await asyncio.sleep(20)  # ten polls, so the charts have lines
            await browser.screenshot(out)
        stop.set()
        await asyncio.gather(*load)
    finally:
        stop.set()
        server.should_exit = True
        await serving
        await delete_prefixed_topics(bootstrap, topics.prefix)
    print(f"wrote {out}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard_shot", description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    parser.add_argument("--warm-s", type=float, default=8.0, help="made-up traffic before the page opens")
    parser.add_argument("--port", type=int, default=0, help="the gateway's HTTP port (0: a free one)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    asyncio.run(shoot(args.bootstrap, args.out, args.warm_s, args.port or free_port()))
    print(f"in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
