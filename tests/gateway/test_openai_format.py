"""openai_format: bodies → GenerateRequest, reply events → OpenAI chunks/bodies/errors."""

from __future__ import annotations

import orjson
import pytest

from schemas.messages import ErrorInfo, ReplyEnd, Usage
from schemas.model_repo import ModelConfig
from services.gateway.openai_format import (
    ApiError,
    ChunkWriter,
    completion_body,
    parse_body,
    terminal_error,
    to_generate_request,
)

ECHO = ModelConfig(name="echo", engine="echo", max_model_len=2048, default_timeout_s=30)
NOW_MS = 1_700_000_000_000


def chat(**fields) -> bytes:
    return orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}], **fields})


def to_request(kind, raw, client_timeout_s=None):
    return to_generate_request(
        kind,
        parse_body(kind, raw),
        ECHO,
        request_id="chatcmpl-1",
        reply_to="weir.replies.g",
        now_ms=NOW_MS,
        client_timeout_s=client_timeout_s,
        max_timeout_s=600,
    )


def test_chat_body_becomes_generate_request() -> None:
    raw = chat(
        max_tokens=5,
        temperature=0,
        top_p=0.5,
        top_k=3,
        stop="\n",
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        user="u",
        frequency_penalty=0,
    )
    req = to_request("chat.completions", raw)
    assert req.messages is not None and req.messages[0].content == "hi" and req.prompt is None
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.stop, req.seed) == (5, 0.0, 0.5, 3, ["\n"], 7)
    assert req.stream and req.priority == "interactive" and req.principal == "anonymous" and req.tenant == "default"
    assert req.reply_to == "weir.replies.g" and req.deadline_ms == NOW_MS + 30_000


def test_max_completion_tokens_wins_and_defaults_apply() -> None:
    assert to_request("chat.completions", chat(max_tokens=9, max_completion_tokens=4)).max_tokens == 4
    req = to_request("completions", orjson.dumps({"model": "echo", "prompt": "x"}))
    assert req.prompt == "x" and req.max_tokens == 16 and req.temperature == 1.0 and req.stop == []


def test_deadline_is_tightest_of_header_body_and_model() -> None:
    assert to_request("chat.completions", chat(), client_timeout_s=2.5).deadline_ms == NOW_MS + 2_500
    assert to_request("chat.completions", chat(timeout_s=1.0), client_timeout_s=5).deadline_ms == NOW_MS + 1_000
    assert to_request("chat.completions", chat(timeout_s=999)).deadline_ms == NOW_MS + 30_000


