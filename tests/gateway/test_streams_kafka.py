"""Resumable streams and the output guard against the real broker, with the fake worker.

What a client checks: a stream asked with a resume grace survives a dropped connection (SSE
Last-Event-ID, WebSocket resume offset) with every token exactly once and none generated twice;
one that nobody resumes is cancelled after its grace; personal data split across deltas reaches
no client, streamed or not.
"""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from websockets.asyncio.client import connect

from schemas.topics import TopicSpec
from tests.kafka_helpers import produce
from tests.waiting import until
from weir.kafka.admin import ensure_topics
from weir.metrics import value

from .conftest import Stack
from .fakes import DRIP

pytestmark = pytest.mark.kafka

DRIP_BODY = {"model": "echo", "prompt": "drip", "stream": True}
PII_REDACTED = "My ID is [REDACTED], card [REDACTED], call [REDACTED] or mail [REDACTED] now."
VARIANTS_REDACTED = "ID [REDACTED], card [REDACTED], mail [REDACTED], or [REDACTED] now."


@pytest.fixture(autouse=True)
async def worker_is_live(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as client:

        async def is_ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await until(is_ready, timeout_s=10, what="the gateway to see a live worker")


async def read_sse(response: httpx.Response, max_deltas: int | None = None) -> tuple[list[str], int]:
    """(texts, last event id) of an SSE response, stopping after max_deltas text events."""
    texts: list[str] = []
    last_id = -1
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            last_id = int(line[4:])
        elif line.startswith("data: ") and line != "data: [DONE]":
            choices = orjson.loads(line[6:])["choices"]
            if choices and choices[0]["text"]:
                texts.append(choices[0]["text"])
                if max_deltas is not None and len(texts) == max_deltas:
                    break
    return texts, last_id


def parse_events(raw: bytes) -> list[tuple[int, str]]:
    """(id, text) of each text event of an SSE body."""
    events = []
    for block in raw.decode().strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        if fields["data"] != "[DONE]" and (choices := orjson.loads(fields["data"])["choices"]) and choices[0]["text"]:
            events.append((int(fields["id"]), choices[0]["text"]))
    return events


async def test_an_sse_client_resumes_with_last_event_id_and_nothing_is_regenerated(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        headers = {"x-weir-resume-grace-s": "10"}
        async with client.stream("POST", "/v1/completions", json=DRIP_BODY, headers=headers) as response:
            request_id = response.headers["x-request-id"]
            assert response.headers["x-weir-resume-url"] == f"/v1/streams/{request_id}"
            before, last_id = await read_sse(response, max_deltas=3)
        # The connection is gone; generation goes on while the client is away (to its end here).
        await until(
            lambda: stack.worker.generated.get(request_id, 0) == len(DRIP),
            timeout_s=10,
            what="the rest generated while the client is away",
        )
        async with client.stream("GET", f"/v1/streams/{request_id}", headers={"last-event-id": str(last_id)}) as again:
            assert again.status_code == 200
            after, _ = await read_sse(again)
    assert before + after == DRIP
    assert stack.worker.generated[request_id] == len(DRIP)
    assert [r.request_id for r in stack.worker.requests].count(request_id) == 1
    assert stack.worker.cancels_of(request_id) == []


async def test_a_finished_stream_can_be_read_again_from_any_event(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        headers = {"x-weir-resume-grace-s": "5"}
        async with client.stream("POST", "/v1/completions", json=DRIP_BODY, headers=headers) as response:
            request_id = response.headers["x-request-id"]
            everything = parse_events(await response.aread())
        tail = await client.get(f"/v1/streams/{request_id}", params={"last_event_id": "16"})
    assert "".join(text for _, text in everything) == "".join(DRIP)
    assert parse_events(tail.content) == [(seq, text) for seq, text in everything if seq > 16]


async def test_a_stream_nobody_resumes_is_cancelled_after_its_grace(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        headers = {"x-weir-resume-grace-s": "0.3"}
        async with client.stream("POST", "/v1/completions", json=DRIP_BODY, headers=headers) as response:
            request_id = response.headers["x-request-id"]
            await read_sse(response, max_deltas=1)
        cancels = await until(
            lambda: stack.worker.cancels_of(request_id),
            timeout_s=10,
            what="the disconnect's cancellation at the worker",
        )
        assert [c.reason for c in cancels] == ["client_disconnect"]
        assert stack.worker.generated[request_id] < len(DRIP)
        gone = await client.get(f"/v1/streams/{request_id}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "stream_not_found"


async def test_without_a_grace_a_disconnect_stops_the_worker_and_cannot_be_resumed(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        async with client.stream("POST", "/v1/completions", json=DRIP_BODY) as response:
            request_id = response.headers["x-request-id"]
            assert "x-weir-resume-url" not in response.headers
            await read_sse(response, max_deltas=1)
        cancels = await until(
            lambda: stack.worker.cancels_of(request_id),
            timeout_s=10,
            what="the disconnect's cancellation at the worker",
        )
        assert [c.reason for c in cancels] == ["client_disconnect"]
        gone = await client.get(f"/v1/streams/{request_id}", headers={"last-event-id": "0"})
        bad = await client.post("/v1/completions", json=DRIP_BODY, headers={"x-weir-resume-grace-s": "forever"})
    assert gone.status_code == 404
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Weir-Resume-Grace-S"


async def test_a_websocket_client_resumes_with_an_offset(stack: Stack) -> None:
    url = stack.base_url.replace("http", "ws") + "/v1/stream"
    request = {"type": "completions", "body": {"model": "echo", "prompt": "drip"}, "resume_grace_s": 10}
    async with connect(url) as ws:
        await ws.send(orjson.dumps(request).decode())
        first = [orjson.loads(await ws.recv()) for _ in range(4)]
    request_id = first[0]["id"]
    await until(
        lambda: stack.worker.generated.get(request_id, 0) == len(DRIP),
        timeout_s=10,
        what="the rest generated while the client is away",
    )
    async with connect(url) as ws:
        await ws.send(orjson.dumps({"type": "resume", "request_id": request_id, "offset": 4}).decode())
        rest = []
        while not rest or rest[-1].get("type") not in ("done", "error"):
            rest.append(orjson.loads(await ws.recv()))
    assert rest[-1] == {"type": "done"}
    texts = [frame["choices"][0]["text"] for frame in first + rest[:-1]]
    assert [t for t in texts if t] == DRIP
    assert stack.worker.generated[request_id] == len(DRIP) and stack.worker.cancels_of(request_id) == []


async def test_personal_data_split_across_deltas_is_redacted_streamed_or_not(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=20)
    stream = await client.completions.create(model="echo", prompt="pii", stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    whole = await client.completions.create(model="echo", prompt="pii")
    chat = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "pii"}])
    assert streamed == whole.choices[0].text == chat.choices[0].message.content == PII_REDACTED
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        metrics = (await http.get("/metrics")).text
    assert (value(metrics, "weir_gateway_redactions_total") or 0) >= 12  # four spans in each of the three outputs


async def test_disguised_personal_data_is_redacted_streamed_or_not(stack: Stack) -> None:
    # an ID in groups, a full-width card, "al<ZWSP>ice at example dot com", "bob [at] example [dot] org"
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=20)
    stream = await client.completions.create(model="echo", prompt="variants", stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    whole = await client.completions.create(model="echo", prompt="variants")
    chat = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "variants"}])
    assert streamed == whole.choices[0].text == chat.choices[0].message.content == VARIANTS_REDACTED


async def test_tool_calls_reach_the_openai_client_streamed_or_not_with_their_arguments_redacted(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="local", max_retries=0)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    ask = {"model": "echo", "messages": [{"role": "user", "content": "who?"}], "tools": tools}
    whole = (await client.chat.completions.create(**ask)).choices[0]
    async with client.chat.completions.stream(**ask) as stream:
        streamed = (await stream.get_final_completion()).choices[0]
    redacted = '{"city": "Paris", "phone": "[REDACTED]"}'
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
            ("lookup", redacted)
        ]
    assert whole.message.tool_calls[0].id.startswith("call_chatcmpl-")


