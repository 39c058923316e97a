"""Every OpenAI parameter of chat and completions is honoured or refused with a 400 naming it.

Through the app over httpx's ASGI transport without its lifespan (no broker): a body that passes
validation gets 503 (not connected), so "accepted" is a 503 here and "refused" a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from schemas.messages import ErrorInfo, ReplyEnd
from schemas.openai_bodies import UNSUPPORTED, ChatCompletionBody, CompletionBody
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.openai_format import parse_body, terminal_error, to_generate_request

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "echo", "prompt": "hi"},
}

# OpenAI's API reference, parameter by parameter (chat/create, completions/create), and what Weir does
HONOURED = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
}
CHAT_HONOURED = {"response_format", "tools", "tool_choice", "parallel_tool_calls"}  # test_structured_bodies.py
BY_DESIGN = {"user", "metadata", "safety_identifier", "prompt_cache_key"}  # cannot change the output
OPENAI_CHAT = (
    HONOURED
    | CHAT_HONOURED
    | BY_DESIGN
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "store",
        "service_tier",
    }
)
OPENAI_COMPLETIONS = HONOURED | {"user", "prompt", "best_of", "echo", "logprobs", "suffix"}
# a value of each refused parameter that asks for something Weir cannot do
ASKING = {
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "service_tier": "flex",
}


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1", auth_mode="open")
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        yield client


async def post(client: httpx.AsyncClient, endpoint: str, **fields: Any) -> httpx.Response:
    return await client.post(ENDPOINTS[endpoint], json={**BODIES[endpoint], **fields})


def assert_refused(response: httpx.Response, param: str, code: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param.split(".")[0] in error["message"] or code == "unsupported_parameter", error["message"]


def test_every_openai_parameter_is_a_declared_field():
    """Nothing of OpenAI's API falls through to `unknown_parameter`, and nothing is left unclassified."""
    assert set(ChatCompletionBody.model_fields) >= OPENAI_CHAT
    assert set(CompletionBody.model_fields) >= OPENAI_COMPLETIONS
    declared = set(ChatCompletionBody.model_fields) | set(CompletionBody.model_fields)
    extensions = {"top_k", "ignore_eos", "timeout_s", "structured_outputs"}
    honoured_by_one = {"messages", "prompt", "max_completion_tokens", "top_logprobs", "best_of", "echo", "suffix"}
    assert declared - extensions - HONOURED - CHAT_HONOURED - BY_DESIGN - honoured_by_one == set(UNSUPPORTED)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"12": "1"}}, "logit_bias.12"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
async def test_out_of_range_penalties_and_bad_logit_bias_are_400_naming_them(client, endpoint, fields, param):
    assert_refused(await post(client, endpoint, **fields), param, "invalid_value")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_penalties_and_logit_bias_in_range_are_accepted(client, endpoint):
    fields = {"presence_penalty": -2, "frequency_penalty": 2.0, "logit_bias": {"0": -100, "12": 100, "7": 0.5}}
    assert (await post(client, endpoint, **fields)).status_code == 503  # valid: only Kafka is missing


@pytest.mark.parametrize(
    ("endpoint", "param"),
    [("chat", p) for p in sorted(OPENAI_CHAT & set(UNSUPPORTED))]
    + [("completions", p) for p in sorted(OPENAI_COMPLETIONS & set(UNSUPPORTED))],
)
async def test_each_unsupported_parameter_is_refused_by_name(client, endpoint, param):
    assert_refused(await post(client, endpoint, **{param: ASKING[param]}), param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        (
            "chat",
            {
                "response_format": {"type": "text"},
                "logprobs": False,
                "tools": [],
                "tool_choice": "none",
                "store": False,
                "service_tier": "auto",
                "modalities": ["text"],
                "n": 1,
            },
        ),
        ("chat", {"user": "u-1", "metadata": {"run": "7"}, "safety_identifier": "s", "prompt_cache_key": "k"}),
        ("completions", {"echo": False, "suffix": "", "best_of": 1, "n": 1, "user": "u-1"}),
    ],
)
async def test_neutral_values_and_output_neutral_parameters_are_accepted(client, endpoint, fields):
    assert (await post(client, endpoint, **fields)).status_code == 503


@pytest.mark.parametrize(("endpoint", "fields"), [("chat", {"logprobs": True}), ("completions", {"logprobs": 0})])
async def test_logprobs_are_served_while_the_output_guard_redacts(client, endpoint, fields):
    # the default WEIR_OUTPUT_GUARD=redact masks the tokens of what it redacts (LogprobGate): the
    # body is accepted and goes on to a worker (none here: 503)
    assert (await post(client, endpoint, **fields)).status_code == 503


async def test_deprecated_functions_are_refused_pointing_at_tools(client):
    response = await post(client, "chat", functions=[{"name": "f", "parameters": {"type": "object"}}])
    assert_refused(response, "functions", "unsupported_parameter")
    assert "use tools" in response.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_parameter_openai_does_not_have_is_refused_by_name(client, endpoint):
    assert_refused(await post(client, endpoint, repetition_penalty=1.2), "repetition_penalty", "unknown_parameter")
    assert_refused(
        await post(client, endpoint, stream_options={"include_usage": True, "x": 1}),
        "stream_options.x",
        "unknown_parameter",
    )


async def test_message_names_and_unknown_message_fields_are_refused(client):
    named = {"messages": [{"role": "user", "content": "hi", "name": "alice"}]}
    assert_refused(await post(client, "chat", **named), "messages.0.name", "unsupported_parameter")
    unknown = {"messages": [{"role": "assistant", "content": "", "weight": 1}]}
    assert_refused(await post(client, "chat", **unknown), "messages.0.weight", "unknown_parameter")


async def test_embeddings_refuse_unknown_parameters(client):
    response = await client.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x", "truncate": True})
    assert_refused(response, "truncate", "unknown_parameter")


def test_penalties_and_logit_bias_reach_the_generate_request():
    from schemas.model_repo import ModelConfig

    echo = ModelConfig(name="echo", engine="echo", max_model_len=2048, default_timeout_s=30)
    raw = orjson.dumps({**BODIES["chat"], "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"3": -100}})
    request = to_generate_request(
        "chat.completions",
        parse_body("chat.completions", raw),
        echo,
        request_id="r",
        reply_to="t",
        now_ms=0,
        client_timeout_s=None,
        max_timeout_s=60,
    )
    assert (request.presence_penalty, request.frequency_penalty, request.logit_bias) == (0.5, -1.0, {"3": -100.0})
    plain = to_generate_request(
        "completions",
        parse_body("completions", orjson.dumps(BODIES["completions"])),
        echo,
        request_id="r",
        reply_to="t",
        now_ms=0,
        client_timeout_s=None,
        max_timeout_s=60,
    )
    assert (plain.presence_penalty, plain.frequency_penalty, plain.logit_bias) == (0.0, 0.0, None)


def test_a_token_id_outside_the_vocabulary_is_400_naming_logit_bias():
    """The worker knows the vocabulary; its rejection comes back as a 400 naming the parameter."""
    info = ErrorInfo(code="invalid_logit_bias", message="logit_bias names token id 99999, outside the vocabulary")
    error = terminal_error(ReplyEnd(request_id="r", seq=0, finish_reason="rejected", error=info))
    assert error is not None and error.status == 400
    assert (error.param, error.code) == ("logit_bias", "invalid_logit_bias") and "99999" in error.message
