"""/v1/embeddings through the whole pipeline on the real broker, with the openai client.

gateway -> weir.requests -> batcher -> weir.batches.all-MiniLM-L6-v2 -> worker (onnxruntime) ->
the gateway's reply topic -> gateway. The services run in this process (cheaper than the
process-per-service stack of conftest.py), each with its own Kafka clients.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import orjson
import pytest

from schemas.codec import decode, decode_reply, encode
from schemas.messages import EmbedRequest, GenerateRequest, ReplyEnd, WorkerHeartbeat, now_ms
from schemas.model_repo import load_model_repo
from schemas.registry import RegistryState
from schemas.topics import Topics
from services.batcher.app import BatcherApp
from services.batcher.config import BatcherSettings
from services.batcher.jobs import JobRunner
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.gateway.fakes import GatewayServer
from tests.kafka_helpers import produce, read_until
from tests.waiting import until
from weir.bus import BusSettings
from weir.kafka.admin import deployment_specs, ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
MODEL = "all-MiniLM-L6-v2"
LONG_TEXT = "Kafka carries every message between the services of the pipeline. " * 60  # ~660 tokens


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
async def pipeline():
    """Worker (the embedding model and echo), batcher and gateway on a fresh topic prefix."""
    topics = Topics(f"emb{uuid.uuid4().hex[:8]}")
    await ensure_topics(BOOTSTRAP, deployment_specs(topics, load_model_repo(REPO_TOML)))
    common = dict(kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix, model_repo=str(REPO_TOML))
    worker = WorkerService(WorkerSettings(**common, models=f"{MODEL},echo", torch_threads=1, heartbeat_interval_ms=300))
    tasks = [asyncio.create_task(worker.serve())]
    beats = await read_until(
        BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs), 120
    )
    assert any(decode(WorkerHeartbeat, r.value).is_ready for r in beats), "the worker never became ready"
    stop = asyncio.Event()
    batcher_settings = BatcherSettings(**common)
    tasks.append(asyncio.create_task(BatcherApp(batcher_settings, load_model_repo(REPO_TOML)).serve(stop)))
    server = GatewayServer(create_app(GatewaySettings(**common, auth_mode="open")))
    await server.start()
    async with httpx.AsyncClient(base_url=server.base_url) as http:

        async def is_ready() -> bool:  # once the gateway has seen a worker heartbeat
            return (await http.get("/readyz")).status_code == 200

        await until(is_ready, timeout_s=30, interval_s=0.2, what="the gateway ready")
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield topics, server, client
    finally:
        await client.close()
        await server.stop()
        stop.set()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_embeddings_are_unit_vectors_and_long_inputs_work(pipeline):
    _, _, client = pipeline
    result = await client.embeddings.create(model=MODEL, input=["a", LONG_TEXT])  # the SDK asks for base64
    assert [d.index for d in result.data] == [0, 1] and result.model == f"{MODEL}@1"  # the version that served it
    for item in result.data:
        assert len(item.embedding) == 384
        assert np.linalg.norm(item.embedding) == pytest.approx(1.0, abs=1e-5)
    assert result.usage.prompt_tokens > 512 and result.usage.total_tokens == result.usage.prompt_tokens
    floats = await client.embeddings.create(model=MODEL, input=["a", LONG_TEXT], encoding_format="float")
    np.testing.assert_allclose(floats.data[1].embedding, result.data[1].embedding, atol=1e-6)


async def test_similar_texts_are_closer_than_unrelated_ones(pipeline):
    _, _, client = pipeline
    texts = ["The cat sits on the mat.", "A cat is sitting on a rug.", "Stock markets fell sharply on Monday."]
    vectors = [d.embedding for d in (await client.embeddings.create(model=MODEL, input=texts)).data]
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3


async def test_more_inputs_than_one_request_carries_come_back_in_order(pipeline):
    _, _, client = pipeline
    texts = [f"sentence number {i % 7}" for i in range(150)]  # two EmbedRequests: 128 + 22
    data = (await client.embeddings.create(model=MODEL, input=texts)).data
    assert [d.index for d in data] == list(range(150))
    np.testing.assert_allclose(data[3].embedding, data[143].embedding, atol=1e-5)  # the same text
    assert cosine(data[3].embedding, data[4].embedding) < 0.9999


async def test_wrong_models_and_parameters_get_openai_errors(pipeline):
    _, _server, client = pipeline
    with pytest.raises(openai.BadRequestError, match="not an embedding model"):
        await client.embeddings.create(model="echo", input="x")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        await client.embeddings.create(model=MODEL, input="x", dimensions=128)
    with pytest.raises(openai.BadRequestError, match="use /v1/embeddings"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="nope", input="x")
    listed = {m.id for m in (await client.models.list()).data}
    assert {MODEL, "echo"} <= listed


async def test_any_kafka_client_gets_a_rejection_for_the_wrong_kind(pipeline):
    topics, _, _ = pipeline
    reader = f"client-{uuid.uuid4().hex[:6]}"
    reply_to = topics.replies(reader)
    await ensure_topics(BOOTSTRAP, [topics.reply_spec(reader)])
    deadline = now_ms() + 60_000
    wrong = [
        GenerateRequest(
            request_id=f"g-{uuid.uuid4().hex}", model=MODEL, prompt="hi", deadline_ms=deadline, reply_to=reply_to
        ),
        EmbedRequest(
            request_id=f"e-{uuid.uuid4().hex}", model="echo", inputs=["hi"], deadline_ms=deadline, reply_to=reply_to
        ),
    ]
    right = EmbedRequest(
        request_id=f"e-{uuid.uuid4().hex}", model=MODEL, inputs=["hi"], deadline_ms=deadline, reply_to=reply_to
    )
    await produce(BOOTSTRAP, topics.requests, [(r.request_id, encode(r)) for r in [*wrong, right]])
    want = {r.request_id for r in [*wrong, right]}

    def ends(records) -> dict[str, ReplyEnd]:
        events = (decode_reply(r.value) for r in records)
        return {e.request_id: e for e in events if isinstance(e, ReplyEnd)}

    got = ends(await read_until(BOOTSTRAP, [reply_to], lambda rs: want <= set(ends(rs)), 60))
    for request in wrong:
        assert (got[request.request_id].finish_reason, got[request.request_id].error.code) == (
            "rejected",
            "unsupported_request_kind",
        )
    assert got[right.request_id].finish_reason == "stop" and len(got[right.request_id].embeddings[0]) == 384


async def wait_batch(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 120):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


@pytest.fixture(scope="module")
async def job_runner(pipeline):
    """The batch job runner the batcher process runs beside its BatcherApp (services/batcher/app.py)."""
    topics, _, _ = pipeline
    settings = BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix)
    runner = JobRunner(settings, RegistryState(load_model_repo(REPO_TOML)), "test-jobs")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    yield runner
    stop.set()
    await asyncio.wait_for(task, 30)


async def run_batch(client: openai.AsyncOpenAI, endpoint: str, bodies: dict[str, dict]) -> dict[str, dict]:
    """Run `bodies` (by custom_id) as one batch through the batcher's job runner; the response body of each line."""
    content = b"".join(
        orjson.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + b"\n"
        for cid, body in bodies.items()
    )
    uploaded = await client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    batch = await wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies), batch
    assert batch.error_file_id is None and batch.output_file_id is not None
    rows = [orjson.loads(line) for line in (await client.files.content(batch.output_file_id)).text.splitlines()]
    assert all(row["response"]["status_code"] == 200 for row in rows)
    return {row["custom_id"]: row["response"]["body"] for row in rows}


