"""GET /metrics: OpenTelemetry instruments rendered as Prometheus text, workers from heartbeats."""

from __future__ import annotations

from pathlib import Path

import httpx

from schemas.messages import DeviceInfo, WorkerHeartbeat
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.metrics import GatewayMetrics

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"


def heartbeat() -> WorkerHeartbeat:
    gpu = DeviceInfo(kind="cuda", name='NVIDIA "H200"', memory_total_bytes=141_000_000_000,
                     memory_free_bytes=100_000_000_000, utilization_pct=87.5)  # fmt: skip
    return WorkerHeartbeat(worker_id="w1", models=["echo", "tiny"], is_ready=True, num_running=3, num_waiting=1,
                           max_num_seqs=64, free_kv_blocks=1234, block_size_tokens=16, devices=[gpu])  # fmt: skip


def test_render_covers_counters_gauges_and_devices() -> None:
    metrics = GatewayMetrics(lambda: [heartbeat()], lambda: {"other"})
    metrics.requests.add(2, {"route": "/v1/completions", "status": "200"})
    metrics.in_flight.add(1, {"model": "echo", "lane": "bulk"})
    metrics.cancellations.add(1, {"reason": "client_disconnect"})
    metrics.rate_limited.add(1, {"scope": "tenant", "limit": "tokens"})
    text = metrics.render()
    lines = set(text.splitlines())
    assert "# TYPE weir_gateway_requests_total counter" in lines
    assert 'weir_gateway_requests_total{route="/v1/completions",status="200"} 2' in lines
    assert "# TYPE weir_gateway_in_flight gauge" in lines
    assert 'weir_gateway_in_flight{lane="bulk",model="echo"} 1' in lines
    assert 'weir_gateway_cancellations_total{reason="client_disconnect"} 1' in lines
    assert 'weir_gateway_rate_limited_total{limit="tokens",scope="tenant"} 1' in lines
    assert 'weir_workers_live{model="tiny"} 1' in lines
    assert 'weir_gateway_breaker_open{model="other"} 1' in lines
    assert 'weir_worker_free_kv_blocks{worker="w1"} 1234' in lines
    device = 'device="0",kind="cuda",name="NVIDIA \\"H200\\"",worker="w1"'
    assert f"weir_worker_device_memory_total_bytes{{{device}}} 141000000000" in lines
    assert f"weir_worker_device_utilization_pct{{{device}}} 87.5" in lines
    metrics.shutdown()


async def test_metrics_endpoint_needs_no_credentials_and_counts_responses() -> None:
    app = create_app(GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        assert (await client.post("/v1/completions", json={"model": "echo", "prompt": "x"})).status_code == 401
        await client.get("/nowhere")
        response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'weir_gateway_requests_total{route="/v1/completions",status="401"} 1' in response.text
    assert 'weir_gateway_requests_total{route="unmatched",status="404"} 1' in response.text
    assert 'weir_gateway_auth_failures_total{code="missing_api_key"} 1' in response.text
