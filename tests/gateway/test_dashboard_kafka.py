"""The live dashboard of a gateway on the real broker: /dashboard/data from the topics it follows and
its own metrics, behind the admin token; and the page in headless Chromium during traffic, every
panel empty ("no data yet") before its data comes and holding it after."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import pytest
from aiokafka import AIOKafkaProducer

from bench.chromium import Browser, find_browser
from bench.dashboard_shot import ALL_PANELS_OK, PANELS, Instruments, feed, instruments, observe_request, traffic
from schemas.codec import encode
from schemas.messages import VersionStatus, WorkerHeartbeat, now_ms
from schemas.telemetry import HealthAlert, UsageTotals
from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

from .conftest import REPO_TOML
from .fakes import FakeWorker, GatewayServer, eventually

pytestmark = pytest.mark.kafka

TOKEN = "dash-" + uuid.uuid4().hex
ADMIN = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Dashboard:
    bootstrap: str
    topics: Topics
    server: GatewayServer
    found: Instruments

    @property
    def base_url(self) -> str:
        return self.server.base_url


@pytest.fixture
async def dashboard(gateway_bootstrap: str) -> AsyncIterator[Dashboard]:
    """A gateway with an admin token on a fresh prefix (its own, so every test starts with no data)."""
    topics = Topics(prefix=f"t{uuid.uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        auth_mode="open",
        gateway_admin_token=TOKEN,
    )
    app = create_app(settings)
    server = GatewayServer(app)
    await server.start()
    try:
        found = instruments(app.state.guard.metrics.service, app.state.guard.metrics)
        yield Dashboard(gateway_bootstrap, topics, server, found)
    finally:
        await server.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


async def _send(bootstrap: str, records: list[tuple[str, bytes | None, bytes | None]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for topic, key, value in records:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


async def test_the_page_is_static_self_contained_and_its_data_takes_the_admin_token(dashboard):
    async with httpx.AsyncClient(base_url=dashboard.base_url) as client:
        page = await client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert not re.search(r"(src|href)=\"(?!/dashboard/static/)", page.text)  # nothing from elsewhere
        assert "http://" not in page.text and "https://" not in page.text and TOKEN not in page.text
        for path in re.findall(r"(?:src|href)=\"(/dashboard/static/[^\"]+)\"", page.text):
            assert (await client.get(path)).status_code == 200, path
        missing = await client.get("/dashboard/static/..%2Fapp.py")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

        for headers in ({}, {"authorization": "Bearer not-the-token"}):
            refused = await client.get("/dashboard/data", headers=headers)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
        empty = (await client.get("/dashboard/data", headers=ADMIN)).json()
    # Nothing observed yet: no data, not zeros.
    assert empty["throughput"] is None and empty["lag"] is None
    assert empty["latency"] == {"ttft": None, "itl": None, "e2e": None, "worker_ttft": None, "worker_itl": None}
    assert empty["workers"] == [] and empty["tenants"]["top"] == []
    assert empty["alerts"] == {"recent": [], "open": [], "skipped": 0, "sla": {}}
    assert {v["name"] for v in empty["versions"]} >= {"echo", "smollm2-135m-instruct"}  # the seed, not ready


async def test_data_comes_from_the_topics_and_the_gateways_metrics_and_bad_records_are_skipped(dashboard):
    topics, sent = dashboard.topics, now_ms()
    day = datetime.fromtimestamp(sent / 1000, UTC).strftime("%Y-%m-%d")
    heartbeat = WorkerHeartbeat(
        worker_id="w1",
        models=["echo@1"],
        is_ready=True,
        num_running=3,
        num_waiting=5,
        max_num_seqs=8,
        free_kv_blocks=10,
        block_size_tokens=16,
        kv_cache_usage_perc=0.75,
        prefix_cache_queries=400,
        prefix_cache_hits=100,
        versions={"echo@1": VersionStatus(state="ready")},
        sent_ms=sent,
    )
    totals = UsageTotals(
        day=day,
        tenant="acme",
        principal="p",
        model_version="echo@1",
        requests=3,
        prompt_tokens=30,
        completion_tokens=12,
        cost_usd=0.25,
    )
    alert = HealthAlert(
        alert_id="al-1",
        model_version="echo@1",
        signal="watermark",
        state="raised",
        value=0.2,
        threshold=0.5,
        created_ms=sent,
    )
    await _send(
        dashboard.bootstrap,
        [
            (topics.workers, b"w1", encode(heartbeat)),
            (topics.token_usage, totals.key().encode(), encode(totals)),
            (topics.token_usage, b"usage\x1fnot-its-key", encode(totals)),  # forged key: skipped
            (topics.health, b"echo@1", encode(alert)),
            (topics.health, b"echo@1", b'{"alert_id": 5}'),  # not a HealthAlert: skipped
        ],
    )
    dashboard.found.lag[("g1", topics.requests)] = 7.0
    rng = random.Random(1)
    async with httpx.AsyncClient(base_url=dashboard.base_url, headers=ADMIN) as client:

        async def report() -> dict:
            return (await client.get("/dashboard/data")).json()

        async def has_all() -> dict | None:
            data = await report()
            return data if data["workers"] and data["tenants"]["top"] and data["alerts"]["open"] else None

        await until(has_all, timeout_s=10, what="workers, tenants and an open alert on the dashboard")
        # The window's start is a snapshot the sampler takes (every SAMPLE_EVERY_S): wait for one
        # taken from now on, so the 10 observations below are all inside the window.
        window = dashboard.server.server.config.app.state.dashboard.metrics
        asked_s = time.monotonic()
        await until(
            lambda: window._snapshots and window._snapshots[-1].at_s >= asked_s,
            timeout_s=10,
            what="the dashboard sampler's next snapshot",
        )
        for _ in range(10):
            observe_request(dashboard.found, rng, "echo@1")
        data = await report()
    assert data["workers"] == [
        {
            "worker_id": "w1",
            "num_running": 3,
            "num_waiting": 5,
            "max_num_seqs": 8,
            "kv_cache_usage_perc": 0.75,
            "prefix_cache_hit_rate": 0.25,
            "prefix_cache_queries": 400,
            "versions": {"echo@1": "ready"},
            "age_ms": data["workers"][0]["age_ms"],
        }
    ]
    assert data["tenants"]["top"] == [
        {
            "tenant": "acme",
            "requests": 3,
            "prompt_tokens": 30,
            "completion_tokens": 12,
            "tokens": 42,
            "cost_usd": 0.25,
            "unpriced": False,
        }
    ]
    assert data["tenants"]["skipped"] == 1 and data["alerts"]["skipped"] == 1
    assert [a["alert_id"] for a in data["alerts"]["open"]] == ["al-1"]
    assert data["lag"] == [{"consumergroup": "g1", "topic": topics.requests, "lag": 7.0}]
    assert data["latency"]["ttft"]["by_model"]["echo@1"]["count"] == 10
    assert data["latency"]["ttft"]["all"]["p50"] > 0 and data["throughput"]["tokens_per_s"] > 0
    assert next(v for v in data["versions"] if v["name"] == "echo")["state"] == "ready"


async def test_plain_json_requests_have_a_time_to_first_token_and_inter_token_rows(dashboard):
    """Issue 35: after plain (stream=false) chat requests the latency panel had end-to-end rows only.
    The gateway times their first token and the gaps as they arrive (as vLLM records TTFT for every
    request), under stream="false"."""
    worker = FakeWorker(dashboard.bootstrap, dashboard.topics)  # deltas "Hello", ", ", "world", then the end
    await worker.start()
    app = dashboard.server.server.config.app
    try:
        await eventually(lambda: app.state.bus.readiness()[0], timeout_s=60)  # it reads its replies
        async with httpx.AsyncClient(base_url=dashboard.base_url, timeout=20) as client:
            await asyncio.sleep(2.5)  # the sampler's next snapshot starts a window
            for _ in range(8):
                answer = await client.post(
                    "/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
                )
                assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Hello, world"
            data = (await client.get("/dashboard/data", headers=ADMIN)).json()
            metrics = (await client.get("/metrics")).text
    finally:
        await worker.stop()
    latency = data["latency"]
    assert latency["e2e"]["by_model"]["echo@1"]["count"] == 8
    assert latency["ttft"]["by_model"]["echo@1"]["count"] == 8 and latency["ttft"]["all"]["p50"] > 0
    assert latency["itl"]["by_model"]["echo@1"]["count"] == 16  # three deltas each: two gaps
    assert 'weir_gateway_time_to_first_token_seconds_count{model_name="echo@1",stream="false"} 8' in metrics


@pytest.mark.skipif(find_browser() is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
async def test_the_page_in_chromium_shows_no_data_then_every_panel_during_traffic(dashboard, tmp_path):
    async with Browser(find_browser() or "", width=1400, height=1100) as browser:
        await browser.goto(f"{dashboard.base_url}/dashboard#token={TOKEN}")
        await browser.wait_for("document.getElementById('status').dataset.state === 'ok'", timeout_s=30)
        states = await browser.evaluate(
            "Object.fromEntries([...document.querySelectorAll('[data-panel]')].map("
            "p => [p.dataset.panel, [p.dataset.state, p.querySelector('.empty').textContent]]))"
        )
        assert await browser.evaluate("location.hash") == ""  # the token left the address bar
        for panel in PANELS:
            if panel != "versions":  # the seeded versions are known from the start
                state, text = states[panel]
                assert state == "empty" and ("no data yet" in text or text == "no alerts"), (panel, states[panel])

        stop, fed = asyncio.Event(), asyncio.Event()
        worker = FakeWorker(dashboard.bootstrap, dashboard.topics)  # answers the requests below
        await worker.start()
        loops = [
            asyncio.create_task(feed(dashboard.bootstrap, dashboard.topics, stop, fed)),
            asyncio.create_task(traffic(dashboard.found, dashboard.topics, stop)),
            asyncio.create_task(_requests(dashboard.base_url, stop)),
        ]
        try:
            await browser.wait_for(ALL_PANELS_OK, timeout_s=45)
            # At 1400 px every column fits its panel (the queue's lag and the versions' last columns
            # were cut off behind the next panel): nothing is wider than the panel it is in.
            overflowing = await browser.evaluate(
                "[...document.querySelectorAll('[data-panel]')].filter(p => p.scrollWidth > p.clientWidth + 1 || "
                "[...p.querySelectorAll('table')].some(t => t.getBoundingClientRect().right > "
                "p.getBoundingClientRect().right)).map(p => p.dataset.panel)"
            )
            text = await browser.evaluate("document.querySelector('main').innerText")
            tokens_per_s = await browser.evaluate("document.querySelector('[data-field=tokens_per_s]').textContent")
            await browser.screenshot(tmp_path / "dashboard.png")
        finally:
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
            await worker.stop()
    assert overflowing == []
    assert float(tokens_per_s) > 0
    for expected in (
        "worker-a",
        "62.0%",
        "63.5%",
        "acme",
        "globex",
        "entropy",
        "open",
        "time to first token",
        f"{dashboard.topics.batcher_group}",
        "smollm2-135m-instruct@1",
    ):
        assert expected in text, expected
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def _requests(base_url: str, stop: asyncio.Event) -> None:
    """Chat requests through the gateway, one after another, until `stop` (the fake worker answers)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                await client.post(
                    "/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
                )
            await asyncio.sleep(0.1)  # the traffic's pace: about ten requests a second for the page to show
