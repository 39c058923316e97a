"""n, best_of, logprobs, echo and suffix at the gateway (docs/design.md, "Structured output, tools
and logprobs": "n and best_of are sibling requests").

Pure functions and a SiblingGroup fed by hand first; then, against the real broker with the fake
worker (tests/gateway/fakes.py), one body with n = 2 answered whole, streamed over SSE and over a
WebSocket.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect

from schemas.messages import (
    ErrorInfo,
    GenerateRequest,
    ReplyDelta,
    ReplyEnd,
    TokenLogprob,
    TopLogprob,
    Usage,
    now_ms,
    sibling_seed,
)
from schemas.openai_bodies import MAX_N
from services.gateway.config import GatewaySettings
from services.gateway.guard.output_guard import REDACTED_TOKEN, LogprobGate, OutputGuard, PassThrough
from services.gateway.guard.settings import TenantLimits
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.openai_format import (
    ApiError,
    ChoiceResult,
    ChunkWriter,
    best_of,
    choices_body,
    choices_usage,
    parse_body,
    sibling_requests,
    terminal_error,
)
from services.gateway.siblings import SiblingGroup
from services.gateway.streaming import ChoiceFilters, collect, frames, sse_events
from tests.waiting import until

from .conftest import Stack
from .fakes import DRIP, TEXT


def request(request_id: str = "cmpl-1", **fields: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, model="echo@1", prompt="hi", deadline_ms=now_ms() + 10_000, reply_to="replies", **fields
    )


def lp(token: str, logprob: float, *alternatives: tuple[str, float]) -> TokenLogprob:
    top = [TopLogprob(token_id=i, token=t, bytes=list(t.encode()), logprob=p) for i, (t, p) in enumerate(alternatives)]
    return TokenLogprob(token_id=99, token=token, bytes=list(token.encode()), logprob=logprob, top_logprobs=top)


def end(request_id: str, seq: int, completion: int = 1, cumulative: float | None = None, **fields: Any) -> ReplyEnd:
    usage = Usage(prompt_tokens=4, completion_tokens=completion, total_tokens=4 + completion, cached_prompt_tokens=2)
    return ReplyEnd(
        request_id=request_id,
        seq=seq,
        finish_reason="stop",
        usage=usage,
        cumulative_logprob=cumulative,
        model_version="echo@1",
        **fields,
    )


# -- bodies and pure formatting --------------------------------------------------------------------


def test_siblings_have_derived_ids_and_seeds_and_a_rerun_repeats_them() -> None:
    derived = sibling_requests(request("cmpl-7", max_tokens=5), 3)
    assert [r.request_id for r in derived] == ["cmpl-7/0", "cmpl-7/1", "cmpl-7/2"]
    parent_seed = request("cmpl-7").effective_seed  # the body gave none: derived from the parent's id
    assert [r.seed for r in derived] == [sibling_seed(parent_seed, i) for i in range(3)]
    assert len({r.seed for r in derived}) == 3 and all(r.max_tokens == 5 for r in derived)
    assert [r.seed for r in sibling_requests(request("cmpl-7", max_tokens=5), 3)] == [r.seed for r in derived]
    assert [r.seed for r in sibling_requests(request(seed=42), 2)] == [42, sibling_seed(42, 1)]
    assert sibling_requests(one := request(), 1) == [one]  # n = 1: the request itself, its own id


CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "echo", "prompt": "hi"}


@pytest.mark.parametrize(
    ("kind", "fields", "param", "code", "words"),
    [
        ("chat.completions", {"n": MAX_N + 1}, "n", "invalid_value", f"at most {MAX_N}"),
        ("chat.completions", {"top_logprobs": 2}, "top_logprobs", "invalid_value", "logprobs: true"),
        ("completions", {"logprobs": 6}, "logprobs", "invalid_value", "5"),
        ("completions", {"n": 3, "best_of": 2}, "best_of", "invalid_value", "at least n"),
        ("completions", {"best_of": 2, "stream": True}, "best_of", "invalid_value", "streamed"),
        (
            "completions",
            {"echo": True, "logprobs": 0, "stream": True},
            "stream",
            "unsupported_parameter",
            "stream false",
        ),
        ("chat.completions", {"suffix": "x"}, "suffix", "unknown_parameter", "suffix"),
    ],
)
def test_choice_parameters_that_weir_cannot_serve_are_400_naming_them(kind, fields, param, code, words) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(kind, orjson.dumps({**(CHAT if kind == "chat.completions" else COMPLETION), **fields}))
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    assert words in info.value.message


def _token(text: str) -> TokenLogprob:
    alternative = TopLogprob(token_id=2, token="x", bytes=[120], logprob=-3.0)
    return TokenLogprob(token_id=1, token=text, bytes=list(text.encode()), logprob=-0.5, top_logprobs=[alternative])


@pytest.mark.parametrize("redacting", [True, False])
def test_logprobs_go_out_with_their_text_and_the_redacted_ones_are_masked(redacting: bool) -> None:
    pieces = ["Mail ", "alice", "@", "example", ".com", " today", " please", "."]
    gate = LogprobGate(OutputGuard(redacting, 256).stream())
    text, tokens = "", []
    for piece in pieces:
        out, released = gate.feed(piece, [_token(piece)])
        text, tokens = text + out, tokens + released
        released_text = "".join(t.token for t in tokens if t.token != REDACTED_TOKEN)
        assert len(released_text) <= len(text) or not redacting  # never ahead of the text it stands for
    out, released = gate.flush()
    text, tokens = text + out, tokens + released
    assert [t.logprob for t in tokens] == [-0.5] * len(pieces)  # every token, in order, once
    if not redacting:
        assert text == "".join(pieces) and [t.token for t in tokens] == pieces
        return
    assert "alice" not in text and "[REDACTED]" in text
    shown = [t.token for t in tokens]
    assert not {"alice", "@", "example", ".com"} & set(shown), shown
    assert shown[0] == "Mail " and shown[-1] == "."
    assert all(t.top_logprobs == [] for t in tokens if t.token == REDACTED_TOKEN)


def test_a_worker_refusing_suffix_is_a_400_naming_suffix() -> None:
    rejected = ReplyEnd(
        request_id="r",
        seq=0,
        finish_reason="rejected",
        error=ErrorInfo(code="suffix_unsupported", message="echo@1 has no FIM tokens"),
    )
    error = terminal_error(rejected)
    assert error is not None and (error.status, error.param, error.code) == (400, "suffix", "suffix_unsupported")


def test_whole_bodies_render_both_logprobs_formats_echo_and_usage() -> None:
    results = [
        ChoiceResult(0, "ab", end("r/0", 2, 2), [lp("a", -0.5, ("a", -0.5), ("x", -1.0)), lp("b", -0.25)]),
        ChoiceResult(1, "c", end("r/1", 1, 1), [lp("c", -2.0)]),
    ]
    usage = choices_usage([r.end for r in results])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (4, 3, 2)  # prompt once
    chat = choices_body("chat.completions", "r", "echo@1", 0, results, usage, "chat")
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert chat["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [97]},
                    {"token": "x", "logprob": -1.0, "bytes": [120]},
                ],
            },
            {"token": "b", "logprob": -0.25, "bytes": [98], "top_logprobs": []},
        ],
        "refusal": None,
    }
    legacy = choices_body("completions", "r", "echo@1", 0, results, usage, "legacy", echo="hi ")
    assert legacy["choices"][0]["text"] == "hi ab" and legacy["choices"][1]["text"] == "hi c"
    assert legacy["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"a": -0.5, "x": -1.0}, {}],
        "text_offset": [3, 4],
    }
    assert choices_body("completions", "r", "echo@1", 0, results, usage)["choices"][0]["logprobs"] is None


def test_best_of_keeps_the_n_highest_cumulative_logprobs_renumbered() -> None:
    results = [
        ChoiceResult(i, t, end(f"r/{i}", 1, cumulative=c))
        for i, (t, c) in enumerate([("a", -3.0), ("b", -1.0), ("c", -2.0), ("d", -1.0)])
    ]
    assert [(r.index, r.text) for r in best_of(results, 2)] == [(0, "b"), (1, "d")]  # ties: sibling order
    assert best_of(results, 4) == results
    unranked = [*results[:3], ChoiceResult(3, "d", end("r/3", 1))]
    with pytest.raises(ApiError) as info:
        best_of(unranked, 1)
    assert info.value.code == "cumulative_logprob_missing"


# -- a SiblingGroup fed by hand (no broker: events go straight to the gateway's reply router) ------


def group_of(num: int, keep: int | None = None) -> tuple[GatewayBus, SiblingGroup, list[tuple[str, str]]]:
    bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1"))
    cancels: list[tuple[str, str]] = []
    bus.publish_cancel = lambda request_id, reason: cancels.append((request_id, reason))
    parent = request("cmpl-g", stream=True)
    exchanges = [Exchange(bus, r, bus.router.register(r.request_id)) for r in sibling_requests(parent, num)]
    return bus, SiblingGroup(parent, exchanges, keep or num), cancels


def passing() -> ChoiceFilters:
    return ChoiceFilters(PassThrough(), PassThrough)


async def test_a_stream_of_siblings_interleaves_choices_with_a_finish_each_and_one_usage() -> None:
    bus, group, _ = group_of(2)
    on = bus.router.on_event
    on(ReplyDelta(request_id="cmpl-g/1", seq=0, text="B", logprobs=[lp("B", -1.0)]))
    on(ReplyDelta(request_id="cmpl-g/0", seq=0, text="A", logprobs=[lp("A", -0.5)]))
    on(end("cmpl-g/1", 1))
    on(end("cmpl-g/0", 1))
    writer = ChunkWriter("completions", "cmpl-g", "echo@1", 0, include_usage=True, logprobs="legacy", echo="hi")
    seen = [(seq, frame) async for seq, frame in frames(group, writer, passing())]
    chunks = [frame for _, frame in seen if isinstance(frame, dict)]
    assert len(chunks) == len(seen)  # no error frame
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks if c["choices"]]
    assert sorted(texts) == sorted([(0, "hi"), (0, "A"), (0, ""), (1, "hi"), (1, "B"), (1, "")])
    assert texts[0] == (0, "hi") and texts.index((0, "hi")) < texts.index((0, "A"))  # the echo opens each choice
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    a = next(c for c in chunks if c["choices"] and c["choices"][0]["text"] == "A")
    assert a["choices"][0]["logprobs"]["text_offset"] == [2]  # after the echoed "hi"
    usage = [c["usage"] for c in chunks if not c["choices"]]
    assert (
        usage
        == [
            {
                "prompt_tokens": 4,
                "completion_tokens": 2,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 2},
            }
        ]
        and chunks[-1]["usage"] == usage[0]
    )
    # the merged order is kept: a reader that comes back renders the same frames again (resume)
    again = [(seq, frame) async for seq, frame in frames(group, writer.fresh(), passing())]
    assert again == seen
    last_id = seen[2][0]
    tail = b"".join([chunk async for chunk in sse_events(group, writer.fresh(), passing(), after_seq=last_id)])
    assert tail.count(b"id: ") == sum(1 for seq, _ in seen if seq > last_id) + 1  # + [DONE]


async def test_one_failed_sibling_fails_the_request_and_cancels_the_others() -> None:
    bus, group, cancels = group_of(3)
    bus.router.on_event(ReplyDelta(request_id="cmpl-g/0", seq=0, text="A"))
    bus.router.on_event(
        ReplyEnd(
            request_id="cmpl-g/1",
            seq=0,
            finish_reason="rejected",
            error=ErrorInfo(code="queue_full", message="too busy"),
        )
    )
    writer = ChunkWriter("chat.completions", "cmpl-g", "echo@1", 0, include_usage=False)
    chunks = [frame async for _, frame in frames(group, writer, passing())]
    assert isinstance(chunks[-1], ApiError) and chunks[-1].status == 429
    assert sorted(cancels) == [("cmpl-g/0", "client_disconnect"), ("cmpl-g/2", "client_disconnect")]
    assert group.end is not None and group.end.finish_reason == "rejected"


async def never_gone() -> dict[str, Any]:
    await asyncio.sleep(3600)  # a stub that never answers: the test cancels it
    return {}


async def test_a_whole_best_of_body_keeps_the_best_and_bills_every_sibling() -> None:
    bus, group, _ = group_of(3, keep=1)
    for i, (text, cumulative) in enumerate([("a", -2.0), ("b", -0.5), ("c", -1.0)]):
        bus.router.on_event(ReplyDelta(request_id=f"cmpl-g/{i}", seq=0, text=text))
        bus.router.on_event(end(f"cmpl-g/{i}", 1, completion=2, cumulative=cumulative))
    writer = ChunkWriter("completions", "cmpl-g", "echo@1", 0, include_usage=False, echo="hi ")
    body = await collect(group, "completions", 0, never_gone, lambda text: text, None, writer)
    assert body is not None
    assert body["choices"] == [{"index": 0, "text": "hi b", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == 4


# -- against the broker, with the fake worker --------------------------------------------------------

kafka = pytest.mark.kafka


@kafka
async def test_n_choices_whole_and_streamed_over_sse_and_websocket(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:

        async def is_ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await until(is_ready, timeout_s=10, what="the gateway ready")
        whole = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 7})
        assert whole.status_code == 200, whole.text
        body = whole.json()
        assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "".join(TEXT))] * 1 + [
            (1, "".join(TEXT))
        ]
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (2, 6)  # prompt once
        sent = {r.request_id: r for r in stack.worker.requests if r.request_id.startswith(body["id"])}
        assert sorted(sent) == [f"{body['id']}/0", f"{body['id']}/1"]
        assert [sent[f"{body['id']}/{i}"].seed for i in range(2)] == [7, sibling_seed(7, 1)]

        stream = {**COMPLETION, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
        raw = (await client.post("/v1/completions", json=stream)).content
    events = [
        orjson.loads(line[6:])
        for line in raw.decode().splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    for index in (0, 1):
        of_choice = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in of_choice) == "".join(TEXT)
        assert [c["finish_reason"] for c in of_choice if c["finish_reason"]] == ["stop"]
    assert [e["usage"]["completion_tokens"] for e in events if not e["choices"]] == [6]

    url = stack.base_url.replace("http", "ws") + "/v1/stream"
    async with connect(url) as ws:
        await ws.send(orjson.dumps({"type": "chat.completions", "body": {**CHAT, "n": 3}}).decode())
        frames_: list[dict[str, Any]] = []
        while not frames_ or frames_[-1].get("type") not in ("done", "error"):
            frames_.append(orjson.loads(await ws.recv()))
    assert frames_[-1] == {"type": "done"}
    roles = [f["choices"][0]["index"] for f in frames_[:-1] if f["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1, 2]  # each choice opens with the assistant role
    for index in range(3):
        text = "".join(
            f["choices"][0]["delta"].get("content", "") for f in frames_[:-1] if f["choices"][0]["index"] == index
        )
        assert text == "".join(TEXT)


@kafka
async def test_every_sibling_is_charged_to_the_tenants_limits(stack: Stack) -> None:
    """n does not get around a tenant's token limit: each sibling reserves prompt + max_tokens."""
    before = stack.settings.tenant_limits
    stack.settings.tenant_limits = {"*": TenantLimits(max_tokens_per_min=300)}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
            one = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 100})
            assert one.status_code == 200, one.text  # one choice fits (and its terminal refunds the unused)
            three = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 100, "n": 3})
    finally:
        stack.settings.tenant_limits = before
    assert three.status_code == 429, three.text
    assert three.json()["error"]["type"] == "rate_limit_error"
    assert not [r for r in stack.worker.requests if r.request_id.startswith(three.headers["x-request-id"])]


