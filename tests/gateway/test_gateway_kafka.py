"""The gateway against the real broker, with a fake worker inside the test answering requests.

Checks what a client sees: the openai client streams and ends, stream=false returns the body,
repeats are dropped, errors keep OpenAI's format, a client leaving mid-stream (HTTP or WebSocket)
becomes a Cancellation on the control topic, and a finished request publishes none. A queue
ahead longer than a request's deadline (heartbeats and unread batch records) is a 429 with the
Retry-After it would fit after, until it drains.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from websockets.asyncio.client import connect

from schemas.codec import decode, encode
from schemas.messages import Batch, DeadLetter, GenerateRequest
from tests.waiting import stays_false, until
from weir.kafka.admin import ensure_topics

from .conftest import Stack

pytestmark = pytest.mark.kafka

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
# A wrong cancellation of a finished request would leave when its connection closed, before the
# next request was even sent; the next one's cancellation has come through the same producer and
# the fake worker's reader (fetch wait 10 ms, polls of 200 ms) since. Half a second more covers a
# record on another partition of the control topic.
NO_CANCEL_S = 0.5


def client_of(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=20)


def parse_sse(raw: str) -> list[dict[str, str]]:
    events = []
    for block in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append(fields)
    return events


async def test_ready_only_once_a_worker_is_live(stack: Stack) -> None:
    assert stack.ready_before_worker.status_code == 503
    assert stack.ready_before_worker.json()["reason"] == "no live worker heartbeat"
    async with httpx.AsyncClient(base_url=stack.base_url) as client:

        async def is_ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await until(is_ready, timeout_s=10, what="the gateway ready")
        body = (await client.get("/readyz")).json()
    assert body["ready"] and body["live_workers"] == {"echo@1": 1}  # heartbeats name versions


async def test_openai_client_streams_chat(stack: Stack) -> None:
    client = client_of(stack)
    stream = await client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world"  # the repeated seq 1 was dropped
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
    assert chunks[0].id.startswith("chatcmpl-")


async def test_openai_client_streams_completions(stack: Stack) -> None:
    stream = await client_of(stack).completions.create(model="echo", prompt="hi", stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == "Hello, world"
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_non_streaming_bodies(stack: Stack) -> None:
    client = client_of(stack)
    chat = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
    assert chat.object == "chat.completion" and chat.choices[0].message.content == "Hello, world"
    assert chat.choices[0].finish_reason == "stop" and chat.usage is not None and chat.usage.completion_tokens == 3
    assert chat.system_fingerprint == "echo@1" and chat.model == "echo@1"  # the version that served it
    completion = await client.completions.create(model="echo", prompt="hi", max_tokens=5)
    assert completion.object == "text_completion" and completion.choices[0].text == "Hello, world"
    request = next(r for r in stack.worker.requests if r.request_id == completion.id)
    assert request.max_tokens == 5 and request.prompt == "hi" and request.reply_to == stack.reply_topic
    assert request.model == "echo@1" and completion.model == "echo@1"  # produced pinned to the default version


async def test_sse_wire_shape(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    request_id = response.headers["x-request-id"]
    events = parse_sse(response.text)
    # The output guard holds a trailing word until it cannot become an e-mail address, and a
    # trailing space until the next word shows it is not " at" or " dot" (redaction.py): "Hello,"
    # leaves with the delta ", " (seq 1), the space with "world" (seq 2), "world" with the
    # terminal (seq 3).
    assert [e["id"] for e in events] == ["1", "2", "3", "3", "3"], events
    assert events[-1]["data"] == "[DONE]"
    first = orjson.loads(events[0]["data"])
    assert first["id"] == request_id and first["choices"][0]["delta"] == {"role": "assistant", "content": "Hello,"}
    assert [orjson.loads(e["data"])["choices"][0]["delta"] for e in events[1:3]] == [
        {"content": " "},
        {"content": "world"},
    ]


async def test_errors_keep_openai_format(stack: Stack) -> None:
    client = client_of(stack)
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "reject"}])
    assert limited.value.code == "queue_full"
    with pytest.raises(openai.APIError) as in_stream:
        stream = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "reject"}], stream=True
        )
        async for _ in stream:
            pass
    assert "too busy" in in_stream.value.message


async def test_deadline_ends_a_request_nobody_answers(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        headers = {"x-weir-timeout-s": "0.5"}
        body = {**CHAT, "messages": [{"role": "user", "content": "hang"}]}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        request_id = response.headers["x-request-id"]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    events = parse_sse(streamed.text)
    assert orjson.loads(events[0]["data"])["error"]["code"] == "timeout" and events[-1]["data"] == "[DONE]"
    cancels = await until(
        lambda: stack.worker.cancels_of(request_id), timeout_s=10, what="the deadline's cancellation at the worker"
    )
    assert cancels[0].reason == "deadline"
    request = next(r for r in stack.worker.requests if r.request_id == request_id)
    assert 400 <= request.deadline_ms - request.created_ms <= 600


async def test_disconnect_mid_stream_publishes_a_cancel(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        finished = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        body = {**CHAT, "messages": [{"role": "user", "content": "slow"}], "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            request_id = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # got the first token; now leave
    cancels = await until(
        lambda: stack.worker.cancels_of(request_id), timeout_s=10, what="the disconnect's cancellation at the worker"
    )
    assert [c.reason for c in cancels] == ["client_disconnect"]
    assert cancels[0].reply_to == stack.reply_topic
    await stays_false(
        lambda: stack.worker.cancels_of(finished.headers["x-request-id"]),
        for_s=NO_CANCEL_S,
        what="a cancellation of the request that finished",
    )


async def test_disconnect_while_waiting_for_a_body_publishes_a_cancel(stack: Stack) -> None:
    seen = len(stack.worker.requests)
    body = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        post = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await until(lambda: len(stack.worker.requests) > seen, timeout_s=10, what="the request at the worker")
        post.cancel()  # the client gives up: httpx closes the connection
        await asyncio.gather(post, return_exceptions=True)
    request_id = stack.worker.requests[-1].request_id
    cancels = await until(
        lambda: stack.worker.cancels_of(request_id), timeout_s=10, what="the disconnect's cancellation at the worker"
    )
    assert [c.reason for c in cancels] == ["client_disconnect"]


async def test_websocket_streams_and_cancels(stack: Stack) -> None:
    url = stack.base_url.replace("http", "ws") + "/v1/stream"
    async with connect(url) as ws:
        await ws.send(
            orjson.dumps(
                {"type": "chat.completions", "body": {**CHAT, "stream_options": {"include_usage": True}}}
            ).decode()
        )
        frames = []
        while not frames or frames[-1].get("type") not in ("done", "error"):
            frames.append(orjson.loads(await ws.recv()))
        assert frames[-1] == {"type": "done"}
        chunks = frames[:-1]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello, world"
        assert chunks[-1]["usage"]["total_tokens"] == 5
        finished_id = chunks[0]["id"]

        await ws.send('{"type": "completions", "body": {"model": "echo", "prompt": "slow"}}')
        first = orjson.loads(await ws.recv())
        assert first["object"] == "text_completion" and first["choices"][0]["text"] == "Hello,"
        await ws.send('{"type": "cancel"}')
        assert orjson.loads(await ws.recv()) == {"type": "cancelled", "request_id": first["id"]}
        cancels = await until(
            lambda: stack.worker.cancels_of(first["id"]), timeout_s=10, what="the user's cancellation at the worker"
        )
        assert cancels[0].reason == "user"

        await ws.send('{"type": "completions", "body": {"model": "echo", "prompt": 5}}')
        error = orjson.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["param"] == "prompt"

        await ws.send('{"type": "completions", "body": {"model": "echo", "prompt": "slow"}}')
        leaving = orjson.loads(await ws.recv())
    cancels = await until(
        lambda: stack.worker.cancels_of(leaving["id"]),
        timeout_s=10,
        what="the leaving client's cancellation at the worker",
    )
    assert cancels[0].reason == "client_disconnect"
    assert stack.worker.cancels_of(finished_id) == []


async def test_malformed_reply_is_dead_lettered_and_serving_goes_on(stack: Stack) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(stack.reply_topic, b"{not a reply", key=b"junk")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        stack.topics.dead_letter,
        bootstrap_servers=stack.bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    letters: list[DeadLetter] = []
    try:
        for _ in range(100):
            for records in (await consumer.getmany(timeout_ms=100)).values():
                letters += [decode(DeadLetter, r.value) for r in records]
            if letters:
                break
    finally:
        await consumer.stop()
    assert letters and letters[0].source_topic == stack.reply_topic and letters[0].service == "gateway"
    assert "not JSON" in letters[0].reason and letters[0].key == "junk"
    chat = await client_of(stack).chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "Hello, world"


async def test_a_queue_longer_than_the_deadline_is_refused_until_it_drains(stack: Stack) -> None:
    """9 waiting in the worker + 12 in an unread batch record, drained at 2/s: a 10.5 s wait."""
    topic = stack.topics.batches("echo@1")
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await admin.start()
    try:  # the gateway has polled echo@1's backlog since the fake worker's first heartbeat: without creating it
        assert topic not in await admin.list_topics()
    finally:
        await admin.close()
    await ensure_topics(stack.bootstrap, stack.topics.model_specs("echo@1"))
    queued = [
        GenerateRequest(
            request_id=f"q{i}", model="echo@1", prompt="hi", reply_to=stack.reply_topic, deadline_ms=2_000_000_000_000
        )
        for i in range(12)
    ]
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:

        async def knows_partition_3() -> bool:
            return 3 in await producer.partitions_for(topic)

        await until(knows_partition_3, timeout_s=5, what="the producer's metadata to know the new topic's partitions")
        sent = await producer.send_and_wait(
            topic, encode(Batch(batch_id="q", model="echo@1", requests=queued, batcher_id="test")), partition=3
        )
    finally:
        await producer.stop()
    worker = stack.worker
    worker.num_waiting, worker.finished_per_s, worker.next_offsets = 9, 2.0, {"echo@1": {3: sent.offset}}
    headers = {"x-weir-timeout-s": "3"}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
            gauge = 'weir_gateway_queue_wait_seconds{model_name="echo@1"} 10.5'

            async def gauge_shown() -> bool:  # the next heartbeat, then the next poll of the batch topic
                return gauge in (await client.get("/metrics")).text

            await until(gauge_shown, timeout_s=10, what="the queue-wait gauge at 10.5 s")
            refused = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "8"  # ceil(10.5 - 3)
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_too_long"
            assert "'echo@1'" in error["message"] and "21 requests ahead" in error["message"]
            assert 'code="queue_too_long"' in (await client.get("/metrics")).text
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200  # its default timeout fits
            with pytest.raises(openai.RateLimitError) as limited:
                await client_of(stack).chat.completions.create(**CHAT, extra_headers=headers)
            assert limited.value.code == "queue_too_long"
            worker.num_waiting, worker.next_offsets = 0, {"echo@1": {3: sent.offset + 1}}  # the worker read it all

            async def admitted() -> httpx.Response | None:
                answered = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
                return answered if answered.status_code != 429 else None

            answered = await until(admitted, timeout_s=10, what="a request admitted once the queue is read")
            assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == "Hello, world"
    finally:
        worker.num_waiting, worker.finished_per_s, worker.next_offsets = 0, None, {}
