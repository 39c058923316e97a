"""Constrained decoding (services/worker/engine/grammar.py) on weir-tiny-py's 4k vocabulary:
every whitelisted JSON Schema keyword and format is enforced by the compiled grammar, the engine
refuses what it cannot enforce, constrained outputs are valid and deterministic, and the mask
leaves unconstrained rows alone."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from schemas.messages import StructuredOutputs
from schemas.structured import ENFORCED_FORMATS, ENFORCED_KEYWORDS, UnsupportedSchema, check_structured
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.echo_engine import EchoEngine
from services.worker.engine.grammar import GrammarError, Grammars, StepMask, choice_ebnf, is_instance, spec_key
from services.worker.kafka.events import reply_events

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
    "definitions": (
        {"type": "array", "items": {"$ref": "#/definitions/p"}, "definitions": {"p": {"enum": ["x"]}}},
        [["x"]],
        [["y"]],
    ),
    "minLength": ({"type": "string", "minLength": 2}, ["ab", "abc"], ["", "a"]),
    "maxLength": ({"type": "string", "maxLength": 2}, ["", "ab"], ["abc"]),
    "pattern": ({"type": "string", "pattern": "^[a-c]+[0-9]$"}, ["ab1", "c9"], ["ad1", "ab", "1"]),
    "minimum": ({"type": "integer", "minimum": 5}, [5, 17], [4, -5]),
    "maximum": ({"type": "number", "maximum": 2.5}, [2.5, -10, 1], [3, 2.6]),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, [6], [5, 4]),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, [4, -3], [5, 6]),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, [[1, 2]], [[], [1]]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, [[], [1]], [[1, 2]]),
}
FORMATS: dict[str, tuple[list[str], list[str]]] = {
    "time": (["13:45:00Z", "23:59:59+01:00"], ["25:00:00Z", "13:45"]),
    "email": (["a.b@example.com"], ["a.b.example.com", "@example.com"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "xyz"]),
    "ipv6": (["2001:db8::1", "::1"], ["2001:db8:::1", "12345::"]),
    "uri": (["https://example.com/a?b=c"], ["not a uri", "://x"]),
    # served as exact patterns (schemas/structured.py, FORMAT_PATTERNS): xgrammar's own are looser
    "date": (["2024-02-29", "2023-12-31", "2000-02-29"], ["2024-02-31", "2023-02-29", "1900-02-29", "2024-4-01"]),
    "date-time": (
        ["2024-02-29T10:00:00Z", "2024-12-31T23:59:59.123+05:30"],
        ["2023-02-29T10:00:00Z", "2024-04-31T00:00:00Z", "2024-01-01T24:00:00Z", "2024-01-01 10:00:00Z"],
    ),
    "ipv4": (["10.0.0.255", "0.0.0.0"], ["01.2.3.4", "256.1.1.1", "1.2.3"]),
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


def test_references_that_resolve_are_served_recursion_included(grammars):
    """What check_structured's $ref checks let through compiles and is enforced."""
    node = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
        "additionalProperties": False,
    }
    escaped = {"$ref": "#/$defs/a%20b~1c", "$defs": {"a b/c": {"type": "integer"}}}  # percent-encoded, RFC 6901
    chain = {
        "type": "array",
        "items": {"$ref": "#/$defs/p"},
        "$defs": {"p": {"$ref": "#/$defs/q"}, "q": {"enum": ["x"]}},
    }
    for schema, good, bad in [
        (node, '{"next": {"next": null}}', '{"next": {}}'),
        (escaped, "12", '"12"'),
        (chain, '["x"]', '["y"]'),
    ]:
        spec = StructuredOutputs(json_schema=schema)
        check_structured(spec)
        assert accepts(grammars, spec, good) and not accepts(grammars, spec, bad), schema