@kafka
async def test_a_stream_of_n_choices_resumes_with_last_event_id(stack: Stack) -> None:
    body = {"model": "echo", "prompt": "drip", "stream": True, "n": 2}
    texts: dict[int, list[str]] = {0: [], 1: []}

    async def read(response: httpx.Response, max_texts: int | None = None) -> int:
        last_id = -1
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                last_id = int(line[4:])
            elif line.startswith("data: ") and line != "data: [DONE]":
                choice = orjson.loads(line[6:])["choices"][0]
                texts[choice["index"]].append(choice["text"])
                if max_texts is not None and sum(map(len, texts.values())) == max_texts:
                    break
        return last_id

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as client:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"x-weir-resume-grace-s": "10"}
        ) as first:
            request_id = first.headers["x-request-id"]
            assert first.headers["x-weir-resume-url"] == f"/v1/streams/{request_id}"
            last_id = await read(first, max_texts=5)
        # away until the worker has sent every delta of both choices: the resume must bring what
        # was made meanwhile, in order and once
        await until(
            lambda: sum(n for rid, n in stack.worker.generated.items() if rid.startswith(request_id)) >= 2 * len(DRIP),
            timeout_s=20,
            what="both choices generated while the client is away",
        )
        async with client.stream("GET", f"/v1/streams/{request_id}", headers={"last-event-id": str(last_id)}) as again:
            assert again.status_code == 200
            await read(again)
    assert ["".join(texts[i]) for i in (0, 1)] == ["".join(DRIP)] * 2  # every token once, in order
    assert all(stack.worker.generated[f"{request_id}/{i}"] == len(DRIP) for i in (0, 1))  # nothing regenerated
    assert not stack.worker.cancels_of(f"{request_id}/0") and not stack.worker.cancels_of(f"{request_id}/1")
