"""Structured output, tools, n and logprobs through the four services, with the official openai
client, as issue 19 checks them (docs/design.md, "Structured output, tools and logprobs").

weir-tiny-py is a small Python-code model, not a chat model: its JSON is odd, so what these tests
hold is the guarantee, not the content: every constrained answer that ends `stop` is an instance of
its schema, every time (strings carry a maxLength so that the small model closes them).
"""

from __future__ import annotations

import json
import math
from enum import StrEnum

import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
MODEL = "weir-tiny-py"


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Part(BaseModel):
    name: str = Field(max_length=12)
    count: int
    colour: Colour


class Order(BaseModel):
    customer: str = Field(max_length=16)
    express: bool
    note: str | None = Field(max_length=12)
    parts: list[Part] = Field(max_length=3)


def client_of(pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="local", max_retries=0, timeout=120)


def test_openai_client_parses_a_pydantic_model_every_time(pipeline):
    client = client_of(pipeline)
    for seed in range(4):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "An order as JSON:"}],
            response_format=Order,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Order)  # the client's own validation passed
        assert len(choice.message.parsed.parts) <= 3


def test_an_unsupported_schema_keyword_gets_a_400_naming_it(pipeline):
    client = client_of(pipeline)
    schema = {
        "type": "object",
        "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "required": ["ids"],
        "additionalProperties": False,
    }
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "ids"}],
            max_tokens=16,
            response_format={"type": "json_schema", "json_schema": {"name": "ids", "schema": schema, "strict": True}},
        )


def test_a_named_tool_call_returns_arguments_that_validate(pipeline):
    client = client_of(pipeline)
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": parameters, "strict": True}}]
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        max_tokens=200,
        seed=5,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "forecast" and call.id.startswith("call_")
    jsonschema_rs.validate(parameters, json.loads(call.function.arguments))
    # streamed, the pieces add up to the same arguments (same seed: same tokens); the id is the stream's own
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        max_tokens=200,
        seed=5,
        stream=True,
    )
    arguments, ids = "", set()
    for chunk in stream:
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            ids.add(piece.id) if piece.id else None
            arguments += piece.function.arguments or ""
    assert len(ids) == 1 and ids.pop().startswith("call_") and arguments == call.function.arguments


def test_n_choices_and_logprobs(pipeline):
    client = client_of(pipeline)
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def main():"}],
        n=3,
        max_tokens=12,
        seed=9,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    texts = [c.message.content for c in completion.choices]
    assert len(set(texts)) > 1, "three seeds derived from one gave one text"
    for choice in completion.choices:
        tokens = choice.logprobs.content
        assert tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
        assert "".join(t.token for t in tokens) == choice.message.content
        assert math.isfinite(sum(t.logprob for t in tokens))
    # every output token has its logprob (a stop string's tokens, cut from the text, would not)
    assert completion.usage.completion_tokens == sum(len(c.logprobs.content) for c in completion.choices)
