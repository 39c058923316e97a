"""End to end through real processes and the real broker: what a user of Weir does and sees."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import httpx
import openai
import orjson
import pytest

from schemas.codec import decode, decode_reply
from schemas.messages import DeadLetter, GenerateRequest, ReplyDelta, ReplyEnd, now_ms
from tests.kafka_helpers import produce, read_until
from tests.waiting import until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
MODEL = "weir-tiny-py"


def test_openai_client_streams_a_chat_completion(pipeline):
    client = openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def parse(text):"}],
        max_tokens=24,
        stream=True,
        seed=3,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip(), "no text streamed"
    assert finishes in (["length"], ["stop"])
    assert len({c.id for c in chunks}) == 1


def test_openai_client_completion_without_streaming(pipeline):
    client = openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local")
    result = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0.0)
    assert result.choices[0].finish_reason in ("length", "stop")
    assert result.usage.completion_tokens >= 1 and result.usage.prompt_tokens >= 1
    again = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0.0)
    assert again.choices[0].text == result.choices[0].text  # greedy is deterministic
    assert MODEL in [m.id for m in client.models.list().data]


async def test_a_plain_kafka_client_gets_deltas_and_one_end(pipeline):
    topics = pipeline.topics
    reply_to = topics.replies(f"raw-{uuid.uuid4().hex[:6]}")
    request = GenerateRequest(
        request_id=f"raw-{uuid.uuid4().hex}",
        model=MODEL,
        prompt="class Config:\n",
        max_tokens=20,
        temperature=0.7,
        seed=11,
        deadline_ms=now_ms() + 60_000,
        reply_to=reply_to,
    )
    await produce(pipeline.bootstrap, topics.requests, [request])
    records = await read_until(
        pipeline.bootstrap, [reply_to], lambda rs: any(decode_reply(r.value).type == "end" for r in rs), 60
    )
    events = [decode_reply(r.value) for r in records]
    deltas = [e for e in events if isinstance(e, ReplyDelta)]
    ends = [e for e in events if isinstance(e, ReplyEnd)]
    assert len(ends) == 1 and ends[0].finish_reason in ("length", "stop")
    # positions from 0 without a gap, one per token (a tail may come last), the end after the last delta
    assert [d.seq for d in deltas] == [sum(p.count for p in deltas[:i]) for i in range(len(deltas))]
    assert ends[0].seq == sum(d.count for d in deltas) <= ends[0].usage.completion_tokens + 1
    assert ends[0].usage.completion_tokens <= 20 and ends[0].model_version == f"{MODEL}@1"


async def test_malformed_kafka_request_is_dead_lettered_and_the_pipeline_carries_on(pipeline):
    topics = pipeline.topics
    bad_key = f"bad-{uuid.uuid4().hex[:6]}"
    await produce(pipeline.bootstrap, topics.requests, [(bad_key, b'{"request_id": 5, "prompt": ')])
    letters = await read_until(
        pipeline.bootstrap, [topics.dead_letter], lambda rs: any(r.key == bad_key.encode() for r in rs), 30
    )
    letter = next(decode(DeadLetter, r.value) for r in letters if r.key == bad_key.encode())
    assert letter.source_topic == topics.requests and letter.reason
    client = openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local")
    after = client.completions.create(model=MODEL, prompt="def ", max_tokens=4)
    assert after.choices[0].finish_reason in ("length", "stop")


async def test_unknown_model_on_kafka_is_rejected_with_a_reason(pipeline):
    reply_to = pipeline.topics.replies(f"raw-{uuid.uuid4().hex[:6]}")
    request = GenerateRequest(
        request_id=uuid.uuid4().hex, model="no-such-model", prompt="x", deadline_ms=now_ms() + 60_000, reply_to=reply_to
    )
    await produce(pipeline.bootstrap, pipeline.topics.requests, [request])
    records = await read_until(pipeline.bootstrap, [reply_to], lambda rs: len(rs) >= 1, 30)
    end = decode_reply(records[0].value)
    assert end.finish_reason == "rejected" and end.error.code == "model_not_found"


def test_penalties_through_the_openai_client_change_the_output_and_bad_values_are_400(pipeline):
    client = openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local", max_retries=0)
    ask = dict(model=MODEL, prompt="import os\n", max_tokens=32, temperature=0.0)
    plain = client.completions.create(**ask).choices[0].text
    penalised = client.completions.create(**ask, presence_penalty=2.0).choices[0].text
    # greedy weir-tiny-py repeats "from distutils.errors import DistutilsOptionError"; the penalty breaks the loop
    assert plain.strip() and penalised.strip() and penalised != plain
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def main():"}],
        max_tokens=6,
        temperature=0.0,
        logit_bias={"42": 100},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 6  # token 42 forced: no end-of-turn
    for bad, param in [
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"99999999": -100}}, "logit_bias"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**ask, **bad)
        assert caught.value.param == param
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
            },
        )
    assert (caught.value.param, caught.value.code) == ("response_format.json_schema.schema", "unsupported_schema")


async def test_a_raw_request_with_a_bad_penalty_is_dead_lettered_with_a_readable_reason(pipeline):
    topics = pipeline.topics
    reply_to = topics.replies(f"raw-{uuid.uuid4().hex[:6]}")
    request_id = f"pen-{uuid.uuid4().hex}"
    raw = orjson.dumps(
        {
            "request_id": request_id,
            "model": MODEL,
            "prompt": "x",
            "presence_penalty": 5,
            "deadline_ms": now_ms() + 60_000,
            "reply_to": reply_to,
        }
    )
    await produce(pipeline.bootstrap, topics.requests, [(request_id, raw)])
    letters = await read_until(
        pipeline.bootstrap, [topics.dead_letter], lambda rs: any(r.key == request_id.encode() for r in rs), 30
    )
    letter = next(decode(DeadLetter, r.value) for r in letters if r.key == request_id.encode())
    assert "presence_penalty: must be less than or equal to 2, got 5" in letter.reason
    records = await read_until(pipeline.bootstrap, [reply_to], lambda rs: len(rs) >= 1, 30)
    end = decode_reply(records[0].value)
    assert end.finish_reason == "rejected" and "presence_penalty" in end.error.message


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b'{"model": "weir-tiny-py"}', 400, "messages"),
        (
            b'{"model": "weir-tiny-py", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "weir-tiny-py", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
            400,
            "temperature",
        ),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
)
def test_bad_http_bodies_get_openai_errors(pipeline, body, status, param):
    resp = httpx.post(
        f"{pipeline.base_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param


def test_oversized_prompt_is_refused_not_crashed(pipeline):
    client = openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="def f(x): return x\n" * 400, max_tokens=4)
    assert "token" in str(caught.value).lower()
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


async def test_every_served_request_is_in_a_verifiable_audit_log_without_raw_text(pipeline):
    client = openai.AsyncOpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local")
    secret = f"SECRET-{uuid.uuid4().hex}"
    done = await client.completions.create(model=MODEL, prompt=f"# {secret}\n", max_tokens=4)

    def shown() -> subprocess.CompletedProcess[str] | None:
        show = subprocess.run(
            [sys.executable, "-m", "weir.cli", "audit", "show", "--db", str(pipeline.audit_db), "--limit", "1000"],
            capture_output=True,
            text=True,
        )
        return show if done.id in show.stdout else None

    await until(shown, timeout_s=30, interval_s=0.2, what=f"{done.id} in `weir audit show`")
    verify = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "weir.cli",
            "audit",
            "verify",
            "--db",
            str(pipeline.audit_db),
            "--bootstrap",
            pipeline.bootstrap,
            "--topic-prefix",
            pipeline.topics.prefix,
        ],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stdout + verify.stderr
    assert secret.encode() not in pipeline.audit_db.read_bytes()