def test_objects_without_additional_properties_are_closed(grammars):
    """The grammar is stricter than JSON Schema here (xgrammar's strict mode, as vLLM): an object
    schema without additionalProperties takes only its listed properties; still every instance."""
    spec = StructuredOutputs(json_schema=OBJ_AB)
    assert not accepts(grammars, spec, '{"c": 1}') and is_instance(spec, '{"c": 1}')
    assert accepts(grammars, StructuredOutputs(json_schema={**OBJ_AB, "additionalProperties": True}), '{"c": 1}')


def test_prewarm_starts_the_compile_child_with_a_real_compile(grammars):
    compiled = grammars.prewarm().result(timeout=120)
    assert accepts(grammars, StructuredOutputs(choice=["ready"]), "ready") and compiled is not None


def test_every_whitelisted_format_is_enforced(grammars):
    assert set(FORMATS) == ENFORCED_FORMATS
    for fmt, (good, bad) in FORMATS.items():
        spec = StructuredOutputs(json_schema={"type": "string", "format": fmt})
        for value in good:
            assert accepts(grammars, spec, json.dumps(value)), (fmt, value)
            assert is_instance(spec, json.dumps(value)), (fmt, value)
        for value in bad:
            assert not accepts(grammars, spec, json.dumps(value)), (fmt, value)


# formats xgrammar enforces more loosely than a JSON Schema validator: value it takes, not an instance
LOOSE_FORMATS = {"hostname": "a" * 64 + ".com"}


def test_keywords_the_grammar_ignores_are_refused(grammars):
    """xgrammar compiles uniqueItems and some formats but does not (fully) enforce them: refused, never relaxed."""
    unique = {"type": "array", "items": INT, "uniqueItems": True}
    assert accepts(grammars, StructuredOutputs(json_schema=unique), "[1, 1]")  # why it is off the whitelist
    for fmt, value in LOOSE_FORMATS.items():
        spec = StructuredOutputs(json_schema={"type": "string", "format": fmt})
        assert accepts(grammars, spec, json.dumps(value)) and not is_instance(spec, json.dumps(value)), fmt
        with pytest.raises(UnsupportedSchema):
            check_structured(spec)
    for schema, keyword in [
        (unique, "uniqueItems"),
        ({"type": "string", "format": "iri"}, "format"),
        ({"type": "string", "format": "date", "pattern": "^2"}, "format"),
        ({"type": "object", "patternProperties": {"^a": INT}}, "patternProperties"),
    ]:
        with pytest.raises(UnsupportedSchema) as err:
            check_structured(StructuredOutputs(json_schema=schema))
        assert err.value.keyword == keyword


# -- the engine ------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "tags", "role"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2},
        "role": {"enum": ["admin", "user", None]},
    },
}
PROMPT = "def parse_args(argv):\n    "


def json_request(seed: int, max_tokens: int = 48):
    return make_request(
        PROMPT,
        request_id=f"json-{seed}",
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        structured=StructuredOutputs(json_schema=SCHEMA),
    )


def run(engine: Engine, *requests) -> dict[str, list]:
    """Add `requests` together and step to the end: every request's events."""
    events: dict[str, list] = {r.request_id: [] for r in requests}
    for request in requests:
        refused = engine.add(request, 0)
        if refused is not None:
            events[request.request_id].append(refused)
    while engine.has_work:
        for out in engine.step(0):
            events[out.request_id].append(out)
    return events


def ids_of(events: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}


@pytest.fixture(scope="module")
def tiny_py() -> Engine:
    return Engine(WEIR_TINY_PY, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))


