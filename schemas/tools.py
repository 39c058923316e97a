"""Tool calls in the generated text: the constraint a forced call follows, and the parser that
turns output text into ToolCallDelta pieces and complete ToolCalls (docs/design.md, "Structured
output, tools and logprobs": tool calls are parsed where they are generated).

Pure: the worker feeds the parser the text its sequence emits, so its pieces are a function of the
output tokens and a regenerated request gives the same events and the same call ids (invariant 3).

What the output is, by `tool_choice` (tools given; `none` parses nothing):

- a named function: the whole output is that function's arguments (a JSON object; the constraint
  is its parameter schema). The call's first piece carries its id and name and the arguments text
  so far; later pieces append to the arguments as they are generated. No text. An output cut
  short (max_tokens, a stop string) is still the call, with the arguments generated so far.
- `required`: the whole output is a JSON array of `{"name": ..., "arguments": {...}}` objects (one
  when parallel_tool_calls is false). Each call is published, complete, when its object closes.
  Never text: the constraint's text is no answer of its own. An array cut short (max_tokens, a
  stop string) ends with the calls it closed; its unfinished rest is dropped (finish_reason
  `length` tells the client it was cut). A call identical to one the array already made (the same
  function with equal arguments) is not a call: a small model under the array grammar repeats
  its call until max_tokens (SmolLM2 with a function without parameters: `[{"name": "get_news",
  "arguments": {}}, {"name": "get_news", ...`). It is dropped, and the parser says `is_repeating`,
  on which the engine steers the array to close (services/worker/engine/llm_engine.py).
- `auto` (or unset): the model's own format, parsed from its text. Supported:
  * Hermes (Qwen 2.5+, Hermes 2/3, and Weir's fallback prompt for templates without tools):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, among text. Text
    outside the tags streams as text; a tag's inside is held back and published as one complete
    piece when `</tool_call>` closes it. An inside that is not a call (bad JSON, not an object, an
    unknown function, arguments that are not an object) is released as text, tags included, as is
    a tag left open at the end. Whitespace that only separates calls from each other or from the
    start or the end of the output is dropped.
  * A bare JSON object as the whole output (Llama 3.x): `{"name": ..., "parameters": {...}}` or
    with `arguments`. Output that starts with `{` is held back until it is known not to be one
    call (text after the object closes) or it ends; what is no call is released as text.
  With parallel_tool_calls false, a call after the first is left as text.
  `arguments` may also be given as `parameters`, or as a string holding a JSON object. A call's
  arguments text is the object as compact JSON; a call without arguments has `{}`.

A call's id is `call_` + the first 24 hex digits of sha256("<request_id>/<index>").

    tools_problem(tools)        (index, why) of the first tool whose parameters are no object schema
    tool_constraint(request)    the StructuredOutputs a required or named tool_choice implies
    tool_parser(request)        the streaming parser for a request that may call tools, or None
    call_id(request_id, index)  a call's deterministic id
"""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import (
    GenerateRequest,
    NamedToolChoice,
    StructuredOutputs,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolDef,
    ToolFunction,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
# A function without parameters takes exactly the empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def call_id(request_id: str, index: int) -> str:
    """The id of call `index` of a request: derived, so a regenerated request repeats it (invariant 3)."""
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


# -- constraints ---------------------------------------------------------------------------------


def tools_problem(tools: list[ToolDef] | None) -> tuple[int, str] | None:
    """(index, why) of the first tool whose `parameters` is not an object schema, else None.

    A call's arguments are named, so its schema is of type object (OpenAI refuses any other);
    another type would let a forced call's arguments be, say, a string: no call the parser can
    publish. The gateway and the worker both refuse with it (a raw Kafka request too)."""
    for i, tool in enumerate(tools or []):
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type") != "object":
            return i, (
                'a function\'s parameters must be a JSON Schema of type "object" (its arguments are '
                f"named), not of type {parameters.get('type')!r}"
            )
    return None


def tool_constraint(request: GenerateRequest) -> StructuredOutputs | None:
    """The constraint on the output of a request whose tool_choice forces a call, else None.

    Named: the function's parameter schema (strict when the function is). Required: an array of
    `{"name": const, "arguments": parameters}` objects, anyOf over the functions, at least one
    item and at most one when parallel_tool_calls is false; strict when every function is (the
    wrapper objects follow strict rules themselves).
    """
    choice, functions = request.tool_choice, [t.function for t in request.tools or []]
    if isinstance(choice, NamedToolChoice):
        function = next(f for f in functions if f.name == choice.function.name)  # the request checked it is there
        return StructuredOutputs(json_schema=_parameters(function), strict=bool(function.strict))
    if choice != "required":
        return None
    call = {"anyOf": [_call_schema(f) for f in functions]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputs(json_schema=schema, strict=all(f.strict for f in functions))


def _parameters(function: ToolFunction) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else NO_PARAMETERS


def _call_schema(function: ToolFunction) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": _parameters(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# -- rendering, for chat templates that do not know tools (weir/chat_template.py) --


def tools_preamble(tools: list[ToolDef]) -> str:
    """The system text that lists the functions and asks for Hermes-format calls."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are listed, as JSON, "
        f"within <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with a JSON object with its name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def call_text(call: ToolCall) -> str:
    """A call the assistant made, as the Hermes text the preamble asks for (arguments as an
    object when they are JSON, else as the string they are)."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # not JSON, or nested past what json reads: the string as is
        arguments = call.function.arguments
    body = json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def response_text(content: str) -> str:
    """A tool's result, as Hermes templates show it to the model."""
    return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"


# -- parsing -------------------------------------------------------------------------------------


_CALL_KEYS = frozenset({"name", "arguments", "parameters"})


@dataclass
class Parsed:
    """What a piece of output text becomes: text for the client and tool call pieces."""

    text: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def tool_parser(request: GenerateRequest) -> ToolCallParser | None:
    """The parser for a request that may call tools (tools given, tool_choice not none), else None."""
    if not request.calls_tools:
        return None
    functions = {t.function.name: t.function for t in request.tools or []}
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        return NamedCallParser(request.request_id, functions, choice.function.name)
    if choice == "required":
        return CallListParser(request.request_id, functions, request.parallel_tool_calls)
    return HermesParser(request.request_id, functions, request.parallel_tool_calls)


class ToolCallParser(abc.ABC):
    """Streaming: feed() the output text as it is emitted, finish() with the last of it; the calls
    made are in `calls`, complete, once finish() returned."""

    def __init__(self, request_id: str, functions: dict[str, ToolFunction]) -> None:
        self.request_id = request_id
        self.functions = functions
        self.calls: list[ToolCall] = []
        self.is_repeating = False  # the output repeated a call it made (CallListParser): it should end

    @abc.abstractmethod
    def feed(self, text: str) -> Parsed:
        """What the next piece of output text becomes (text and pieces may be held back)."""

    @abc.abstractmethod
    def finish(self, text: str) -> Parsed:
        """What the last piece of output text becomes, with everything held back; fills `calls`."""

    def _complete(self, name: str, arguments: str) -> ToolCallDelta:
        """Record a complete call; its one piece."""
        index = len(self.calls)
        ident = call_id(self.request_id, index)
        self.calls.append(ToolCall(id=ident, function=ToolCallFunction(name=name, arguments=arguments)))
        return ToolCallDelta(index=index, id=ident, name=name, arguments=arguments)

    def _as_call(self, text: str, keys: frozenset[str] = _CALL_KEYS) -> tuple[str, str] | None:
        """(name, arguments as compact JSON) when `text` is one call of a known function, else None."""
        try:
            value = _json_value(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not set(value) <= keys or value.get("name") not in self.functions:
            return None
        if "arguments" in value and "parameters" in value:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = _json_value(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def _json_value(text: str) -> Any:
    """json.loads, with nesting too deep for it (a model can say `[[[[...`) a ValueError too."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deep") from exc


class NamedCallParser(ToolCallParser):
    """tool_choice names a function: the output is its arguments, streamed as they grow."""

    def __init__(self, request_id: str, functions: dict[str, ToolFunction], name: str) -> None:
        super().__init__(request_id, functions)
        self.name = name
        self._arguments: str | None = None  # None until the first text

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self._arguments is None:
            self._arguments = text
            piece = ToolCallDelta(index=0, id=call_id(self.request_id, 0), name=self.name, arguments=text)
        else:
            self._arguments += text
            piece = ToolCallDelta(index=0, arguments=text)
        return Parsed(calls=[piece])

    def finish(self, text: str) -> Parsed:
        parsed = self.feed(text)
        if self._arguments is not None:
            function = ToolCallFunction(name=self.name, arguments=self._arguments)
            self.calls = [ToolCall(id=call_id(self.request_id, 0), function=function)]
        return parsed


class _JsonDepth:
    """Nesting depth of JSON text read one character at a time, strings (and their escapes) skipped."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False

    def read(self, ch: str) -> int:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        return self.depth


class CallListParser(ToolCallParser):
    """tool_choice required: the output is a JSON array of call objects; each is published when it
    closes. Nothing of it is text: what does not fit (possible only without the grammar, or when
    the output is cut short) is dropped, from there on."""

    def __init__(self, request_id: str, functions: dict[str, ToolFunction], parallel: bool) -> None:
        super().__init__(request_id, functions)
        self.parallel = parallel
        self._json = _JsonDepth()
        self._pending = ""  # read since the last call: the array's framing and an unfinished object
        self._object_start = 0
        self._closed = False  # the array's ] was read
        self._is_lost = False  # the output stopped fitting: the rest is no call
        self._made: set[tuple[str, str]] = set()  # (name, arguments as canonical JSON) of the calls made

    def feed(self, text: str) -> Parsed:
        parsed = Parsed()
        if self._is_lost:
            return parsed
        for ch in text:
            self._pending += ch
            if not self._read(ch, parsed):
                self._is_lost = True
                break
        return parsed

    def finish(self, text: str) -> Parsed:
        parsed = self.feed(text)
        self._pending = ""  # cut short, or no call at all: dropped
        return parsed

    def _read(self, ch: str, parsed: Parsed) -> bool:
        """Take one character; False when the output no longer fits an array of calls."""
        before = self._json.depth
        if ch.isspace() and before < 2:
            return True  # whitespace between the array's items (inside an object, it may be in a string)
        if self._closed:
            return False  # something after the array
        depth = self._json.read(ch)
        if before == 0:
            return ch == "["
        if before == 1:
            if ch == "]":
                self._closed = True
                return True
            if ch == ",":
                return bool(self.calls)
            if ch == "{" and (self.parallel or not self.calls):
                self._object_start = len(self._pending) - 1
                return True
            return False
        if depth == 1:  # an object closed
            call = self._as_call(self._pending[self._object_start :], frozenset({"name", "arguments"}))
            if call is None:
                return False
            key = (call[0], json.dumps(json.loads(call[1]), sort_keys=True))  # argument order aside
            if key in self._made:
                self.is_repeating = True  # the same call again: the model repeats itself, no new call
            else:
                self._made.add(key)
                parsed.calls.append(self._complete(*call))
            self._pending = ""
        return True


class HermesParser(ToolCallParser):
    """tool_choice auto: text with <tool_call> blocks, or one bare JSON call as the whole output.

    The text is the output with the calls taken out, except whitespace that only separates calls
    from each other or from the start or the end of the output."""

    def __init__(self, request_id: str, functions: dict[str, ToolFunction], parallel: bool) -> None:
        super().__init__(request_id, functions)
        self.parallel = parallel
        self._mode = "start"  # start (only whitespace so far), text, call (inside a tag), bare
        self._held = ""  # read, not yet released: whitespace, a partial tag, a tag's inside, a bare object
        self._tag_ws = ""  # the whitespace before the open tag, given back if it is no call
        self._sep = ""  # the whitespace between the last text and the calls since
        self._said = False  # some text was released
        self._after_call = False  # no text released since the last call
        self._bare = _JsonDepth()
        self._bare_opened = False  # the possible bare call's { was read

    def feed(self, text: str) -> Parsed:
        parsed = Parsed()
        if self._mode == "bare":
            self._read_bare(text, parsed)
            return parsed
        self._held += text
        if self._mode == "start":
            body = self._held.lstrip()
            if not body:
                return parsed
            if body.startswith("{"):
                self._mode, held, self._held = "bare", self._held, ""
                self._read_bare(held, parsed)
                return parsed
            self._mode = "text"
        self._scan(parsed)
        return parsed

    def finish(self, text: str) -> Parsed:
        parsed = self.feed(text)
        held, self._held = self._held, ""
        if self._mode == "bare":
            call = self._as_call(held) if self._bare.depth == 0 else None
            if call is not None:
                parsed.calls.append(self._complete(*call))
            else:
                parsed.text += held
        elif self._mode == "call":
            self._emit(self._tag_ws + TOOL_CALL_OPEN + held, parsed)  # left open: no call
        elif held.strip() or not self._after_call:
            self._emit(held, parsed)
        return parsed

    def _read_bare(self, text: str, parsed: Parsed) -> None:
        """Hold what may be a bare call; text after its object closes makes all of it text."""
        for i, ch in enumerate(text):
            if self._bare.depth == 0 and self._bare_opened and not ch.isspace():
                self._mode, self._held = "text", self._held + text[i:]
                self._scan(parsed)
                return
            self._held += ch
            self._bare.read(ch)
            self._bare_opened = self._bare_opened or ch == "{"

    def _scan(self, parsed: Parsed) -> None:
        """Release text up to a tag, read calls, hold what could still become a tag."""
        while True:
            if self._mode == "call":
                end = self._held.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return
                inside, self._held = self._held[:end], self._held[end + len(TOOL_CALL_CLOSE) :]
                self._mode = "text"
                self._close(inside, parsed)
                continue
            may_call = self.parallel or not self.calls
            start = self._held.find(TOOL_CALL_OPEN) if may_call else -1
            if start >= 0:
                body = self._held[:start].rstrip()
                self._emit(body, parsed)
                self._tag_ws = self._held[len(body) : start]
                if not self._after_call:
                    self._sep = self._tag_ws
                self._mode, self._held = "call", self._held[start + len(TOOL_CALL_OPEN) :]
                continue
            keep = _partial_tag(self._held) if may_call else 0
            body = self._held[: len(self._held) - keep].rstrip()  # trailing whitespace may only separate
            self._emit(body, parsed)
            self._held = self._held[len(body) :]
            return

    def _close(self, inside: str, parsed: Parsed) -> None:
        call = self._as_call(inside)
        if call is None:
            self._emit(self._tag_ws + TOOL_CALL_OPEN + inside + TOOL_CALL_CLOSE, parsed)
        else:
            parsed.calls.append(self._complete(*call))
            self._after_call = True

    def _emit(self, text: str, parsed: Parsed) -> None:
        """Release text outside calls; after a call, the whitespace before it and the calls'
        separators come back only between text and text."""
        if not text:
            return
        if self._after_call:
            text = self._sep + text if self._said else text.lstrip()
            self._after_call = False
        parsed.text += text
        self._said = self._said or bool(text.strip())


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins the open tag (it may become one)."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