async def test_a_streamed_generation_is_timed_per_served_version(stack: Stack) -> None:
    """TTFT, inter-token latency and end-to-end latency of a drip (20 deltas, 50 ms apart) as the
    client saw it, its tokens, and the GenAI client metrics, under the served name@version."""
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        before = (await client.get("/metrics")).text
        async with client.stream("POST", "/v1/completions", json=DRIP_BODY) as response:
            model_name = response.headers["x-weir-model-version"].split(":")[0]
            texts, _ = await read_sse(response)
        after = (await client.get("/metrics")).text
    assert "".join(texts) == "".join(DRIP)

    def grew(name: str, **labels: str) -> float:
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    labels, streamed = {"model_name": model_name}, {"model_name": model_name, "stream": "true"}
    assert model_name == "echo@1"
    assert grew("weir_gateway_time_to_first_token_seconds_count", **streamed) == 1
    assert grew("weir_gateway_inter_token_latency_seconds_count", **streamed) >= 10  # the guard may merge deltas
    e2e_s = grew("weir_gateway_e2e_request_latency_seconds_sum", **labels)
    assert grew("weir_gateway_e2e_request_latency_seconds_count", **labels) == 1
    assert 0.9 <= e2e_s < 20  # 19 pauses of 50 ms at least
    assert grew("weir_gateway_inter_token_latency_seconds_sum", **streamed) <= e2e_s
    assert grew("weir_gateway_generation_tokens_total", **labels) == len(DRIP)
    gen_ai = {
        "gen_ai_operation_name": "text_completion",
        "gen_ai_provider_name": "weir",
        "gen_ai_request_model": "echo",
        "gen_ai_response_model": "echo@1",
    }
    assert grew("gen_ai_client_token_usage_sum", **gen_ai, gen_ai_token_type="output") == len(DRIP)
    assert grew("gen_ai_client_operation_duration_seconds_count", **gen_ai) == 1


async def test_the_consumer_lag_of_the_deployments_groups_is_in_the_gateways_metrics(stack: Stack) -> None:
    topic, group = f"{stack.topics.prefix}.lagprobe", f"{stack.topics.prefix}.probe"
    await ensure_topics(stack.bootstrap, [TopicSpec(topic, 1, {})])
    await produce(stack.bootstrap, topic, [("k", b"%d" % i) for i in range(4)])
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(1, "")})
    finally:
        await consumer.stop()
    async with httpx.AsyncClient(base_url=stack.base_url) as client:

        async def lag_is(expected: float) -> bool:
            return (
                value((await client.get("/metrics")).text, "kafka_consumergroup_lag", consumergroup=group, topic=topic)
                == expected
            )

        # polled every lag_interval_s (1 s here), never at scrape time
        await until(lambda: lag_is(3), timeout_s=10, what="the consumer group's lag of 3 on /metrics")