def test_constrained_output_is_valid_and_same_after_regeneration_and_preemption(tiny_py):
    """Sampled at temperature 1: valid JSON under the mask; a fresh engine (a regeneration after a
    crash) and a squeezed one that preempts give the same token ids (invariant 3)."""
    requests = [json_request(seed) for seed in range(3)]
    first = run(tiny_py, *requests)
    for events in first.values():
        end = events[-1]
        assert end.finish_reason == "stop" and end.structured_valid is True, end
        assert set(json.loads(end.output_text)) == {"name", "tags", "role"}
    fresh = Engine(WEIR_TINY_PY, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))
    # 20 blocks of 4 tokens for three ~10-token prompts and their ~25-token outputs: some are preempted
    squeezed = Engine(
        WEIR_TINY_PY, EngineConfig(max_model_len=80, block_size=4, kv_cache_bytes=fresh.kv_bytes_per_token * 4 * 20)
    )
    # a compiled grammar is a function of the spec and the tokenizer alone: shared, so that this
    # test starts one compile child (seconds of imports) instead of three
    fresh._grammars = squeezed._grammars = tiny_py.grammars
    assert ids_of(run(fresh, *requests)) == ids_of(first)
    assert ids_of(run(squeezed, *requests)) == ids_of(first)
    assert squeezed.scheduler.num_preemptions > 0


def test_mask_leaves_unconstrained_rows_alone(tiny_py):
    """In a batch mixing constrained and unconstrained rows, the unconstrained rows' tokens are those
    of an unconstrained-only run; the constrained rows' outputs are valid."""
    plain = [
        make_request(PROMPT, request_id=f"plain-{i}", max_tokens=16, temperature=t, seed=i)
        for i, t in enumerate([0.0, 1.0])
    ]
    alone = ids_of(run(tiny_py, *plain))
    assert all(len(ids) > 4 for ids in alone.values())  # they run alongside the constrained rows
    choice = make_request(
        PROMPT, request_id="choice", max_tokens=10, structured=StructuredOutputs(choice=["yes", "no"])
    )
    regex = make_request(
        PROMPT,
        request_id="regex",
        max_tokens=8,
        temperature=1.0,
        structured=StructuredOutputs(regex=r"[a-f]{2}-[0-9]{3}"),
    )
    mixed = run(tiny_py, *plain, json_request(7), choice, regex)
    assert {rid: ids_of(mixed)[rid] for rid in alone} == alone
    for rid in ("json-7", "choice", "regex"):
        assert mixed[rid][-1].finish_reason == "stop" and mixed[rid][-1].structured_valid is True, mixed[rid][-1]
    assert all(mixed[rid][-1].structured_valid is None for rid in alone)


def test_truncated_output_is_not_valid(tiny_py):
    request = json_request(3, max_tokens=3)
    end = run(tiny_py, request)["json-3"][-1]
    assert end.finish_reason == "length" and end.structured_valid is False
    assert reply_events(request, "b", end, "tiny@1")[-1].structured_valid is False  # ReplyEnd carries it


def test_json_closes_before_max_tokens(tiny_py, monkeypatch):
    """A string nothing bounds: unsteered, the sampled model runs out of max_tokens inside it;
    steered near the budget (grammar.JsonCloser), every seed closes valid, and a fresh engine (a
    regeneration) repeats the tokens. An escaped quote closes nothing."""
    import services.worker.engine.grammar as grammar

    assert grammar.lex(grammar.IN_STRING, b'a\\"b') == (grammar.IN_STRING, 0)
    assert grammar.lex(grammar.IN_STRING, b'"]}') == (grammar.OUTSIDE, -3)
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["text", "n"],
        "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
    }
    requests = [
        make_request(
            PROMPT,
            request_id=f"open-{seed}",
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            structured=StructuredOutputs(json_schema=schema),
        )
        for seed in range(4)
    ]
    with monkeypatch.context() as unsteered:
        unsteered.setattr(grammar, "CLOSE_MIN_TOKENS", 0)
        unsteered.setattr(grammar, "CLOSE_SHARE", 0.0)
        ends = [evs[-1] for evs in run(tiny_py, *requests).values()]
        assert [e.finish_reason for e in ends].count("length") >= 3, ends
    steered = run(tiny_py, *requests)
    for events in steered.values():
        assert events[-1].finish_reason == "stop" and events[-1].structured_valid is True, events[-1]
    fresh = Engine(WEIR_TINY_PY, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))
    assert ids_of(run(fresh, *requests)) == ids_of(steered)


