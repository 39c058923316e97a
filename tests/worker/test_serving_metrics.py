"""The worker's vllm:* and gen_ai.server.* metrics: where a request's times land (Recorder), and
the engine's timing and prefix-cache counts they are made from."""

from __future__ import annotations

import asyncio

import pytest

from schemas.messages import ErrorInfo, NamedToolChoice, StructuredOutputs, ToolDef
from services.worker.engine import Engine, EngineConfig
from services.worker.kafka.dispatch import Dispatch
from services.worker.kafka.events import audit_event, reply_events
from services.worker.kafka.intake import InFlight, Intake
from services.worker.kafka.publisher import Publisher
from services.worker.kafka.serving_metrics import ServingMetrics, kv_cache_usage, structured_result
from weir.metrics import ServiceMetrics, value

from .factories import T0_MS, make_model_config, make_output, make_request

V = {"model_name": "tiny@1"}


def recorder_and_metrics(stats=()):
    metrics = ServiceMetrics("worker-test")
    serving = ServingMetrics(metrics, lambda: stats)
    return serving.recorder(make_model_config("tiny")), metrics


def bucket(text: str, name: str, le: str, **labels: str) -> float | None:
    return value(text, f"{name}_bucket", le=le, **{**V, **labels})


def test_a_known_ttft_lands_in_its_bucket_and_each_phase_in_its_histogram():
    recorder, metrics = recorder_and_metrics()
    request = make_request("def ", model="tiny")
    recorder.on_output(request, make_output(request.request_id, 0, text="a", token_ids=[1], itl_ms=[5, 30]))
    recorder.on_output(
        request,
        make_output(
            request.request_id,
            1,
            finish_reason="length",
            prompt_tokens=7,
            completion_tokens=5,
            received_ms=T0_MS,
            scheduled_ms=T0_MS + 10,
            first_token_ms=T0_MS + 30,
            finished_ms=T0_MS + 100,
        ),
    )
    text = metrics.render()
    ttft = "vllm:time_to_first_token_seconds"
    assert bucket(text, ttft, "0.02") == 0.0 and bucket(text, ttft, "0.04") == 1.0  # 0.03 s
    assert value(text, f"{ttft}_count", **V) == 1.0 and value(text, f"{ttft}_sum", **V) == 0.03
    itl = "vllm:inter_token_latency_seconds"
    assert bucket(text, itl, "0.01") == 1.0 and bucket(text, itl, "0.025") == 1.0 and bucket(text, itl, "0.05") == 2.0
    assert value(text, "vllm:request_queue_time_seconds_sum", **V) == 0.01
    assert value(text, "vllm:request_prefill_time_seconds_sum", **V) == 0.02
    assert value(text, "vllm:request_decode_time_seconds_sum", **V) == 0.07
    assert value(text, "vllm:e2e_request_latency_seconds_sum", **V) == 0.1
    assert bucket(text, "vllm:request_prompt_tokens", "5") == 0.0
    assert bucket(text, "vllm:request_prompt_tokens", "10") == 1.0
    assert value(text, "vllm:prompt_tokens_total", **V) == 7.0
    assert value(text, "vllm:generation_tokens_total", **V) == 5.0
    assert value(text, "vllm:request_success_total", finished_reason="length", **V) == 1.0
    genai = {
        "gen_ai_operation_name": "text_completion",
        "gen_ai_provider_name": "weir",
        "gen_ai_request_model": "tiny",
        "gen_ai_response_model": "tiny@1",
    }
    assert value(text, "gen_ai_server_time_to_first_token_seconds_sum", **genai) == 0.03
    tpot = "gen_ai_server_time_per_output_token_seconds_bucket"
    assert value(text, tpot, le="0.01", **genai) == 0.0 and value(text, tpot, le="0.025", **genai) == 1.0  # 0.07/4
    assert value(text, "gen_ai_server_request_duration_seconds_count", **genai) == 1.0


