"""Tools in the worker: the chat template renders them as transformers does (or Weir's Hermes
fallback does, for a template that does not read them), and the engine turns the calls in what the
model says into ReplyDelta.tool_calls pieces and ReplyEnd.tool_calls, deterministically."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from schemas.messages import ChatMessage, ReplyDelta, ReplyEnd, ToolDef
from schemas.tools import call_id, tools_preamble
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.tokenizer import ModelTokenizer
from services.worker.kafka.events import reply_events

from .factories import make_request
from .positions import contiguous
from .test_chat_template import CHATML_TOKENS, SMOLLM2, tokenizer_dir

transformers = pytest.importorskip("transformers")

TINY_DIR = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"

# A Qwen 2.5 style template (Hermes tool calls): tools in the system turn, an assistant's calls in
# <tool_call> tags with `arguments | tojson`, runs of tool results in one user turn.
QWEN_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# An OpenAI request's tools and messages, as a client sends them.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_b", "content": "18C"},
    {"role": "user", "content": "Thanks. And the time?"},
]


def wire(chat: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in chat]


def hf_render(path: Path, chat: list[dict], tools: list[dict] | None) -> str:
    hf = transformers.AutoTokenizer.from_pretrained(path)
    return hf.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("tools", [[WEATHER, NOW], None], ids=["tools", "no-tools"])
def test_a_template_that_knows_tools_renders_them_as_transformers(tools, tmp_path):
    path = tokenizer_dir(tmp_path, QWEN_TOOLS, CHATML_TOKENS, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer = ModelTokenizer(path)
    weir = tokenizer.render_chat(wire(CHAT), [ToolDef.model_validate(t) for t in tools] if tools else None)
    assert weir == hf_render(path, CHAT, tools)
    assert '"arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 1}"' in weir and "<tool_response>\n18C" in weir
    assert ('"description": "Today\'s weather in a city."' in weir) == bool(tools)


def test_a_template_without_tools_gets_them_as_hermes_text_turns(tmp_path):
    path = tokenizer_dir(tmp_path, SMOLLM2, CHATML_TOKENS, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tools = [ToolDef.model_validate(t) for t in (WEATHER, NOW)]
    turns = [  # the rendering chat_template.py documents, written out
        {"role": "system", "content": tools_preamble(tools) + "\n\nYou are terse."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"days": 1}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": '<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n18C\n</tool_response>',
        },
        {"role": "user", "content": "Thanks. And the time?"},
    ]
    assert ModelTokenizer(path).render_chat(wire(CHAT), tools) == hf_render(path, turns, None)
    preamble = tools_preamble(tools)
    assert json.dumps(WEATHER) in preamble and '{"name": <function-name>, "arguments": <args-json-object>}' in preamble
    without = ModelTokenizer(path).render_chat(wire(CHAT), None)
    assert preamble not in without and "<tool_response>\n18C" in without  # tool turns are text turns either way


# -- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.set_num_threads(1)
    return Engine(TINY_DIR, EngineConfig(max_model_len=512, kv_cache_bytes=8 << 20), torch.device("cpu"))


def tool_request(**fields):
    fields = {"prompt": None, "messages": wire(CHAT[:2]), "tools": [WEATHER, NOW], "max_tokens": 64, **fields}
    return make_request(**fields)


def run_scripted(engine: Engine, monkeypatch, request, output: str) -> list[ReplyDelta | ReplyEnd]:
    """Reply events of `request` when its model says `output` then ends: the forward pass's logits
    are replaced by ones that make `output`'s tokens, then end-of-sequence, the greedy choice."""
    script = engine.tokenizer.encode(output) + [min(engine.eos_ids)]
    real_run = engine._run
    made: list[int] = []

    def scripted(plan):
        logits = torch.full(real_run(plan).shape, -1e4)
        assert logits.shape[0] == 1  # one request at a time
        logits[0, script[len(made)]] = 0.0
        made.append(script[len(made)])
        return logits

    monkeypatch.setattr(engine, "_run", scripted)
    assert engine.add(request, 0) is None
    events = []
    while engine.has_work:
        for out in engine.step(0):
            events += reply_events(request, "b1", out, "weir-tiny-py@1")
    monkeypatch.setattr(engine, "_run", real_run)
    return events


CALLING = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call> ok STOP tail'


