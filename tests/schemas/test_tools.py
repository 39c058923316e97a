"""Tool calls in the output text (schemas/tools.py): the constraint a forced call follows, and the
streaming parser: its pieces, however the text is split, add up to the calls it ends with."""

from __future__ import annotations

import hashlib
import json

import pytest

from schemas.messages import (
    ChatMessage,
    GenerateRequest,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolDef,
    ToolFunction,
)
from schemas.structured import check_structured, constraint_of
from schemas.tools import NO_PARAMETERS, call_id, call_text, tool_constraint, tool_parser, tools_problem

WEATHER = ToolFunction(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    strict=True,
)
NOW = ToolFunction(name="now")
TOOLS = [ToolDef(function=WEATHER), ToolDef(function=NOW)]


def request(request_id: str = "req-1", **fields) -> GenerateRequest:
    fields.setdefault("tools", TOOLS)
    return GenerateRequest(
        request_id=request_id,
        model="m",
        messages=[ChatMessage(role="user", content="hi")],
        deadline_ms=1,
        reply_to="weir.replies.t",
        **fields,
    )


def parse(req: GenerateRequest, text: str, size: int) -> tuple[str, list[ToolCallDelta], list]:
    """The parser's text and pieces when `text` is fed in chunks of `size` characters."""
    parser = tool_parser(req)
    assert parser is not None
    chunks = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    out, pieces = "", []
    for i, chunk in enumerate(chunks):
        parsed = parser.finish(chunk) if i == len(chunks) - 1 else parser.feed(chunk)
        out += parsed.text
        pieces += parsed.calls
    return out, pieces, parser.calls