def test_what_cannot_be_enforced_is_refused(tiny_py):
    """Refuse, never relax: an unsupported keyword at add, a bad regex or schema (a pattern that does
    not parse) after its compile,
    ignore_eos with a constraint, and any constraint on the echo model."""
    unsupported = make_request(
        request_id="u", structured=StructuredOutputs(json_schema={"type": "array", "uniqueItems": True})
    )
    out = tiny_py.add(unsupported, 0)
    assert out.finish_reason == "rejected" and out.error.code == "unsupported_schema"
    assert "uniqueItems" in out.error.message and "/uniqueItems" in out.error.message
    ignore = make_request(request_id="i", ignore_eos=True, structured=StructuredOutputs(json_object=True))
    assert tiny_py.add(ignore, 0).error.code == "unsupported_parameter"
    bad_regex = make_request(request_id="r", structured=StructuredOutputs(regex="a{2}{3}"))
    bad_schema = make_request(
        request_id="s", structured=StructuredOutputs(json_schema={"type": "string", "pattern": "[a"})
    )
    events = run(tiny_py, bad_regex, bad_schema)
    assert [(e[-1].finish_reason, e[-1].error.code) for e in events.values()] == [
        ("rejected", "invalid_regex"),
        ("rejected", "invalid_schema"),
    ]
    assert "repetition" in events["r"][-1].error.message and "/project/" not in events["r"][-1].error.message
    echo = EchoEngine().add(make_request(request_id="e", structured=StructuredOutputs(choice=["a"])), 0)
    assert echo.finish_reason == "rejected" and echo.error.code == "unsupported_by_model"


def test_a_request_waiting_for_its_grammar_can_be_cancelled(tiny_py):
    spec = StructuredOutputs(regex="[0-9]{2}x")
    request = make_request(request_id="c", structured=spec)
    tiny_py.grammars._cache.pop(spec_key(spec), None)  # not cached: it waits for its compile
    assert tiny_py.add(request, 0) is None and tiny_py.has_work
    assert tiny_py.cancel("c", 0).finish_reason == "cancelled"
    tiny_py.step(0)
    assert not tiny_py.has_work


