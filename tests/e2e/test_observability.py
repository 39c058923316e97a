"""Metrics and token accounting through the whole pipeline (docs/design.md, "Observability"), as
issue #18 checks them: what every service's /metrics says agrees with what the official openai
client measured and was billed, and what GET /v1/usage reports for a tenant is what its clients
were billed in each response's `usage`, JSON and streamed, as the worker's audit events carried it
to the auditor's ledger. A stack of its own (echo only): its counts are this module's alone."""

from __future__ import annotations

import time

import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import start_pipeline
from tests.waiting import wait_until
from weir.metrics import samples

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "echo"


@pytest.fixture(scope="module")
def usage_pipeline(tmp_path_factory):
    """Its own stack: the shared ones' other modules bill the same open-mode tenant, so their
    totals would mix with the ones compared here. Echo only, no fingerprints: quick to start."""
    p = start_pipeline(
        tmp_path_factory.mktemp("usage"), WEIR_MODELS=MODEL, WEIR_USAGE_EVERY_S="0.5", WEIR_AUDIT_FINGERPRINT_MODEL=""
    )
    yield p
    p.stack.stop_all()


def _streamed_usage(client: httpx.Client, body: dict) -> dict:
    with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as resp:
        assert resp.status_code == 200
        chunks = [orjson.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def test_v1_usage_is_what_the_clients_were_billed(usage_pipeline):
    client = httpx.Client(base_url=usage_pipeline.base_url, timeout=60)
    billed = []
    for i in range(4):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"count the words of prompt {i} " * (i + 1)}],
            "max_tokens": 8 + i,
        }
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        billed.append(resp.json()["usage"])
    billed.append(_streamed_usage(client, {"model": MODEL, "messages": [{"role": "user", "content": "stream me"}]}))
    assert all("cached_tokens" in u["prompt_tokens_details"] for u in billed)

    expected = {
        "requests": len(billed),
        "prompt_tokens": sum(u["prompt_tokens"] for u in billed),
        "completion_tokens": sum(u["completion_tokens"] for u in billed),
        "cached_prompt_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in billed),
    }

    def billed_rows() -> list[dict] | None:
        resp = client.get("/v1/usage", params={"group_by": "tenant"})  # open mode: the default tenant's
        rows = resp.json().get("data", []) if resp.status_code == 200 else []
        return rows if rows and {k: rows[0][k] for k in expected} == expected else None

    rows = wait_until(
        billed_rows, timeout_s=120, interval_s=0.5, what=f"/v1/usage to say what the clients were billed, {expected}"
    )
    assert rows[0]["tenant"] == "default" and rows[0]["total_tokens"] == sum(u["total_tokens"] for u in billed)


def _total(text: str, name: str, **match: str) -> float:
    """The sum of the samples called `name` whose labels include `match`."""
    return sum(v for (n, labels), v in samples(text).items() if n == name and set(match.items()) <= labels)


def _scrape(p, service: str) -> str:
    resp = httpx.get(f"http://127.0.0.1:{p.stack.http_ports[service]}/metrics", timeout=30)
    assert resp.status_code == 200, (service, resp.status_code)
    return resp.text


def test_every_services_metrics_agree_with_what_the_openai_client_measured(usage_pipeline):
    p = usage_pipeline
    served = f"{MODEL}@1"
    before = {name: _scrape(p, name) for name in ("gateway", "batcher", "worker", "auditor")}
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="local", max_retries=0, timeout=60)
    ttfts, billed = [], []
    for i in range(6):
        started = time.monotonic()
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"tell me about metric number {i} " * (i + 1)}],
            max_tokens=6 + i,
            stream=True,
            stream_options={"include_usage": True},
        )
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - started
            if chunk.usage is not None:
                billed.append(chunk.usage)
        ttfts.append(first)
    assert all(t is not None for t in ttfts) and len(billed) == 6
    n, prompt, completion = 6, sum(u.prompt_tokens for u in billed), sum(u.completion_tokens for u in billed)

    def delta(service: str, name: str, **match: str) -> float:
        return _total(after[service], name, **match) - _total(before[service], name, **match)

    def settled() -> bool:  # the auditor appends a little after the client has its answer
        after.update({name: _scrape(p, name) for name in ("gateway", "batcher", "worker", "auditor")})
        # polled every 5 s; a poll before the batcher's first commit lists other groups only
        lag_polled = any(
            name == "kafka_consumergroup_lag" and ("consumergroup", p.topics.batcher_group) in labels
            for name, labels in samples(after["batcher"])
        )
        return delta("auditor", "weir_audit_events_total") >= n and lag_polled

    after: dict = {}
    wait_until(settled, timeout_s=60, interval_s=0.5, what="the auditor's count and the batcher's lag poll")
    # the worker, in vLLM's names and meanings
    assert delta("worker", "vllm:request_success_total", model_name=served) == n
    assert delta("worker", "vllm:prompt_tokens_total", model_name=served) == prompt
    assert delta("worker", "vllm:generation_tokens_total", model_name=served) == completion
    # (queue and prefill times need a scheduler, which echo has not: tests/worker/test_serving_metrics*.py)
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "gen_ai_server_time_to_first_token_seconds_count",
    ):
        assert delta("worker", name) == n, name
    # the worker's TTFT starts when it read the request: within what the client waited for
    assert 0 <= delta("worker", "vllm:time_to_first_token_seconds_sum", model_name=served) <= sum(ttfts)  # echo: ~0 ms
    assert _total(after["worker"], "vllm:num_requests_running", model_name=served) == 0
    # the gateway, as the client sees it
    assert delta("gateway", "weir_gateway_time_to_first_token_seconds_count", model_name=served) == n
    assert 0 < delta("gateway", "weir_gateway_time_to_first_token_seconds_sum", model_name=served) <= sum(ttfts)
    assert delta("gateway", "weir_gateway_e2e_request_latency_seconds_count", model_name=served) == n
    assert delta("gateway", "weir_gateway_generation_tokens_total", model_name=served) == completion
    assert delta("gateway", "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == prompt
    assert delta("gateway", "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == completion
    assert delta("gateway", "weir_gateway_requests_total", route="/v1/chat/completions", status="200") == n
    # the batcher batched each request once; lag is reported per group and topic
    assert delta("batcher", "weir_batcher_batch_size_sum", model_name=served) == n
    assert any(
        name == "kafka_consumergroup_lag" and ("consumergroup", p.topics.batcher_group) in labels
        for name, labels in samples(after["batcher"])
    )
    # the auditor appended each once
    assert delta("auditor", "weir_audit_events_total") == n
