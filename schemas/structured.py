"""What a structured-output constraint may ask for, checked before anything is compiled.

Pure. A JSON Schema is served only when every keyword in it is one Weir enforces token by token
(docs/design.md, "Structured output, tools and logprobs": refuse, never relax). The grammar
compiler accepts more keywords than it enforces (it silently drops some, e.g. `uniqueItems` or an
unknown `format`), so the list here is of keywords each tested to be enforced
(tests/worker/test_grammar.py), and anything else is refused naming the keyword and where it is.

    constraint_of(request)            the constraint a request's output follows, or None
    check_structured(spec)            raise UnsupportedSchema for a spec Weir cannot enforce
    check_regex(pattern, ...)         raise UnsupportedSchema for an explosive regex
    check_strict(schema)              raise UnsupportedSchema where OpenAI's strict rules are broken
    constraint_of(request)            the one constraint an engine enforces for a request, or None

A regex (`regex`, and every `pattern` in a schema) whose counted repetitions are obviously
explosive is refused before any compile: the compiler copies a counted repetition's body once per
count, so nested counts multiply (a tester's `(([^"]{0,5000}){0,5000}){0,5000}x` ran a compile out
of memory). Below these limits a grammar's compile time is bounded where it runs: the worker
compiles in a child process and refuses a constraint that takes longer than
services/worker/engine/grammar.py's COMPILE_TIMEOUT_S (a bounded repetition of a wide class, e.g.
`[^"]{0,300}`, measured ~7 s on a 49k vocabulary; no cheap rule on the text predicts that well).
"""

from __future__ import annotations

import re
import re._constants as sre_constants
import re._parser as sre_parse
from typing import Any
from urllib.parse import unquote

import orjson

from schemas.messages import MAX_SCHEMA_BYTES, GenerateRequest, StructuredOutputs
from schemas.tools import tool_constraint

# Keywords that constrain, by the type of node they apply to; each is enforced by the grammar.
ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minItems",
        "maxItems",
    }
)
# Keywords that annotate and cannot change what is valid.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
# String formats the grammar enforces (a pattern it builds for each). Not "hostname" (xgrammar
# 0.2.9 takes labels over 63 characters): looser than a JSON Schema validator, so an output could
# be served and not valid. "date", "date-time" and "ipv4", which xgrammar also enforces loosely
# (2024-02-31, leading zeros), are served as the exact patterns of FORMAT_PATTERNS instead.
_DAY = (
    "([0-9]{4}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    "|[0-9]{4}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    "|[0-9]{4}-02-(0[1-9]|1[0-9]|2[0-8])"
    "|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)"
)  # a real Gregorian date: 30-day months, February's 28, and the 29th of leap years only
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": _DAY,
    "date-time": _DAY
    + "T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "ipv4": f"({_OCTET}\\.){{3}}{_OCTET}",
}
ENFORCED_FORMATS = frozenset({"time", "email", "uuid", "ipv6", "uri", *FORMAT_PATTERNS})
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
MAX_SCHEMA_DEPTH = 32  # nesting of subschemas; deeper is refused before the compiler sees it
# Counted repetitions a regex may ask for: one count's upper bound (`x{0,1000}`: a wide class at
# 300 already compiles ~7 s on 49k tokens, so past 1000 is past COMPILE_TIMEOUT_S anyway), and the
# product of nested counts' bounds (each level copies the one inside it).
MAX_REPEAT = 1000
MAX_NESTED_REPEAT = 10_000
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


class UnsupportedSchema(ValueError):
    """A constraint Weir will not serve: which keyword (or rule) and where, as a JSON pointer."""

    def __init__(self, message: str, *, keyword: str, pointer: str) -> None:
        super().__init__(f"{message} (at {pointer or '/'})")
        self.keyword = keyword
        self.pointer = pointer


def constraint_of(request: GenerateRequest) -> StructuredOutputs | None:
    """The constraint a request's output follows: its own `structured`, or the call a required or
    named tool_choice forces (schemas/tools.py; the request keeps the two exclusive); None: none."""
    return request.structured if request.structured is not None else tool_constraint(request)