def test_content_parts_and_developer_role() -> None:
    raw = orjson.dumps(
        {
            "model": "echo",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        }
    )
    req = to_request("chat.completions", raw)
    assert [(m.role, m.content) for m in req.messages or []] == [("system", "be brief"), ("user", "ab")]


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1]", None, "invalid_body"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model", "missing_required_parameter"),
        (chat(max_tokens=-1), "max_tokens", "invalid_value"),
        (chat(max_tokens="5"), "max_tokens", "invalid_value"),
        (chat(temperature=3), "temperature", "invalid_value"),
        (chat(stream="yes"), "stream", "invalid_value"),
        (chat(n=17), "n", "invalid_value"),
        (chat(stop=["a"] * 17), "stop", "invalid_value"),
        (chat(top_logprobs=2), "top_logprobs", "invalid_value"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (
            orjson.dumps({"model": "echo", "messages": [{"role": "robot", "content": "x"}]}),
            "messages.0.role",
            "invalid_value",
        ),
    ],
)
def test_bad_bodies_name_the_parameter(raw: bytes, param: str | None, code: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_body("chat.completions", raw)
    error = info.value.body()["error"]
    assert info.value.status == 400
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"]


def test_max_tokens_beyond_context_is_refused() -> None:
    with pytest.raises(ApiError) as info:
        to_request("chat.completions", chat(max_tokens=4096))
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"


def test_completion_prompts_are_strings_or_token_ids_not_a_mix() -> None:
    # token ids past 2^31 (2^32, 2^63) reached the input guard's decode and answered 500
    for bad in ([], [[]], ["a", [1]], [1, "a"], [-1], {"a": 1}, [2**31], [2**32], [[1, 2**63 - 1]]):
        with pytest.raises(ApiError) as info:
            parse_body("completions", orjson.dumps({"model": "echo", "prompt": bad}))
        assert info.value.param and info.value.param.startswith("prompt"), bad
    for good, prompts in (("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])):
        assert parse_body("completions", orjson.dumps({"model": "echo", "prompt": good})).prompts == prompts


def test_chat_chunks_role_first_then_finish_then_usage() -> None:
    writer = ChunkWriter("chat.completions", "chatcmpl-1", "echo", 1700, include_usage=True)
    first = writer.on_text("He")
    second = writer.on_text("llo")
    end = ReplyEnd(
        request_id="chatcmpl-1",
        seq=2,
        finish_reason="length",
        model_version="echo@1",
        usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5, cached_prompt_tokens=2),
    )
    finish, usage = writer.on_end(end)
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-1"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert second["choices"][0]["delta"] == {"content": "llo"} and second["usage"] is None
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert finish["system_fingerprint"] == "echo@1"
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_completion_chunks_without_usage() -> None:
    writer = ChunkWriter("completions", "cmpl-1", "echo", 1700, include_usage=False)
    chunk = writer.on_text("x")
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "x" and "usage" not in chunk
    chunks = writer.on_end(ReplyEnd(request_id="cmpl-1", seq=1, finish_reason="stop"))
    assert len(chunks) == 1 and chunks[0]["choices"][0]["finish_reason"] == "stop"


def test_completion_bodies() -> None:
    end = ReplyEnd(request_id="r", seq=3, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=3))
    body = completion_body("chat.completions", "r", "echo", 1700, "abc", end)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert body["usage"]["total_tokens"] == 4
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # none reported: 0, as OpenAI says
    body = completion_body("completions", "r", "echo", 1700, "abc", end)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "abc"


@pytest.mark.parametrize(
    ("reason", "code", "status"),
    [
        ("timeout", None, 504),
        ("rejected", "prompt_too_long", 400),
        ("rejected", "queue_full", 429),
        ("error", "oom", 500),
        ("cancelled", None, 503),
    ],
)
def test_terminal_errors_map_to_statuses(reason: str, code: str | None, status: int) -> None:
    error = ErrorInfo(code=code, message="why") if code else None
    api_error = terminal_error(ReplyEnd(request_id="r", seq=0, finish_reason=reason, error=error))
    assert api_error is not None and api_error.status == status
    body = api_error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"]
    assert terminal_error(ReplyEnd(request_id="r", seq=0, finish_reason="stop")) is None


@pytest.mark.parametrize("code", ["prompt_too_long", "input_too_long"])
def test_a_workers_context_length_refusal_is_openais_context_length_exceeded(code: str) -> None:
    """The worker counts the prompt as its template renders it, so it may refuse what the gateway's
    count let through: the client gets OpenAI's code with the worker's words (issue 35, item 5)."""
    message = "This model's maximum context length is 2048 tokens. However, your messages resulted in 2050 tokens."
    end = ReplyEnd(request_id="r", seq=0, finish_reason="rejected", error=ErrorInfo(code=code, message=message))
    api_error = terminal_error(end)
    assert api_error is not None and api_error.status == 400
    assert api_error.body()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }


@pytest.mark.parametrize(
    ("code", "param"),
    [("invalid_regex", "structured_outputs.regex"), ("invalid_logit_bias", "logit_bias"), ("invalid_schema", None)],
)
def test_a_workers_rejection_names_the_parameter_where_only_one_can_be_at_fault(code: str, param: str | None) -> None:
    """A regex the compiler refused can only be structured_outputs.regex; a schema may be any of three."""
    end = ReplyEnd(request_id="r", seq=0, finish_reason="rejected", error=ErrorInfo(code=code, message="bad"))
    api_error = terminal_error(end)
    assert api_error is not None and api_error.status == 400 and api_error.body()["error"]["param"] == param