def test_is_instance_and_choice_grammar(grammars):
    choices = ['say "hi" \\ ok', "é\n😀", "yes"]
    spec = StructuredOutputs(choice=choices)
    for text in choices:
        assert accepts(grammars, spec, text) and is_instance(spec, text)
    for text in ["ye", "no", 'say "hi"']:
        assert not accepts(grammars, spec, text) and not is_instance(spec, text)
    assert choice_ebnf(['a"b']) == 'root ::= "a\\u0022b"'
    obj = StructuredOutputs(json_object=True)
    assert accepts(grammars, obj, '{"a": [1, {"b": null}]}') and not accepts(grammars, obj, "[1]")
    assert is_instance(obj, "{}") and not is_instance(obj, "[]") and not is_instance(obj, "{")
    assert is_instance(StructuredOutputs(regex=r"\d{3}"), "123") and not is_instance(
        StructuredOutputs(regex=r"\d{3}"), "12"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mask_applies_to_cuda_logits(grammars):
    matcher = grammars.matcher(grammars.compile(StructuredOutputs(choice=["yes"])))
    logits = torch.zeros(2, 4096, device="cuda")
    StepMask(4096, 4).apply(logits, [None, matcher])
    assert bool((logits[0] == 0).all()) and int(torch.isfinite(logits[1]).sum()) >= 1
    assert int(torch.isfinite(logits[1]).sum()) < 4096


# Twenty wide repetitions, each with its own class and an end letter, compile for ~6.5 s on
# weir-tiny-py's 4k vocabulary on a quiet machine (a single `[^"]{0,900}` took 0.3 s): well past
# SHORT_TIMEOUT_S however fast the machine. Within check_regex's limits (no count over 1000, none nested).
SLOW = "".join(f'[^"{chr(97 + i)}]{{0,999}}{chr(65 + i)}' for i in range(20))
SHORT_TIMEOUT_S = 1.0


@pytest.fixture
def short_grammars(grammars, monkeypatch) -> Grammars:
    """The module's grammars (their child already up) with a short compile timeout."""
    monkeypatch.setattr(grammars, "timeout_s", SHORT_TIMEOUT_S)
    return grammars


def test_a_compile_past_its_timeout_is_killed_and_the_next_spec_compiles_on_a_fresh_child(short_grammars):
    """The child running a too-long compile is SIGKILLed, its spec refused (and the refusal cached);
    a spec queued behind it is compiled on a fresh child, not failed."""
    short_grammars.compile(StructuredOutputs(regex="[0-9]{3}"))  # the child is up
    first, kills = short_grammars._child.process, short_grammars.kills
    slow = short_grammars.submit(StructuredOutputs(regex=SLOW))
    queued = short_grammars.submit(StructuredOutputs(regex="[a-f]{2}-[0-9]{3}"))
    with pytest.raises(GrammarError) as err:
        slow.result()
    assert err.value.code == "grammar_too_complex" and f"within {SHORT_TIMEOUT_S:g} s" in str(err.value)
    matcher = short_grammars.matcher(queued.result())
    assert matcher.accept_string("ab-123") and not matcher.accept_string("x")
    assert first.poll() == -signal.SIGKILL and short_grammars._child.process is not first
    assert short_grammars.kills == kills + 1
    assert short_grammars.submit(StructuredOutputs(regex=SLOW)) is slow  # a repeated hostile spec costs nothing


def test_the_step_loop_runs_other_requests_while_a_grammar_compiles(tiny_py, short_grammars, monkeypatch):
    """A plain request added after a slow constraint finishes before that constraint is refused:
    the compile runs in the child, the step only polls its future."""
    monkeypatch.setattr(tiny_py, "_grammars", short_grammars)
    short_grammars.compile(StructuredOutputs(choice=["warm"]))  # a child is up: the slow one's clock runs at once
    slow = make_request(PROMPT, request_id="slow", structured=StructuredOutputs(regex=SLOW.replace("999", "998", 1)))
    plain = make_request(PROMPT, request_id="plain", max_tokens=8)
    assert tiny_py.add(slow, 0) is None and tiny_py.add(plain, 0) is None
    ends, steps = [], 0
    while tiny_py.has_work:
        ends += [out for out in tiny_py.step(0) if out.finish_reason is not None]
        steps += 1
    assert [(e.request_id, e.finish_reason) for e in ends] == [("plain", "length"), ("slow", "rejected")]
    assert ends[1].error.code == "grammar_too_complex" and steps > 8


def test_explosive_regexes_are_refused_before_any_compile():
    """The tester's nested repetition (it ran a compile out of memory) and huge counts are refused
    by check_structured, as a regex and as a schema's pattern; ordinary ones pass."""
    hostile = '(([^"]{0,5000}){0,5000}){0,5000}x'
    for pattern, why in [(hostile, "5000"), ("a{1001}", "1001"), ("(a{0,200}){0,100}", "multiply to 20000")]:
        with pytest.raises(UnsupportedSchema) as err:
            check_structured(StructuredOutputs(regex=pattern))
        assert err.value.keyword == "regex" and why in str(err.value)
    with pytest.raises(UnsupportedSchema) as err:
        check_structured(
            StructuredOutputs(
                json_schema={"type": "object", "properties": {"a": {"type": "string", "pattern": hostile}}}
            )
        )
    assert (err.value.keyword, err.value.pointer) == ("pattern", "/properties/a/pattern")
    for pattern in ["[0-9]{4}", ".{0,100}", "(a{0,100}){0,100}", "[a-f]{2}-[0-9]{3}", "a+b*", "["]:
        check_structured(StructuredOutputs(regex=pattern))  # "[" is the compiler's to refuse (invalid_regex)
