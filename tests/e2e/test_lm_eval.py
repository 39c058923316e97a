"""lm-eval's request shapes through the whole pipeline on the real broker, with the openai client
and the trained default model (weir-tiny-py) on the CPU: loglikelihood (a batch of prompts, echo,
logprobs, max_tokens 0: the prompt's own logprobs, checked against transformers), prompts of token
ids, batched generation, and /tokenize.

gateway -> weir.requests -> batcher -> worker (torch engine) -> the gateway's reply topic. The
services run in this process, each with its own Kafka clients (as tests/e2e/test_embeddings.py).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import torch

from schemas.codec import decode
from schemas.messages import WorkerHeartbeat
from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from services.batcher.app import BatcherApp
from services.batcher.config import BatcherSettings
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.gateway.fakes import GatewayServer
from tests.kafka_helpers import read_until
from weir.kafka.admin import deployment_specs, ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
REPO_TOML = ROOT / "models.toml"
MODEL = "weir-tiny-py"
CONTEXT = "def add(a, b):\n    return"
CONTINUATIONS = [" a + b\n", " a - b\n"]


@pytest.fixture(scope="module")
async def pipeline():
    topics = Topics(f"lme{uuid.uuid4().hex[:8]}")
    await ensure_topics(BOOTSTRAP, deployment_specs(topics, load_model_repo(REPO_TOML)))
    common = dict(kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix, model_repo=str(REPO_TOML))
    worker = WorkerService(WorkerSettings(**common, models=MODEL, torch_threads=1, heartbeat_interval_ms=300))
    tasks = [asyncio.create_task(worker.serve())]
    beats = await read_until(
        BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs), 200
    )
    assert any(decode(WorkerHeartbeat, r.value).is_ready for r in beats), "the worker never became ready"
    stop = asyncio.Event()
    tasks.append(asyncio.create_task(BatcherApp(BatcherSettings(**common), load_model_repo(REPO_TOML)).serve(stop)))
    server = GatewayServer(create_app(GatewaySettings(**common, auth_mode="open")))
    server.topics = topics  # for the job runner of the batch test
    await server.start()
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        for _ in range(150):
            if (await http.get("/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.2)
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    for _ in range(240):  # until the gateway has seen the worker's heartbeat (503 before)
        try:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            break
        except openai.InternalServerError:
            await asyncio.sleep(0.5)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()
        stop.set()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(ROOT / "models" / MODEL, dtype=torch.float32).eval()


async def tokenize(server: GatewayServer, text: str) -> list[int]:
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        response = await http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


async def test_loglikelihood_requests_as_lm_eval_sends_them(pipeline, hf_model) -> None:
    """lm-eval's loglikelihood body: several prompts, max_tokens 0, echo, logprobs 1, temperature 0.
    Each choice (in prompt order) echoes its prompt; its legacy logprobs are the prompt's tokens,
    the first logprob null, the others transformers' log-softmax of each token given those before
    it; text_offset indexes the text. Prompts of token ids (lm-eval's tokenized requests) answer
    the same numbers."""
    server, client = pipeline
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    result = await client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in result.choices] == [0, 1]
    ids = [await tokenize(server, p) for p in prompts]
    assert result.usage.prompt_tokens == sum(map(len, ids)) and result.usage.completion_tokens == 0
    for choice, prompt, prompt_ids in zip(result.choices, prompts, ids, strict=True):
        assert choice.text == prompt and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt_ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
        assert all(prompt[at:].startswith(t) for at, t in zip(lp.text_offset, lp.tokens, strict=True))
        with torch.no_grad():
            want = torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt_ids)):
            assert lp.token_logprobs[p] == pytest.approx(float(want[p - 1, prompt_ids[p]]), abs=1e-3)
            assert len(lp.top_logprobs[p]) >= 1
    # the continuation's loglikelihood, as lm-eval sums it, prefers the right one
    context_len = len(await tokenize(server, CONTEXT))
    scores = [sum(c.logprobs.token_logprobs[context_len:]) for c in result.choices]
    tokens = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.text for c in tokens.choices] == prompts
    assert [sum(c.logprobs.token_logprobs[context_len:]) for c in tokens.choices] == pytest.approx(scores, abs=1e-4)


async def test_batched_prompts_generate_n_choices_each_in_prompt_order(pipeline) -> None:
    _, client = pipeline
    prompts = ["import os\n", "def main():\n"]
    one = [await client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    both = await client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    texts = [r.choices[0].text for r in one]
    assert [c.text for c in both.choices] == [texts[0], texts[0], texts[1], texts[1]]  # greedy: n alike
    assert both.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in one)  # each prompt once
    assert both.usage.completion_tokens == 2 * sum(r.usage.completion_tokens for r in one)  # every choice


async def test_lm_evals_own_loglikelihood_payload(pipeline) -> None:
    """lm-eval's LocalCompletionsAPI sends tokenized contexts with max_tokens 1, echo, logprobs 1 and
    a seed, and reads token_logprobs[ctxlen:-1] and whether each token was the greedy one (the top
    of its top_logprobs): the prompt's entries, then the generated token's."""
    server, client = pipeline
    ids = [await tokenize(server, CONTEXT + c) for c in CONTINUATIONS]
    result = await client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234
    )
    context_len = len(await tokenize(server, CONTEXT))
    for choice, prompt_ids in zip(result.choices, ids, strict=True):
        lp = choice.logprobs
        generated = len(lp.tokens) - len(prompt_ids)
        assert generated in (0, 1) and (generated == 1) == (choice.finish_reason == "length")
        continuation = lp.token_logprobs[context_len : len(prompt_ids)]
        assert len(continuation) == len(prompt_ids) - context_len and all(
            v is not None and v <= 0 for v in continuation
        )
        for _token, top in zip(lp.tokens[context_len:], lp.top_logprobs[context_len:], strict=True):
            assert len(top) >= 1 and all(v <= 0 for v in top.values())  # lm-eval's is_greedy reads these
        assert choice.text.startswith(CONTEXT)


@pytest.fixture(scope="module")
async def job_runner(pipeline):
    """The batch job runner the batcher process runs beside its BatcherApp (services/batcher/app.py)."""
    from schemas.registry import RegistryState
    from services.batcher.jobs import JobRunner
    from weir.bus import BusSettings

    server, _ = pipeline
    settings = BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=server.topics.prefix)
    runner = JobRunner(settings, RegistryState(load_model_repo(REPO_TOML)), "test-jobs")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    yield runner
    stop.set()
    await asyncio.wait_for(task, 30)


async def test_a_loglikelihood_batch_line_answers_what_the_endpoint_does(pipeline, job_runner) -> None:
    """The same body as a batch line runs through the batcher's job runner and the one translator:
    its output line's body is the endpoint's, prompt logprobs included."""
    import orjson

    _, client = pipeline
    body = {
        "model": MODEL,
        "prompt": [CONTEXT + c for c in CONTINUATIONS],
        "max_tokens": 0,
        "echo": True,
        "logprobs": 2,
        "temperature": 0,
    }
    content = orjson.dumps({"custom_id": "ll", "method": "POST", "url": "/v1/completions", "body": body}) + b"\n"
    uploaded = await client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    for _ in range(600):
        batch = await client.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            break
        await asyncio.sleep(0.3)
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    row = orjson.loads((await client.files.content(batch.output_file_id)).text)
    written = row["response"]["body"]
    online = (await client.completions.create(**body)).model_dump(exclude_unset=True)
    assert written["choices"] == online["choices"] and written["usage"] == online["usage"]
    assert written["choices"][1]["logprobs"]["token_logprobs"][0] is None