def assemble(pieces: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """Calls as a client rebuilds them from stream pieces: id and name from the first, arguments appended."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.index not in calls:
            assert piece.id and piece.name, "a call's first piece names it"
            calls[piece.index] = [piece.id, piece.name, ""]
        else:
            assert piece.id is None and piece.name is None
        calls[piece.index][2] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(c) for _, c in sorted(calls.items())]


def parse_all_ways(req: GenerateRequest, text: str) -> tuple[str, list]:
    """Text and calls, checked to be the same whatever the chunking, pieces adding up to the calls."""
    results = set()
    for size in (1, 2, 3, 5, 11, len(text) or 1):
        out, pieces, calls = parse(req, text, size)
        assert assemble(pieces) == [(c.id, c.function.name, c.function.arguments) for c in calls]
        results.add((out, tuple((c.function.name, c.function.arguments) for c in calls)))
    assert len(results) == 1, results
    out, calls = results.pop()
    return out, list(calls)


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa<ris}"}}\n</tool_call>\n'
    '<tool_call>{"name": "now", "parameters": {}}</tool_call>\n'
)


def test_hermes_calls_are_parsed_out_of_the_text():
    text, calls = parse_all_ways(request(), HERMES)
    assert text == "Let me check."
    assert calls == [("get_weather", '{"city":"Pa<ris}"}'), ("now", "{}")]


@pytest.mark.parametrize(
    "inside",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # bad JSON
        '{"name": "launch", "arguments": {}}',  # no such function
        '{"name": "get_weather", "arguments": [1]}',  # arguments not an object
        '["get_weather"]',
    ],
)
def test_an_inside_that_is_no_call_is_released_as_text(inside):
    output = f"A\n<tool_call>{inside}</tool_call> B"
    assert parse_all_ways(request(), output) == (output, [])


def test_a_tag_left_open_and_a_partial_tag_are_text():
    assert parse_all_ways(request(), 'x <tool_call>{"name": "now"') == ('x <tool_call>{"name": "now"', [])
    assert parse_all_ways(request(), "a <tool_ca") == ("a <tool_ca", [])
    parser = tool_parser(request())
    assert parser.feed("Hello <tool").text == "Hello"  # held back: it may become a tag
    assert parser.feed("box>").text == " <toolbox>"


def test_only_whitespace_that_separates_calls_from_each_other_or_the_ends_is_dropped():
    call = '<tool_call>{"name": "now"}</tool_call>'
    assert parse_all_ways(request(), f"Hi\n{call}\n ok \n")[0] == "Hi\n\n ok \n"
    assert parse_all_ways(request(), f" \n{call}\n{call}\n\nDone.")[0] == "Done."
    assert parse_all_ways(request(), f"Hi {call} {call} there")[0] == "Hi  there"


def test_text_without_calls_is_kept_exactly():
    for output in ("  Hello,\n world \n", "", "\n\n", "{not json at all"):
        assert parse_all_ways(request(), output) == (output, [])


def test_a_bare_json_call_is_the_whole_output_or_text():
    call = ' {"name": "get_weather", "parameters": {"city": "P}aris"}}\n'
    assert parse_all_ways(request(), call) == ("", [("get_weather", '{"city":"P}aris"}')])
    assert parse_all_ways(request(), '{"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}')[1] == [
        ("get_weather", '{"city":"X"}')
    ]
    followed = call + "and then text"
    assert parse_all_ways(request(), followed) == (followed, [])
    other = '{"city": "Paris"}'  # JSON, but no call
    assert parse_all_ways(request(), other) == (other, [])
    parser = tool_parser(request())
    assert parser.feed('{"name": "now"} x').text == '{"name": "now"} x'  # released as soon as it is known


def test_parallel_tool_calls_false_leaves_a_second_call_as_text():
    text, calls = parse_all_ways(request(parallel_tool_calls=False), HERMES)
    assert calls == [("get_weather", '{"city":"Pa<ris}"}')]
    assert text == 'Let me check.\n\n<tool_call>{"name": "now", "parameters": {}}</tool_call>\n'


def test_required_publishes_each_call_when_its_object_closes():
    req = request(tool_choice="required")
    output = '[{"name": "get_weather", "arguments": {"city": "[x]}\\""}}, {"name": "now", "arguments": {}}]'
    assert parse_all_ways(req, output) == ("", [("get_weather", '{"city":"[x]}\\""}'), ("now", "{}")])
    parser = tool_parser(req)
    first = parser.feed(output[:60])
    assert [c.name for c in first.calls] == ["get_weather"] and first.text == ""


def test_required_cut_short_drops_the_unfinished_rest():
    """The constraint's text is never content: cut short, the closed calls are the reply."""
    req = request(tool_choice="required")
    text, calls = parse_all_ways(req, '[{"name": "now", "arguments": {}}, {"name": "get_wea')
    assert calls == [("now", "{}")] and text == ""
    assert parse_all_ways(req, "[]") == ("", [])  # an empty array is no call, and no text
    unfit = '[{"name": "now", "arguments": "f"}, {"name": "now", "arguments": {}}]'  # arguments no object
    assert parse_all_ways(req, unfit) == ("", [])  # nothing after what does not fit is read as a call either


def test_required_publishes_a_repeated_call_once_and_says_the_output_repeats():
    """A small model under the array grammar repeats its call (issue 35, item 12): a call equal to
    one already made (arguments compared as JSON, key order aside) is no new call."""
    req = request(tool_choice="required")
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    output = f'[{weather}, {{"name": "now", "arguments": {{}}}}, {weather}, {{"arguments": {{}}, "name": "now"}}]'
    assert parse_all_ways(req, output) == ("", [("get_weather", '{"city":"Paris"}'), ("now", "{}")])
    parser = tool_parser(req)
    assert parser is not None and not parser.is_repeating
    parsed = parser.feed(f"[{weather}, {weather[:-1]}")
    assert [c.index for c in parsed.calls] == [0] and not parser.is_repeating
    assert parser.feed("}").calls == [] and parser.is_repeating  # the second object closed: the same call
    other = parse_all_ways(
        req,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Lyon"}}]',
    )
    assert other == ("", [("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Lyon"}')])  # not a repeat
    ids = [c.id for c in tool_parser(req).finish(output).calls]
    assert ids == [call_id("req-1", 0), call_id("req-1", 1)]  # indexes count the calls made, not the objects


def test_parameters_must_be_an_object_schema():
    string = ToolDef(function=ToolFunction(name="f", parameters={"type": "string"}))
    assert tools_problem(TOOLS) is None and tools_problem(None) is None
    index, why = tools_problem([*TOOLS, string])
    assert index == 2 and 'of type "object"' in why and "'string'" in why
    assert tools_problem([ToolDef(function=ToolFunction(name="g", parameters={}))])[0] == 0  # untyped: any JSON


def test_named_streams_the_arguments_as_they_grow():
    req = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    output = '{"city": "Paris"}'
    assert parse_all_ways(req, output) == ("", [("get_weather", output)])
    _, pieces, _ = parse(req, output, 4)
    assert pieces[0] == ToolCallDelta(index=0, id=call_id(req.request_id, 0), name="get_weather", arguments='{"ci')
    assert len(pieces) == 5


def test_ids_are_derived_from_the_request_id_and_index():
    assert call_id("req-1", 1) == "call_" + hashlib.sha256(b"req-1/1").hexdigest()[:24]
    ids = [p.id for p in parse(request("req-1"), HERMES, 3)[1]]
    assert ids == [call_id("req-1", 0), call_id("req-1", 1)] == [p.id for p in parse(request("req-1"), HERMES, 7)[1]]
    assert set(ids).isdisjoint(p.id for p in parse(request("req-2"), HERMES, 3)[1])


def test_no_parser_when_no_call_may_be_made():
    assert tool_parser(request(tool_choice="none")) is None
    assert tool_parser(request(tools=None)) is None


def test_named_constraint_is_the_functions_parameters():
    named = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_constraint(named).json_schema == WEATHER.parameters and tool_constraint(named).strict
    no_params = tool_constraint(request(tool_choice={"type": "function", "function": {"name": "now"}}))
    assert no_params.json_schema == NO_PARAMETERS and not no_params.strict
    assert constraint_of(named) == tool_constraint(named)
    assert tool_constraint(request()) is None and tool_constraint(request(tool_choice="none")) is None


def test_required_constraint_accepts_calls_and_only_calls():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    one = tool_constraint(request(tool_choice="required", parallel_tool_calls=False))
    many = tool_constraint(request(tool_choice="required"))
    for spec in (one, many):
        check_structured(spec)  # every keyword is one Weir enforces; strict rules hold where claimed
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    two = f'[{call}, {{"name": "now", "arguments": {{}}}}]'
    grammar = {id(s): xgr.Grammar.from_json_schema(json.dumps(s.json_schema)) for s in (one, many)}
    assert accepts(grammar[id(one)], f"[{call}]") and not accepts(grammar[id(one)], two)
    assert accepts(grammar[id(many)], two)
    for bad in (
        "[]",
        '[{"name": "launch", "arguments": {}}]',
        '[{"name": "now", "arguments": {"x": 1}}]',
        '[{"name": "get_weather", "arguments": {}}]',
    ):
        assert not accepts(grammar[id(many)], bad), bad
    assert not one.strict  # `now` is not strict


def test_json_nested_deeper_than_json_reads_is_no_call_and_breaks_nothing():
    deep = "[" * 5000 + "]" * 5000
    for output in (
        f'<tool_call>{{"name": "now", "arguments": {deep}}}</tool_call>',
        f'{{"name": "now", "arguments": {deep}}}',
        f'{{"name": "now", "arguments": "{deep}"}}',
    ):
        assert parse(request(), output, 64)[:2] == (output, [])
    forged = ToolCall(id="c", function=ToolCallFunction(name="now", arguments=deep))
    assert deep in call_text(forged)  # rendered as the string it is
