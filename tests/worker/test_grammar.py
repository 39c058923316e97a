"""Constrained decoding (services/worker/engine/grammar.py) on weir-tiny-py's 4k vocabulary:
every whitelisted JSON Schema keyword and format is enforced by the compiled grammar, the engine
refuses what it cannot enforce, constrained outputs are valid and deterministic, and the mask
leaves unconstrained rows alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schemas.messages import StructuredOutputs
from schemas.structured import ENFORCED_FORMATS, ENFORCED_KEYWORDS, UnsupportedSchema, check_structured
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.echo_engine import EchoEngine
from services.worker.engine.grammar import GrammarError, Grammars, StepMask, choice_ebnf, is_instance, spec_key

from .factories import make_request

WEIR_TINY_PY = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"
EOS = 0  # weir-tiny-py's <|endoftext|>

INT = {"type": "integer"}
OBJ_AB = {"type": "object", "properties": {"a": INT, "b": INT}}
# keyword -> (schema, conforming instances, violating instances); instances are written as
# json.dumps writes them (the grammar's separators, grammar.SEPARATORS)
KEYWORDS: dict[str, tuple[dict, list, list]] = {
    "type": ({"type": ["integer", "null"]}, [3, None], ["x", 1.5, True]),
    "properties": (OBJ_AB, [{"a": 1}, {"a": 1, "b": 2}], [{"a": "x"}, {"b": [1]}]),
    "required": ({**OBJ_AB, "required": ["b"]}, [{"b": 1}, {"a": 1, "b": 2}], [{"a": 1}, {}]),
    "additionalProperties": ({"type": "object", "additionalProperties": INT}, [{"x": 1}, {}], [{"x": "s"}]),
    "items": ({"type": "array", "items": INT}, [[], [1, 2]], [["x"], [1, None]]),
    "enum": ({"enum": ["red", 7, None]}, ["red", 7, None], ["blue", 8, "Red"]),
    "const": ({"const": "only"}, ["only"], ["other", "onl"]),
    "anyOf": ({"anyOf": [INT, {"type": "string", "maxLength": 1}]}, [5, "a"], ["ab", None]),
    "$ref": ({"$ref": "#/$defs/p", "$defs": {"p": INT}}, [4], ["4"]),
    "$defs": ({"type": "array", "items": {"$ref": "#/$defs/p"}, "$defs": {"p": {"enum": ["x"]}}}, [["x"]], [["y"]]),
    "definitions": ({"type": "array", "items": {"$ref": "#/definitions/p"}, "definitions": {"p": {"enum": ["x"]}}},
                    [["x"]], [["y"]]),  # fmt: skip
    "minLength": ({"type": "string", "minLength": 2}, ["ab", "abc"], ["", "a"]),
    "maxLength": ({"type": "string", "maxLength": 2}, ["", "ab"], ["abc"]),
    "pattern": ({"type": "string", "pattern": "^[a-c]+[0-9]$"}, ["ab1", "c9"], ["ad1", "ab", "1"]),
    "minimum": ({"type": "integer", "minimum": 5}, [5, 17], [4, -5]),
    "maximum": ({"type": "number", "maximum": 2.5}, [2.5, -10, 1], [3, 2.6]),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, [6], [5, 4]),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, [4, -3], [5, 6]),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, [[1, 2]], [[], [1]]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, [[], [1]], [[1, 2]]),
}  # fmt: skip
FORMATS: dict[str, tuple[list[str], list[str]]] = {
    "date-time": (["2024-02-29T13:45:00Z", "2024-01-01T00:00:00+02:00"], ["2024-02-29", "2024-13-01T00:00:00Z"]),
    "date": (["2024-02-29"], ["2024-2-29", "2024-02-29T00:00:00Z"]),
    "time": (["13:45:00Z", "23:59:59+01:00"], ["25:00:00Z", "13:45"]),
    "email": (["a.b@example.com"], ["a.b.example.com", "@example.com"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "xyz"]),
    "ipv4": (["192.168.0.1"], ["256.1.1.1", "1.2.3"]),
    "ipv6": (["2001:db8::1", "::1"], ["2001:db8:::1", "12345::"]),
    "hostname": (["example.com", "a-b.c"], ["-bad.com", "a..b"]),
    "uri": (["https://example.com/a?b=c"], ["not a uri", "://x"]),
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(WEIR_TINY_PY, 4096, [EOS])


def accepts(grammars: Grammars, spec: StructuredOutputs, text: str) -> bool:
    """Whether the compiled grammar takes `text` and may end after it (the stop token is allowed)."""
    matcher = grammars.matcher(grammars.compile(spec))
    return matcher.accept_string(text) and matcher.accept_token(EOS) and matcher.is_terminated()


def test_every_whitelisted_keyword_is_enforced(grammars):
    assert set(KEYWORDS) == ENFORCED_KEYWORDS - {"format"}  # a keyword added to the whitelist needs a row here
    for keyword, (schema, good, bad) in KEYWORDS.items():
        spec = StructuredOutputs(json_schema=schema)
        check_structured(spec)
        for value in good:
            assert accepts(grammars, spec, json.dumps(value)), (keyword, value)
            assert is_instance(spec, json.dumps(value)), (keyword, value)
        for value in bad:
            assert not accepts(grammars, spec, json.dumps(value)), (keyword, value)
            assert not is_instance(spec, json.dumps(value)), (keyword, value)


def test_objects_without_additional_properties_are_closed(grammars):
    """The grammar is stricter than JSON Schema here (xgrammar's strict mode, as vLLM): an object
    schema without additionalProperties takes only its listed properties; still every instance."""
    spec = StructuredOutputs(json_schema=OBJ_AB)
    assert not accepts(grammars, spec, '{"c": 1}') and is_instance(spec, '{"c": 1}')
    assert accepts(grammars, StructuredOutputs(json_schema={**OBJ_AB, "additionalProperties": True}), '{"c": 1}')


def test_every_whitelisted_format_is_enforced(grammars):
    assert set(FORMATS) == ENFORCED_FORMATS
    for fmt, (good, bad) in FORMATS.items():
        spec = StructuredOutputs(json_schema={"type": "string", "format": fmt})
        for value in good:
            assert accepts(grammars, spec, json.dumps(value)), (fmt, value)
        for value in bad:
            assert not accepts(grammars, spec, json.dumps(value)), (fmt, value)


def test_keywords_the_grammar_ignores_are_refused(grammars):
    """xgrammar compiles uniqueItems and unknown formats but does not enforce them: refused, never relaxed."""
    unique = {"type": "array", "items": INT, "uniqueItems": True}
    assert accepts(grammars, StructuredOutputs(json_schema=unique), "[1, 1]")  # why it is off the whitelist
    for schema, keyword in [(unique, "uniqueItems"), ({"type": "string", "format": "iri"}, "format"),
                            ({"type": "object", "patternProperties": {"^a": INT}}, "patternProperties")]:  # fmt: skip
        with pytest.raises(UnsupportedSchema) as err:
            check_structured(StructuredOutputs(json_schema=schema))
        assert err.value.keyword == keyword