def check_structured(spec: StructuredOutputs) -> None:
    """Raise UnsupportedSchema unless every part of `spec` is enforced; strict specs also follow
    OpenAI's strict rules."""
    if spec.regex is not None:
        check_regex(spec.regex, keyword="regex", pointer="")
    if spec.json_schema is None:
        return
    if len(orjson.dumps(spec.json_schema)) > MAX_SCHEMA_BYTES:
        raise UnsupportedSchema(f"the schema is larger than {MAX_SCHEMA_BYTES} bytes", keyword="$size", pointer="")
    schemas: dict[str, Any] = {}
    _walk(spec.json_schema, "", 0, schemas)
    _check_refs(schemas)
    if spec.strict:
        check_strict(spec.json_schema)


def _walk(node: Any, pointer: str, depth: int, schemas: dict[str, Any]) -> None:
    """Check `node` and what it holds; `schemas` gets every (sub)schema checked, by JSON pointer."""
    schemas[pointer] = node
    if isinstance(node, bool):
        return  # true / false schemas
    if not isinstance(node, dict):
        raise UnsupportedSchema("a schema must be an object or a boolean", keyword="$type", pointer=pointer)
    if depth > MAX_SCHEMA_DEPTH:
        raise UnsupportedSchema(f"schemas nest at most {MAX_SCHEMA_DEPTH} deep", keyword="$depth", pointer=pointer)
    for key, value in node.items():
        where = f"{pointer}/{_escape(key)}"
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED_KEYWORDS:
            raise UnsupportedSchema(f"keyword {key!r} is not supported", keyword=key, pointer=where)
        if key == "format" and value in FORMAT_PATTERNS and "pattern" in node:
            raise UnsupportedSchema(
                f"format {value!r} is served as a pattern, so it cannot be combined with one",
                keyword="format",
                pointer=where,
            )
        if key == "format" and value not in ENFORCED_FORMATS:
            raise UnsupportedSchema(
                f"format {value!r} is not supported (supported: {', '.join(sorted(ENFORCED_FORMATS))})",
                keyword="format",
                pointer=where,
            )
        if key == "pattern" and isinstance(value, str):
            check_regex(value, keyword="pattern", pointer=where)
        if key == "type":
            types = value if isinstance(value, list) else [value]
            bad = [t for t in types if t not in JSON_TYPES]
            if bad or not types:
                raise UnsupportedSchema(
                    f"type {bad[0] if bad else value!r} is not a JSON type", keyword="type", pointer=where
                )
        if key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise UnsupportedSchema(f"{key} must be an object", keyword=key, pointer=where)
            for name, sub in value.items():
                _walk(sub, f"{where}/{_escape(name)}", depth + 1, schemas)
        elif key in ("items", "additionalProperties"):
            _walk(value, where, depth + 1, schemas)
        elif key == "anyOf":
            if not isinstance(value, list) or not value:
                raise UnsupportedSchema("anyOf must be a non-empty list", keyword=key, pointer=where)
            for i, sub in enumerate(value):
                _walk(sub, f"{where}/{i}", depth + 1, schemas)
        elif key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
            raise UnsupportedSchema(
                "only local references (# or #/<JSON pointer>) are supported", keyword="$ref", pointer=where
            )


def _check_refs(schemas: dict[str, Any]) -> None:
    """Every $ref points to a subschema checked here (not to a missing one, not into something that
    is no schema, e.g. `#/properties`), and no chain of references loops back on itself: a schema
    recursive through properties or items is served (the grammar recurses), a reference that only
    leads back to itself is no schema (the compiler refuses it too, whatever sits beside the $ref).
    Checked here so the error names the reference, before any compile."""
    refs = {pointer: node["$ref"] for pointer, node in schemas.items() if isinstance(node, dict) and "$ref" in node}
    for pointer, ref in refs.items():
        if _target(ref) not in schemas:
            raise UnsupportedSchema(
                f"$ref {ref!r} points to no subschema of this schema", keyword="$ref", pointer=f"{pointer}/$ref"
            )
    for pointer in refs:
        seen, at = {pointer}, pointer
        while at in refs:  # a reference to a reference...: follow it
            at = _target(refs[at])
            if at in seen:
                raise UnsupportedSchema(
                    f"$ref {refs[pointer]!r} only leads back to itself (a loop of references "
                    "that never reaches a schema)",
                    keyword="$ref",
                    pointer=f"{pointer}/$ref",
                )
            seen.add(at)