def test_the_engine_streams_calls_out_of_the_text_and_ends_with_them(engine, monkeypatch):
    request = tool_request(request_id="tools-1", stop=["STOP"])
    events = run_scripted(engine, monkeypatch, request, CALLING)
    deltas, end = events[:-1], events[-1]
    assert contiguous(events)
    assert isinstance(end, ReplyEnd) and end.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == "Sure.  ok "  # the call is not text; the stop string still cuts
    pieces = [p for d in deltas for p in d.tool_calls or []]
    assert [(p.index, p.id, p.name, p.arguments) for p in pieces] == [
        (0, call_id("tools-1", 0), "get_weather", '{"city":"Oslo","days":2}')
    ]
    assert [(c.id, c.function.name, c.function.arguments) for c in end.tool_calls] == [
        (pieces[0].id, "get_weather", '{"city":"Oslo","days":2}')
    ]
    assert sum(len(e.token_ids) for e in deltas) == len(engine.tokenizer.encode(CALLING[: CALLING.index("STOP") + 4]))
    again = run_scripted(engine, monkeypatch, request, CALLING)  # a regenerated request: the same events
    times = {"created_ms": True, "received_ms": True, "first_token_ms": True, "usage": {"cached_prompt_tokens"}}
    assert [e.model_dump(exclude=times) for e in again] == [e.model_dump(exclude=times) for e in events]


def test_tool_choice_none_renders_the_tools_but_parses_no_call(engine, monkeypatch):
    events = run_scripted(engine, monkeypatch, tool_request(tool_choice="none", stop=["STOP"]), CALLING)
    assert "".join(e.text for e in events[:-1]) == CALLING[: CALLING.index(" STOP") + 1]
    assert all(e.tool_calls is None for e in events)
    auto, none = tool_request(), tool_request(tool_choice="none")
    assert engine.tokenizer.render(auto) == engine.tokenizer.render(none)
    assert engine.tokenizer.render(auto).startswith(
        "system: " + tools_preamble(auto.tools)
    )  # no template: a transcript


def test_a_named_tool_choice_gives_arguments_valid_for_its_schema(engine):
    """Needs the grammar (services/worker/engine/grammar.py) to constrain the output."""
    if importlib.util.find_spec("services.worker.engine.grammar") is None:
        pytest.skip("services/worker/engine/grammar.py (constrained decoding) is not in this tree")
    request = tool_request(
        request_id="tools-named", tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert engine.add(request, 0) is None
    events = []
    while engine.has_work:
        for out in engine.step(0):
            events += reply_events(request, "b1", out, "weir-tiny-py@1")
    end = events[-1]
    assert end.finish_reason == "stop" and "".join(e.text for e in events[:-1]) == ""
    [call] = end.tool_calls
    assert (call.id, call.function.name) == (call_id("tools-named", 0), "get_weather")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Oslo")
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 3
    pieces = [p for e in events[:-1] for p in e.tool_calls or []]
    assert "".join(p.arguments for p in pieces) == call.function.arguments and pieces[0].id == call.id


def test_a_required_call_cut_short_leaves_no_text_and_a_non_object_schema_is_refused(engine):
    """The constraint's text is never content (a reply cut by max_tokens ends with the calls it
    closed); a raw request whose function takes a non-object schema is refused, as the gateway does."""
    if importlib.util.find_spec("services.worker.engine.grammar") is None:
        pytest.skip("services/worker/engine/grammar.py (constrained decoding) is not in this tree")
    request = tool_request(request_id="tools-cut", tool_choice="required", max_tokens=12)
    assert engine.add(request, 0) is None
    events = []
    while engine.has_work:
        for out in engine.step(0):
            events += reply_events(request, "b1", out, "weir-tiny-py@1")
    assert events[-1].finish_reason == "length" and "".join(e.text for e in events[:-1]) == ""
    string = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    refused = engine.add(tool_request(request_id="tools-string", tools=[WEATHER, string], tool_choice="required"), 0)
    assert refused.finish_reason == "rejected" and refused.error.code == "invalid_tool_parameters"
    assert refused.error.message.startswith("tools[1]: ") and 'of type "object"' in refused.error.message
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    refused = engine.add(tool_request(request_id="tools-strict-auto", tools=[strict], tool_choice="auto"), 0)
    assert refused.finish_reason == "rejected" and refused.error.code == "unsupported_parameter"
    assert "strict" in refused.error.message  # a Kafka record the gateway would have refused, never served unkept