def test_the_heartbeats_latency_counts_are_the_histograms_and_the_service_time_goes_to_the_drain_rate():
    metrics = ServiceMetrics("worker-test")
    ran: list[float] = []
    recorder = ServingMetrics(metrics, lambda: (), on_ran=ran.append).recorder(make_model_config("tiny"))
    request = make_request("def ", model="tiny")
    recorder.on_output(request, make_output(request.request_id, 0, text="a", token_ids=[1], itl_ms=[5, 30, 50]))
    recorder.on_output(
        request,
        make_output(
            request.request_id,
            1,
            finish_reason="length",
            prompt_tokens=7,
            completion_tokens=5,
            received_ms=T0_MS,
            scheduled_ms=T0_MS + 10,
            first_token_ms=T0_MS + 40,
            finished_ms=T0_MS + 1010,
        ),
    )
    mirror = make_request("def ", model="tiny").model_copy(update={"shadow_of": "live-1"})
    recorder.on_output(
        mirror,
        make_output(
            mirror.request_id,
            0,
            finish_reason="stop",
            completion_tokens=1,
            received_ms=T0_MS,
            first_token_ms=T0_MS + 5,
            finished_ms=T0_MS + 9000,
        ),
    )
    assert ran == [1.0]  # first scheduled to the end; a mirror copy yields to live work: not the pace
    text, latency = metrics.render(), recorder.latency()
    for histogram, name in (
        (latency.ttft, "vllm:time_to_first_token_seconds"),
        (latency.itl, "vllm:inter_token_latency_seconds"),
    ):
        for bound, count in zip([*histogram.bounds, "+Inf"], histogram.counts, strict=True):
            assert bucket(text, name, str(bound)) == count, (name, bound)
    assert (latency.ttft.counts[-1], latency.itl.counts[-1]) == (2, 3)
    assert latency.itl.counts[latency.itl.bounds.index(0.05)] == 3  # 50 ms is in the bucket whose bound it is


def test_a_cancel_is_vllms_abort_and_a_refusal_counts_only_as_finished():
    recorder, metrics = recorder_and_metrics()
    cancelled, refused = make_request("def "), make_request("def ")
    recorder.on_output(
        cancelled,
        make_output(
            cancelled.request_id,
            0,
            finish_reason="cancelled",
            error=ErrorInfo(code="cancelled", message="x"),
            prompt_tokens=2,
            received_ms=T0_MS,
            finished_ms=T0_MS + 3,
        ),
    )
    recorder.on_output(refused, make_output(refused.request_id, 0, finish_reason="rejected", received_ms=T0_MS))
    text = metrics.render()
    assert value(text, "vllm:request_success_total", finished_reason="abort", **V) == 1.0
    assert value(text, "vllm:request_success_total", finished_reason="rejected", **V) == 1.0
    assert value(text, "vllm:request_prompt_tokens_count", **V) == 1.0  # the cancelled one only
    assert value(text, "vllm:time_to_first_token_seconds_count", **V) is None  # no first token
    failed = {
        "gen_ai_operation_name": "text_completion",
        "gen_ai_provider_name": "weir",
        "error_type": "cancelled",
        "gen_ai_request_model": "tiny",
        "gen_ai_response_model": "tiny@1",
    }
    assert value(text, "gen_ai_server_request_duration_seconds_count", **failed) == 1.0


def test_structured_result_of_each_ending():
    constrained = make_request("def ", structured=StructuredOutputs(json_object=True))
    tools = [ToolDef(function={"name": "f", "parameters": {"type": "object"}})]
    named = make_request(
        prompt=None,
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        tool_choice=NamedToolChoice(function={"name": "f"}),
    )
    auto = named.model_copy(update={"tool_choice": "auto"})

    def result(request, reason, valid=None):
        return structured_result(
            request, make_output(request.request_id, 0, finish_reason=reason, structured_valid=valid)
        )

    assert (result(constrained, "stop", True), result(constrained, "stop", False)) == ("valid", "invalid")
    assert result(constrained, "length", False) == "truncated" and result(named, "length") == "truncated"
    assert result(named, "stop", True) == "valid"
    assert result(constrained, "error") is None and result(constrained, "stop") is None  # not checked: not counted
    assert result(make_request("def "), "length") is None and result(auto, "stop") is None  # unconstrained


async def test_structured_outputs_count_once_per_request_when_its_end_is_durable():
    recorder, metrics = recorder_and_metrics()
    intake = Intake()
    config = make_model_config("tiny")
    publisher = Publisher(
        config, None, "weir.audit", intake, Dispatch(config, []), worker_id="w", audit_key=b"k" * 32, recorder=recorder
    )
    request = make_request("def ", structured=StructuredOutputs(json_object=True))
    end = make_output(request.request_id, 3, finish_reason="stop", structured_valid=False)
    broken = asyncio.get_running_loop().create_future()
    broken.set_exception(ValueError("the reply topic refused it"))  # not an outage: given up, never redone
    await publisher.settle(InFlight(request, "b1", futures=[broken]), end)
    labels = {**V, "result": "invalid"}
    assert value(metrics.render(), "weir_structured_outputs_total", **labels) is None  # its writes failed
    written = asyncio.get_running_loop().create_future()
    written.set_result(None)
    flight = InFlight(request, "b1", futures=[written])
    intake.in_flight[request.request_id] = flight
    await publisher.settle(flight, end)
    text = metrics.render()
    assert value(text, "weir_structured_outputs_total", **labels) == 1.0
    assert value(text, "weir_structured_outputs_total", **{**V, "result": "valid"}) is None


