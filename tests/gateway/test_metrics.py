"""GET /metrics: OpenTelemetry instruments rendered as Prometheus text, workers from heartbeats,
generations timed as the client sees them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from schemas.messages import DeviceInfo, GenerateRequest, ReplyDelta, ReplyEnd, Usage, WorkerHeartbeat, now_ms
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.guard.output_guard import PassThrough
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.metrics import GatewayMetrics, GenerationTimer
from services.gateway.openai_format import ApiError, ChunkWriter
from services.gateway.streaming import collect, frames
from weir.metrics import CONTENT_TYPE, samples, value

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"


def heartbeat() -> WorkerHeartbeat:
    gpu = DeviceInfo(
        kind="cuda",
        name='NVIDIA "H200"',
        memory_total_bytes=141_000_000_000,
        memory_free_bytes=100_000_000_000,
        utilization_pct=87.5,
    )
    return WorkerHeartbeat(
        worker_id="w1",
        models=["echo", "tiny"],
        is_ready=True,
        num_running=3,
        num_waiting=1,
        max_num_seqs=64,
        free_kv_blocks=1234,
        block_size_tokens=16,
        devices=[gpu],
    )


def test_render_covers_counters_gauges_and_devices() -> None:
    metrics = GatewayMetrics(lambda: [heartbeat()], lambda: {"other"})
    metrics.requests.add(2, {"route": "/v1/completions", "status": "200", "code": ""})
    metrics.in_flight.add(1, {"model": "echo", "lane": "bulk"})
    metrics.cancellations.add(1, {"reason": "client_disconnect"})
    metrics.rate_limited.add(1, {"scope": "tenant", "limit": "tokens"})
    text = metrics.render()
    assert "# TYPE weir_gateway_requests_total counter" in text.splitlines()
    assert value(text, "weir_gateway_requests_total", route="/v1/completions", status="200", code="") == 2
    assert "# TYPE weir_gateway_in_flight gauge" in text.splitlines()
    assert value(text, "weir_gateway_in_flight", lane="bulk", model="echo") == 1
    assert value(text, "weir_gateway_cancellations_total", reason="client_disconnect") == 1
    assert value(text, "weir_gateway_rate_limited_total", limit="tokens", scope="tenant") == 1
    assert value(text, "weir_workers_live", model="tiny") == 1
    assert value(text, "weir_gateway_breaker_open", model="other") == 1
    assert value(text, "weir_worker_free_kv_blocks", worker="w1") == 1234
    device = frozenset({"device": "0", "kind": "cuda", "name": 'NVIDIA "H200"', "worker": "w1"}.items())
    parsed = samples(text)  # value() cannot take a label called "name"
    assert parsed[("weir_worker_device_memory_total_bytes", device)] == 141_000_000_000
    assert parsed[("weir_worker_device_utilization_pct", device)] == 87.5
    metrics.shutdown()


async def test_metrics_endpoint_needs_no_credentials_and_counts_responses_by_status_and_code() -> None:
    app = create_app(GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        assert (await client.post("/v1/completions", json={"model": "echo", "prompt": "x"})).status_code == 401
        await client.get("/nowhere")
        too_big = await client.post("/v1/completions", content=b"x" * (2 << 20))  # refused by the limits middleware
        assert too_big.status_code == 413
        await client.get("/healthz")
        response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"] == CONTENT_TYPE
    text = response.text
    requests = "weir_gateway_requests_total"
    assert value(text, requests, route="/v1/completions", status="401", code="missing_api_key") == 1
    assert value(text, requests, route="unmatched", status="404", code="not_found") == 1
    assert value(text, requests, route="unmatched", status="413", code="request_too_large") == 1
    assert value(text, requests, route="/healthz", status="200", code="") == 1
    assert value(text, "weir_gateway_auth_failures_total", code="missing_api_key") == 1


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def buckets(text: str, name: str, **labels: str) -> dict[str, float]:
    """{le: cumulative count} of one histogram series."""
    out = {}
    for (sample, pairs), count in samples(text).items():
        found = dict(pairs)
        le = found.pop("le", None)
        if sample == f"{name}_bucket" and found == labels and le is not None:
            out[le] = count
    return out


def test_a_timer_puts_known_timings_in_the_right_buckets() -> None:
    metrics = GatewayMetrics(list, set)
    clock = Clock()
    timer = GenerationTimer(metrics, "m@1", "chat.completions", clock(), clock)
    for at in (100.03, 100.09, 100.27):  # TTFT 0.03; ITL 0.06 and 0.18
        clock.now = at
        timer.on_content()
    clock.now = 100.7
    timer.on_end(
        ReplyEnd(request_id="r", seq=3, finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=3)), None
    )
    timer.on_end(ReplyEnd(request_id="r", seq=3, finish_reason="stop"), None)  # a second end counts nothing
    text = metrics.render()
    metrics.shutdown()
    ttft = buckets(text, "weir_gateway_time_to_first_token_seconds", model_name="m@1", stream="true")
    assert (ttft["0.02"], ttft["0.04"], ttft["+Inf"]) == (0, 1, 1)
    itl = buckets(text, "weir_gateway_inter_token_latency_seconds", model_name="m@1", stream="true")
    assert (itl["0.05"], itl["0.075"], itl["0.15"], itl["0.2"], itl["+Inf"]) == (0, 1, 1, 2, 2)
    e2e = buckets(text, "weir_gateway_e2e_request_latency_seconds", model_name="m@1")
    assert (e2e["0.5"], e2e["0.8"], e2e["+Inf"]) == (0, 1, 1)
    assert abs(value(text, "weir_gateway_e2e_request_latency_seconds_sum", model_name="m@1") - 0.7) < 1e-9
    assert value(text, "weir_gateway_generation_tokens_total", model_name="m@1") == 3
    gen_ai = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "weir",
        "gen_ai_request_model": "m",
        "gen_ai_response_model": "m@1",
    }
    usage = "gen_ai_client_token_usage"
    assert value(text, f"{usage}_sum", **gen_ai, gen_ai_token_type="input") == 5
    assert value(text, f"{usage}_sum", **gen_ai, gen_ai_token_type="output") == 3
    assert buckets(text, usage, **gen_ai, gen_ai_token_type="output")["4"] == 1
    duration = buckets(text, "gen_ai_client_operation_duration_seconds", **gen_ai)
    assert (duration["0.64"], duration["1.28"]) == (0, 1)


def test_an_error_terminal_is_an_error_type_of_the_operation_duration() -> None:
    metrics = GatewayMetrics(list, set)
    clock = Clock()
    timer = GenerationTimer(metrics, "m@1", "completions", clock(), clock)
    clock.now += 2
    timer.on_end(ReplyEnd(request_id="r", seq=0, finish_reason="timeout"), "deadline_exceeded")
    text = metrics.render()
    metrics.shutdown()
    labels = {
        "gen_ai_operation_name": "text_completion",
        "gen_ai_provider_name": "weir",
        "gen_ai_request_model": "m",
        "gen_ai_response_model": "m@1",
    }
    assert value(text, "gen_ai_client_operation_duration_seconds_count", **labels, error_type="deadline_exceeded") == 1
    assert value(text, "gen_ai_client_operation_duration_seconds_count", **labels) is None
    assert (
        buckets(text, "weir_gateway_time_to_first_token_seconds", model_name="m@1", stream="true") == {}
    )  # no content


async def test_frames_time_each_content_write_after_it_was_taken_and_the_terminal() -> None:
    bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1"))
    request = GenerateRequest(
        request_id="r1",
        model="echo@1",
        prompt="hi",
        deadline_ms=now_ms() + 10_000,
        reply_to=bus.reply_topic,
        stream=True,
    )
    exchange = Exchange(bus, request, bus.router.register("r1"))
    for seq, text in enumerate(("a", "", "b")):  # an empty delta releases no text: no frame, no timing
        bus.router.on_event(ReplyDelta(request_id="r1", seq=seq, text=text))
    bus.router.on_event(ReplyEnd(request_id="r1", seq=3, finish_reason="stop", usage=Usage(completion_tokens=2)))
    metrics = GatewayMetrics(list, set)
    clock = Clock()
    timer = GenerationTimer(metrics, "echo@1", "completions", clock(), clock)
    writer = ChunkWriter("completions", "r1", "echo@1", 0, include_usage=False)
    seen = []
    async for _, frame in frames(exchange, writer, PassThrough(), timer):
        assert not isinstance(frame, ApiError)
        seen.append(frame)
        clock.now += 0.5  # the write of this frame takes 0.5 s: timed once the reader asks for more
    text = metrics.render()
    metrics.shutdown()
    assert len(seen) == 3  # "a", "b", the finish chunk
    ttft = buckets(text, "weir_gateway_time_to_first_token_seconds", model_name="echo@1", stream="true")
    assert (ttft["0.25"], ttft["0.5"]) == (0, 1)
    assert value(text, "weir_gateway_inter_token_latency_seconds_sum", model_name="echo@1", stream="true") == 0.5
    assert value(text, "weir_gateway_e2e_request_latency_seconds_sum", model_name="echo@1") == 1.0
    assert value(text, "weir_gateway_generation_tokens_total", model_name="echo@1") == 2


async def test_a_json_answer_times_its_first_token_and_the_gaps_as_they_reach_the_gateway() -> None:
    """stream=false: the client sees only the end, but the operator's TTFT is the pipeline's (as
    vLLM records it for every request), under stream="false"."""
    bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1"))
    request = GenerateRequest(
        request_id="r2", model="echo@1", prompt="hi", deadline_ms=now_ms() + 10_000, reply_to=bus.reply_topic
    )
    exchange = Exchange(bus, request, bus.router.register("r2"))
    metrics = GatewayMetrics(list, set)
    clock = Clock()
    timer = GenerationTimer(metrics, "echo@1", "completions", clock(), clock, is_streamed=False)

    async def never_leaves() -> dict:
        await asyncio.Event().wait()
        return {}

    async def worker() -> None:
        for seq, (at, text) in enumerate(((100.2, "a"), (100.3, ""), (100.5, "b"))):
            clock.now = at
            bus.router.on_event(ReplyDelta(request_id="r2", seq=seq, text=text, token_ids=[seq] if text else []))
            for _ in range(20):  # the collecting tasks take it before the clock moves on (no I/O: a few turns)
                await asyncio.sleep(0)
        clock.now = 101.0
        bus.router.on_event(ReplyEnd(request_id="r2", seq=3, finish_reason="stop", usage=Usage(completion_tokens=2)))

    body, _ = await asyncio.gather(collect(exchange, "completions", 0, never_leaves, str, timer), worker())
    text = metrics.render()
    metrics.shutdown()
    assert body is not None and body["choices"][0]["text"] == "ab"
    labels = {"model_name": "echo@1", "stream": "false"}
    assert value(text, "weir_gateway_time_to_first_token_seconds_sum", **labels) == pytest.approx(0.2)
    assert value(text, "weir_gateway_inter_token_latency_seconds_count", **labels) == 1  # the empty delta has no token
    assert value(text, "weir_gateway_inter_token_latency_seconds_sum", **labels) == pytest.approx(0.3)
    assert value(text, "weir_gateway_time_to_first_token_seconds_count", model_name="echo@1", stream="true") is None