async def test_embeddings_lines_run_in_a_batch_and_answer_what_the_endpoint_does(pipeline, job_runner):
    """OpenAI's Batch API takes /v1/embeddings lines: each runs through the batcher's job runner as
    the endpoint's EmbedRequests (150 inputs: two of them), and its line answers the embedding list
    the endpoint answers for the same body."""
    _, _, client = pipeline
    texts = [f"sentence number {i % 7}" for i in range(150)]
    bodies = {
        "one": {"model": MODEL, "input": "The cat sits on the mat.", "encoding_format": "float"},
        "many": {"model": MODEL, "input": texts, "encoding_format": "float", "user": "u-1"},
    }
    written = await run_batch(client, "/v1/embeddings", bodies)
    for cid, body in bodies.items():
        online = (await client.embeddings.create(**body)).model_dump()
        line = written[cid]
        assert (line["object"], line["model"], line["usage"]) == (online["object"], online["model"], online["usage"])
        assert [d["index"] for d in line["data"]] == [d["index"] for d in online["data"]]
        np.testing.assert_allclose(
            [d["embedding"] for d in line["data"]], [d["embedding"] for d in online["data"]], atol=1e-5
        )
    assert len(written["many"]["data"]) == 150


async def test_a_chat_line_runs_with_the_endpoints_defaults_and_usage(pipeline, job_runner):
    """A chat line without max_tokens runs with the endpoint's default (256, not the wire's 64),
    n=2 choices, and answers usage with prompt_tokens_details and a system_fingerprint, as the
    endpoint does for the same body (the echo model repeats the prompt: 100 words)."""
    _, _, client = pipeline
    prompt = " ".join(f"w{i}" for i in range(100))
    body = {"model": "echo", "messages": [{"role": "user", "content": prompt}], "n": 2, "seed": 7, "user": "u-2"}
    line = (await run_batch(client, "/v1/chat/completions", {"c": body}))["c"]
    online = (await client.chat.completions.create(**body)).model_dump(exclude_unset=True)
    assert [c["message"]["content"] for c in line["choices"]] == [prompt, prompt]
    assert [c["finish_reason"] for c in line["choices"]] == ["stop", "stop"]
    assert line["usage"] == online["usage"] and "prompt_tokens_details" in line["usage"]
    assert line["system_fingerprint"] == online["system_fingerprint"] == "echo@1"
    assert line["choices"] == online["choices"]
