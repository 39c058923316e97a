"""Structured output and tools on the OpenAI surface: bodies → GenerateRequest fields, refusals
named as OpenAI names them, and tool calls in bodies and chunks that the openai client itself
parses and accumulates (docs/design.md, "Structured output, tools and logprobs").

Pure and fast: parse_body/to_generate_request, completion_body and the stream's frames over an
Exchange whose events are handed in (no broker), the batch runner's parse and output files.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import omit
from openai.lib._parsing._completions import parse_chat_completion, type_to_response_format_param
from openai.lib._tools import pydantic_function_tool
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from schemas.messages import (
    MAX_SCHEMA_BYTES,
    GenerateRequest,
    NamedToolChoice,
    ReplyDelta,
    ReplyEnd,
    StructuredOutputs,
    ToolCall,
    ToolCallDelta,
    Usage,
    now_ms,
)
from schemas.model_repo import ModelConfig, load_model_repo
from schemas.registry import RegistryState
from services.batcher.job_core import JobResults, parse_input
from services.gateway.app import create_app
from services.gateway.batch_format import redact_result_line
from services.gateway.config import GatewaySettings
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.guard.redaction import MAX_PATTERN_CHARS
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.openai_format import (
    ApiError,
    ChunkWriter,
    completion_body,
    guarded_calls,
    parse_body,
    to_generate_request,
)
from services.gateway.streaming import frames

ECHO = ModelConfig(name="echo", engine="echo", max_model_len=2048, default_timeout_s=30)
USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop"}},
]
PHONE = "+1 415-555-0132"  # a phone number the output guard redacts
GUARD = OutputGuard(True, MAX_PATTERN_CHARS)


def request_of(kind: str = "chat.completions", **fields: Any) -> GenerateRequest:
    base = {"model": "echo", "messages": USER} if kind == "chat.completions" else {"model": "echo", "prompt": "x"}
    body = parse_body(kind, orjson.dumps({**base, **fields}))
    return to_generate_request(
        kind,
        body,
        ECHO,
        request_id="chatcmpl-1",
        reply_to="weir.replies.g",
        now_ms=0,
        client_timeout_s=None,
        max_timeout_s=600,
    )


def refusal(**fields: Any) -> tuple[str | None, str | None, str]:
    with pytest.raises(ApiError) as caught:
        request_of(**fields)
    error = caught.value
    assert error.status == 400 and error.body()["error"]["type"] == "invalid_request_error"
    return error.param, error.code, error.message


class Unit(enum.Enum):
    C = "c"
    F = "f"


class Place(BaseModel):
    city: str
    country: str | None


class Weather(BaseModel):
    city: str
    unit: Unit


class Forecast(BaseModel):
    place: Place
    unit: Unit
    highs: list[int]


def test_response_format_and_structured_outputs_become_the_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "description": "an a"}}
    assert request_of(response_format=fmt).structured == StructuredOutputs(json_schema=schema)
    assert request_of(response_format={"type": "json_object"}).structured == StructuredOutputs(json_object=True)
    assert request_of(response_format={"type": "text"}).structured is None
    # vLLM's extension, on both endpoints; its `json` may be the schema's JSON text
    assert request_of(structured_outputs={"json": orjson.dumps(schema).decode()}).structured == StructuredOutputs(
        json_schema=schema
    )
    assert request_of("completions", structured_outputs={"regex": "[a-z]+"}).structured == StructuredOutputs(
        regex="[a-z]+"
    )
    assert request_of(structured_outputs={"choice": ["yes", "no"], "json_object": False}).structured.choice == [
        "yes",
        "no",
    ]


def test_the_openai_clients_parse_body_is_accepted_and_its_reply_parses_back():
    """client.chat.completions.parse(response_format=Forecast) sends this body: strict, with
    $defs, a $ref, anyOf with null, an enum and titles."""
    response_format = type_to_response_format_param(Forecast)
    request = request_of(response_format=response_format)
    sent = response_format["json_schema"]
    assert request.structured == StructuredOutputs(json_schema=sent["schema"], strict=True)
    assert "$defs" in sent["schema"] and "anyOf" in orjson.dumps(sent["schema"]).decode()
    forecast = Forecast(place=Place(city="Paris", country=None), unit=Unit.C, highs=[21, 23])
    end = ReplyEnd(
        request_id="chatcmpl-1",
        seq=1,
        finish_reason="stop",
        usage=Usage(prompt_tokens=5, completion_tokens=9),
        structured_valid=True,
    )
    body = completion_body("chat.completions", "chatcmpl-1", "echo@1", 0, forecast.model_dump_json(), end)
    parsed = parse_chat_completion(
        response_format=Forecast, input_tools=omit, chat_completion=ChatCompletion.model_validate(body)
    )
    assert parsed.choices[0].message.parsed == forecast


@pytest.mark.parametrize(
    ("fields", "param", "code", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
                    },
                }
            },
            "response_format.json_schema.schema",
            "unsupported_schema",
            "'uniqueItems' is not supported (at /properties/tags/uniqueItems)",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string"}},
                            "additionalProperties": False,
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
            "unsupported_schema",
            "'a' is not",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}},
                }
            },
            "response_format.json_schema.schema",
            "unsupported_schema",
            f"larger than {MAX_SCHEMA_BYTES} bytes",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "missing_required_parameter",
            "schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_value", "json_schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value", "json_schema"),
        ({"response_format": "json"}, "response_format", "invalid_value", "object"),
        (
            {"structured_outputs": {"grammar": "root ::= x"}},
            "structured_outputs.grammar",
            "unsupported_parameter",
            "grammar",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_value", "exactly one"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_value", "not valid JSON"),
        ({"structured_outputs": {"regex": "a" * 5000}}, "structured_outputs.regex", "invalid_value", "4096"),
        ({"structured_outputs": {"choice": ["a"] * 257}}, "structured_outputs.choice", "invalid_value", "256"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice.1", "invalid_value", "at least 1"),
        (
            {"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "invalid_value",
            "exclusive",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "invalid_value",
            "exclusive",
        ),
        ({"tools": TOOLS, "structured_outputs": {"choice": ["a"]}}, "structured_outputs", "invalid_value", "exclusive"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
            "invalid_value",
            "'get_time'",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value", "required"),
        ({"tool_choice": "auto"}, "tool_choice", "invalid_value", "only allowed when tools"),
        ({"tools": [*TOOLS, TOOLS[1]]}, "tools.2.function.name", "invalid_value", "unique"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": WEATHER}}]},
            "tools.0.function.strict",
            "unsupported_parameter",
            "auto",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            "unsupported_schema",
            "'not'",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
            "invalid_value",
            "pattern",
        ),
        (
            {
                "tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                "tool_choice": "required",
            },
            "tools.2.function.parameters",
            "invalid_value",
            'of type "object"',
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]},
            "tools.0.function.parameters",
            "invalid_value",
            "not of type None",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                    },
                }
            },
            "response_format.json_schema.schema",
            "unsupported_schema",
            "'#/$defs/missing' points to no subschema of this schema (at /properties/a/$ref)",
        ),
        (
            {
                "structured_outputs": {
                    "json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
                }
            },
            "structured_outputs.json",
            "unsupported_schema",
            "only leads back to itself",
        ),
        (
            {"messages": [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "21"}]},
            "messages.1.tool_call_id",
            "invalid_value",
            "no earlier call has the id 'call_9'",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter", "use tools"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content", "invalid_value", "null only"),
        ({"messages": [{"role": "tool", "content": "21"}]}, "messages.0.tool_call_id", "invalid_value", "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages.0.tool_calls",
            "invalid_value",
            "only an assistant",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_parameter(fields, param, code, says):
    got_param, got_code, message = refusal(**fields)
    assert (got_param, got_code) == (param, code), message
    assert says in message


def test_tools_tool_choice_and_tool_turns_reach_the_request():
    """auto does not constrain: its parameter schemas only describe the functions, so a keyword
    Weir could not enforce is accepted there; required and named choices are constraints."""
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    assert request_of(tools=loose).calls_tools
    turns = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21"}]},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = request_of(messages=turns, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert [t.function.name for t in request.tools or []] == ["get_weather", "noop"]
    assert request.tool_choice == NamedToolChoice.model_validate({"function": {"name": "get_weather"}})
    assert request.parallel_tool_calls is False and request.structured is None
    assistant, tool = request.messages[1:]
    assert assistant.content == "" and assistant.tool_calls[0].function.name == "get_weather"
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "21")
    kept_out = request_of(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    assert kept_out.calls_tools is False and kept_out.structured == StructuredOutputs(json_object=True)


async def test_over_http_malformed_shapes_are_400s_in_openais_format_and_a_tools_body_is_accepted():
    """Through the app without a broker: a body that passes validation gets 503 (not connected)."""
    settings = GatewaySettings(
        model_repo=str(Path(__file__).parents[2] / "models.toml"), kafka_bootstrap="127.0.0.1:1", auth_mode="open"
    )
    bad = [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "messages": [{"role": "tool", "content": "x", "tool_call_id": 5}],
            },
            "messages.0.tool_call_id",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": []}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(settings)), base_url="http://gw"
    ) as client:
        for fields, param in bad:
            response = await client.post("/v1/chat/completions", json={"model": "echo", "messages": USER, **fields})
            assert response.status_code == 400, response.text
            assert (
                response.json()["error"]["param"] == param
                and response.json()["error"]["type"] == "invalid_request_error"
            )
        named = {"type": "function", "function": {"name": "get_weather"}}
        ok = await client.post(
            "/v1/chat/completions",
            json={
                "model": "echo",
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": named,
                "parallel_tool_calls": False,
            },
        )
        assert ok.status_code == 503, ok.text


def calls(*args: str) -> list[ToolCall]:
    return [
        ToolCall.model_validate({"id": f"call_{i}", "function": {"name": "get_weather", "arguments": a}})
        for i, a in enumerate(args)
    ]


def test_a_reply_of_calls_is_a_tool_calls_message_the_client_parses():
    end = ReplyEnd(
        request_id="chatcmpl-1", seq=2, finish_reason="stop", tool_calls=calls('{"city":"Paris","unit":"c"}')
    )
    body = completion_body(
        "chat.completions", "chatcmpl-1", "echo@1", 0, "", end, guarded_calls(end.tool_calls, GUARD.text)
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
        }
    ]
    tool = pydantic_function_tool(Weather, name="get_weather")  # strict: the client parses its arguments
    parsed = parse_chat_completion(
        response_format=omit, input_tools=[tool], chat_completion=ChatCompletion.model_validate(body)
    )
    assert parsed.choices[0].message.tool_calls[0].function.parsed_arguments == Weather(city="Paris", unit=Unit.C)
    # the output guard redacts arguments as it redacts text
    leaked = calls(f'{{"city":"{PHONE}"}}')
    assert guarded_calls(leaked, GUARD.text)[0].function.arguments == '{"city":"[REDACTED]"}'


async def test_streamed_calls_accumulate_in_the_openai_client_and_pass_the_output_guard():
    bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1"))
    request = request_of(tools=TOOLS, stream=True)
    exchange = Exchange(bus, request, bus.router.register(request.request_id))
    pieces = [
        ReplyDelta(request_id="chatcmpl-1", seq=0, text="Let me check."),
        ReplyDelta(
            request_id="chatcmpl-1",
            seq=1,
            text="",
            tool_calls=[ToolCallDelta(index=0, id="call_0", name="get_weather")],
        ),
        ReplyDelta(
            request_id="chatcmpl-1", seq=2, text="", tool_calls=[ToolCallDelta(index=0, arguments='{"city": "+1 415-5')]
        ),
        ReplyDelta(
            request_id="chatcmpl-1",
            seq=3,
            text="",
            tool_calls=[
                ToolCallDelta(index=0, arguments='55-0132", "unit": "c"}'),
                ToolCallDelta(index=1, id="call_1", name="noop"),
            ],
        ),
        ReplyEnd(
            request_id="chatcmpl-1",
            seq=4,
            finish_reason="stop",
            usage=Usage(prompt_tokens=3, completion_tokens=20),
            tool_calls=calls(f'{{"city": "{PHONE}", "unit": "c"}}', ""),
        ),
    ]
    for event in pieces:
        bus.router.on_event(event)
    writer = ChunkWriter("chat.completions", "chatcmpl-1", "echo@1", 0, include_usage=False)
    chunks = [frame async for _, frame in frames(exchange, writer, GUARD.stream())]
    assert not any(isinstance(c, ApiError) for c in chunks)
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    sent = [call for d in deltas if d for call in d]
    assert [c["index"] for c in sent if "id" in c] == [0, 1]  # id, type and name once per call
    assert all("id" not in c and "name" not in c["function"] for c in sent[1:] if c["index"] == 0)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check."
    got = [(c.id, c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    assert got == [("call_0", "get_weather", '{"city": "[REDACTED]", "unit": "c"}'), ("call_1", "noop", "")]


def test_a_batch_line_converts_as_a_body_does_and_its_result_is_the_http_body():
    repo = RegistryState(load_model_repo(Path(__file__).parents[2] / "models.toml"))
    from services.batcher.job_core import BatchJob  # the job record the runner parses a file for

    job = BatchJob(
        job_id="batch_1",
        status="validating",
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        created_ms=now_ms(),
        expires_ms=now_ms() + 60_000,
        updated_ms=now_ms(),
    )
    body = {
        "model": "echo",
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "response_format": {"type": "text"},
    }
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})
    bad = orjson.dumps(
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        }
    )
    parsed = parse_input(line + b"\n" + bad, job, repo, "weir.replies.job.batch_1")
    request = parsed.lines[0].request
    assert request is not None and request.tool_choice == "required" and len(request.tools or []) == 2
    assert (parsed.lines[1].error.code, parsed.lines[1].error.param) == ("invalid_value", "tool_choice.function.name")
    results = JobResults(parsed.lines)
    end = ReplyEnd(
        request_id=request.request_id,
        seq=0,
        finish_reason="stop",
        model_version="echo@1",
        tool_calls=calls(f'{{"city":"{PHONE}","unit":"c"}}'),
    )
    results.add(end)
    out, _ = results.files("/v1/chat/completions")
    row = orjson.loads(redact_result_line(out.splitlines()[0].encode(), GUARD.text))
    choice = row["response"]["body"]["choices"][0]
    http = completion_body("chat.completions", "x", "echo@1", 0, "", end, end.tool_calls)["choices"][0]
    assert choice["finish_reason"] == http["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"[REDACTED]","unit":"c"}'
    assert {k: v for k, v in choice["message"].items() if k not in ("refusal", "tool_calls")} == {
        k: v for k, v in http["message"].items() if k != "tool_calls"
    }