def _target(ref: str) -> str:
    """The JSON pointer a local reference names (a URI fragment, so maybe percent-encoded)."""
    return unquote(ref[1:])


def check_regex(pattern: str, *, keyword: str, pointer: str) -> None:
    """Raise UnsupportedSchema for a regex whose counted repetitions exceed MAX_REPEAT, or whose
    nested counts multiply past MAX_NESTED_REPEAT. A pattern Python's parser cannot read is left
    to the grammar compiler (which reports invalid_regex)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    problem = _repetition_problem(parsed, 1)
    if problem is not None:
        raise UnsupportedSchema(f"{keyword} is too complex to compile: {problem}", keyword=keyword, pointer=pointer)


def _repetition_problem(node: Any, outer: int) -> str | None:
    """Why `node` (a parsed regex, or a part of one) repeats too much inside `outer` copies, or None."""
    if isinstance(node, sre_parse.SubPattern):
        node = node.data
    if not isinstance(node, (list, tuple)):
        return None
    if len(node) == 2 and node[0] in _REPEATS:
        low, high, body = node[1]
        count = low if high == sre_constants.MAXREPEAT else high  # `x{n,}` copies x n times, then loops
        if count > MAX_REPEAT:
            return f"a counted repetition of {count} (at most {MAX_REPEAT})"
        if outer * max(count, 1) > MAX_NESTED_REPEAT:
            return f"nested counted repetitions multiply to {outer * count} (at most {MAX_NESTED_REPEAT})"
        return _repetition_problem(body, outer * max(count, 1))
    for part in node:
        if (problem := _repetition_problem(part, outer)) is not None:
            return problem
    return None


def check_strict(schema: Any, pointer: str = "") -> None:
    """OpenAI's strict rules: every object schema sets `additionalProperties: false` and lists
    every one of its properties in `required` (an optional field is a union with null)."""
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in schema
    if is_object:
        if schema.get("additionalProperties") is not False:
            raise UnsupportedSchema(
                "strict schemas must set additionalProperties to false on every object",
                keyword="additionalProperties",
                pointer=pointer,
            )
        missing = sorted(set(schema.get("properties", {})) - set(schema.get("required", [])))
        if missing:
            raise UnsupportedSchema(
                f"strict schemas must list every property in required; {missing[0]!r} is not",
                keyword="required",
                pointer=pointer,
            )
    for key in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            check_strict(sub, f"{pointer}/{key}/{_escape(name)}")
    if isinstance(schema.get("items"), dict):
        check_strict(schema["items"], f"{pointer}/items")
    for i, sub in enumerate(schema.get("anyOf") or []):
        check_strict(sub, f"{pointer}/anyOf/{i}")


def with_format_patterns(schema: Any) -> Any:
    """`schema` with each `format` of FORMAT_PATTERNS replaced by its exact `pattern` (the form the
    grammar compiler enforces exactly; check_structured refuses a node with both)."""
    if isinstance(schema, list):
        return [with_format_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "format" and value in FORMAT_PATTERNS:
            out["pattern"] = FORMAT_PATTERNS[value]
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value  # values, not schemas
        elif key in ("properties", "$defs", "definitions"):
            out[key] = (
                {name: with_format_patterns(sub) for name, sub in value.items()} if isinstance(value, dict) else value
            )
        else:
            out[key] = with_format_patterns(value)
    return out


def _escape(token: str) -> str:
    """A JSON pointer's escaping of one reference token (RFC 6901)."""
    return str(token).replace("~", "~0").replace("/", "~1")