def test_the_engines_gauges_and_totals_are_read_per_version_at_scrape_time():
    stats = [
        (
            "tiny@1",
            [
                {
                    "num_running": 2,
                    "num_waiting": 1,
                    "num_kv_blocks": 100,
                    "kv_cache_usage_perc": 0.5,
                    "prefix_cache_queries": 40,
                    "prefix_cache_hits": 16,
                    "num_preemptions": 1,
                },
                {
                    "num_running": 1,
                    "num_waiting": 0,
                    "num_kv_blocks": 300,
                    "kv_cache_usage_perc": 0.1,
                    "prefix_cache_queries": 10,
                    "prefix_cache_hits": 0,
                    "num_preemptions": 0,
                },
            ],
        ),
        ("echo@1", [{"num_running": 3, "num_waiting": 0, "num_kv_blocks": 8}]),
    ]
    _, metrics = recorder_and_metrics(stats)
    text = metrics.render()
    assert value(text, "vllm:num_requests_running", **V) == 3.0
    assert value(text, "vllm:num_requests_waiting", **V) == 1.0
    assert value(text, "vllm:kv_cache_usage_perc", **V) == pytest.approx(0.2)  # (50 + 30) / 400 blocks
    assert value(text, "vllm:kv_cache_usage_perc", model_name="echo@1") is None  # no KV cache: not reported
    assert value(text, "vllm:prefix_cache_queries_total", **V) == 50.0
    assert value(text, "vllm:prefix_cache_hits_total", **V) == 16.0
    assert value(text, "vllm:num_preemptions_total", **V) == 1.0
    assert kv_cache_usage([{"num_kv_blocks": 8}]) is None


def test_the_engine_times_each_phase_and_counts_cached_prompt_tokens_in_tokens(llama_dir):
    engine = Engine(llama_dir, EngineConfig(max_model_len=128, block_size=4, kv_cache_bytes=4 << 20))
    engine.eos_ids = set()
    shared = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    finals, gaps = {}, {}
    for i, now in ((0, T0_MS), (1, T0_MS + 1000)):
        request = make_request(shared + "ab"[i], request_id=f"r{i}", max_tokens=4, deadline_ms=T0_MS + 60_000)
        engine.add(request, now)
        for step in range(1, 20):
            for out in engine.step(now + 10 * step):
                gaps.setdefault(out.request_id, []).extend(out.itl_ms or [])
                if out.is_final:
                    finals[out.request_id] = out
            if not engine.has_work:
                break
    first, second = finals["r0"], finals["r1"]
    assert first.scheduled_ms == T0_MS + 10 and first.first_token_ms == T0_MS + 10  # whole prompt in one step
    assert first.finished_ms == T0_MS + 40 and gaps["r0"] == [10, 10, 10]  # 4 tokens, one a step
    assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens > 0
    assert second.cached_prompt_tokens % 4 == 0 and second.cached_prompt_tokens < second.prompt_tokens
    blocks = engine.blocks
    assert blocks.prefix_cache_hits == second.cached_prompt_tokens
    assert blocks.prefix_cache_queries == first.prompt_tokens + second.prompt_tokens
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == second.cached_prompt_tokens and stats["kv_cache_usage_perc"] == 0.0
    end = next(e for e in reply_events(make_request(request_id="r1"), "b", second, "tiny@1") if e.type == "end")
    assert end.usage.cached_prompt_tokens == second.cached_prompt_tokens
    audit = audit_event(
        make_request(request_id="r1"),
        second,
        make_model_config("tiny"),
        weights_sha256="0" * 64,
        worker_id="w",
        audit_key=b"k" * 32,
        now_ms=T0_MS,
    )
    assert audit.cached_prompt_tokens == second.cached_prompt_tokens


def test_a_serving_engine_times_a_token_when_the_pass_that_made_it_ends(llama_dir):
    """The worker's engine reads its clock after the forward pass: prefill and first-token times
    include the pass (a step's start time would make them ~0 however slow the model)."""
    engine = Engine(llama_dir, EngineConfig(max_model_len=128, block_size=4, kv_cache_bytes=4 << 20))
    engine.eos_ids = set()
    ends = iter([T0_MS + 250, T0_MS + 400])  # the clock when each pass ended
    engine.clock = lambda: next(ends)
    engine.add(make_request("def f():", request_id="r", max_tokens=2, deadline_ms=T0_MS + 60_000), T0_MS)
    outs = [o for step in (T0_MS + 10, T0_MS + 260) for o in engine.step(step)]
    final = next(o for o in outs if o.is_final)
    assert final.scheduled_ms == T0_MS + 10  # the step started: the queue time ends
    assert final.first_token_ms == T0_MS + 250 and final.finished_ms == T0_MS + 400  # the passes ended
    assert final.itl_ms == [150]
