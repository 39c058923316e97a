"""The OpenAI request bodies Weir serves, /v1/chat/completions and /v1/completions: as the gateway
receives them over HTTP and as the batch job runner reads them from the lines of an input file,
so both accept and refuse the same things.

Pure. Bodies are validated strictly from raw JSON (a string where a number belongs is an error,
as with OpenAI). Every parameter of OpenAI's API is honoured; or refused with
`unsupported_parameter` when it asks for something Weir cannot do (UNSUPPORTED: audio, the
deprecated `functions`, ...); or, for the few that cannot change the output (`user`, `metadata`,
`safety_identifier`, `prompt_cache_key`), accepted by design and not used. A parameter OpenAI
does not have is refused with `unknown_parameter`, as OpenAI does: nothing is silently ignored.

Structured output (`response_format`, vLLM's `structured_outputs`) and tools (`tools`,
`tool_choice`, `parallel_tool_calls`, tool messages) become the GenerateRequest's `structured`,
`tools`, `tool_choice` and `parallel_tool_calls` (docs/design.md, "Structured output, tools and
logprobs"); a constraint Weir cannot enforce is refused here, naming the keyword and where it is.
n (and best_of) > 1 become sibling requests (sibling_requests; docs/design.md, "n and best_of are
sibling requests"); logprobs become GenerateRequest.logprobs; echo is the edge's to render.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from schemas.messages import (
    MAX_PENALTY,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    TOOL_NAME_PATTERN,
    ChatMessage,
    GenerateRequest,
    LogitBias,
    NamedToolChoice,
    ReplyEnd,
    StructuredOutputs,
    ToolCall,
    ToolChoice,
    ToolDef,
    sibling_seed,
)
from schemas.structured import UnsupportedSchema, check_structured
from schemas.tools import tools_problem

Kind = Literal["chat.completions", "completions"]

# Most choices one body may ask for (n, and best_of on /v1/completions). OpenAI allows 128; each
# choice here is a whole generation (a sibling request: docs/design.md, "n and best_of are sibling
# requests") holding a lane ticket and a share of the batch, so Weir bounds them lower.
MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound of /v1/completions `logprobs`


class BodyError(ValueError):
    """A body Weir refuses: what is wrong, the parameter at fault (a dotted path) and OpenAI's code."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# OpenAI parameters Weir does not serve: refused unless absent or set to a value that asks for
# nothing (the neutral values here), e.g. `logprobs: false`, `response_format: {"type": "text"}`.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # deprecated by OpenAI; its answers differ too (message.function_call): use tools and tool_choice
    "functions": ((None, []), "the deprecated functions parameter is not supported; use tools"),
    "function_call": ((None, "none"), "the deprecated function_call parameter is not supported; use tool_choice"),
    "modalities": ((None, ["text"]), 'only text output is supported: modalities ["text"]'),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "no served model is a reasoning model"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "Weir does not store completions"),
    "service_tier": ((None, "auto", "default"), "only the default service tier exists (lanes: X-Weir-Priority)"),
}
_REFUSED = Field(None, description="Not supported: refused (400 unsupported_parameter) unless absent or neutral.")
_UNUSED = "Accepted by design and not used: it cannot change the output."


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str = Field(max_length=1 << 20)


class _ToolCall(BaseModel):
    """A call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"]
    function: _CalledFunction


class _Message(BaseModel):
    # fields validate in this order: content's and tool_call_id's checks read role and tool_calls
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[_ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="assistant: calls it made.")
    tool_call_id: str | None = Field(
        None, min_length=1, max_length=128, validate_default=True, description="tool: the call it answers."
    )
    content: str | list[_TextPart] | None
    name: str | None = Field(None, description="Not supported: participant names are refused.")

    @model_validator(mode="before")
    @classmethod
    def _content_may_be_absent(cls, data: Any) -> Any:
        # As OpenAI: an assistant turn that made tool calls may leave content out (or null).
        if (
            isinstance(data, dict)
            and "content" not in data
            and data.get("role") == "assistant"
            and data.get("tool_calls")
        ):
            return {**data, "content": None}
        return data

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: list[_ToolCall] | None, info: ValidationInfo) -> list[_ToolCall] | None:
        if value and info.data.get("role", "assistant") != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_names_its_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role is not None and (role == "tool") != (value is not None):
            raise ValueError("a tool message, and only a tool message, names the tool_call_id it answers")
        return value

    @field_validator("content")
    @classmethod
    def _content_given(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError(
                "content must be a string or a list of text parts (null only in an assistant message with tool_calls)"
            )
        return value

    def to_wire(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        role = "system" if self.role == "developer" else self.role
        calls = [ToolCall.model_validate(c.model_dump()) for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(role=role, content=text, tool_calls=calls, tool_call_id=self.tool_call_id)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _JsonSchemaFormat(BaseModel):
    """response_format.json_schema. `name` and `description` label the schema (as its own
    `title` and `description` annotations do); the schema itself is what is enforced."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(None, max_length=8192)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> _ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


# vLLM's structured_outputs: exactly one of these keys; its others (grammar, structural_tag,
# whitespace_pattern, disable_*...) ask for what Weir does not enforce and are refused by name.
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "json_object")


class _StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: _FunctionDef


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)


class _NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: _FunctionName


class _Body(BaseModel):
    """Fields common to both endpoints. `top_k`, `ignore_eos`, `structured_outputs` and
    `timeout_s` are Weir extensions (the first three as in vLLM's OpenAI server)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=128)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: LogitBias | None = None
    ignore_eos: bool | None = Field(None, description="Keep generating past end-of-sequence until max_tokens.")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    n: int | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description=f"Choices to generate, at most {MAX_N}: each is a sibling request with its own seed.",
    )
    user: str | None = Field(
        None,
        max_length=256,
        description="Sticks the request to one version under a traffic "
        'policy (docs/design.md, "Traffic policies"); recorded in the request.',
    )
    timeout_s: float | None = Field(None, ge=0.001, description="Seconds; a deadline is in whole milliseconds.")
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's extension: constrain the output to one of json (a schema), regex, choice or json_object.",
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    def refuse_unsupported(self) -> None:
        """Raise BodyError(unsupported_parameter) for the first UNSUPPORTED parameter set to
        something other than a neutral value."""
        for name, (neutral, why) in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if not any(value == ok and type(value) is type(ok) for ok in neutral):
                raise BodyError(f"{name}: {why}", param=name, code="unsupported_parameter")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_fields(self) -> dict[str, Any]:
        """The GenerateRequest sampling fields of this body, OpenAI's defaults where it sets none."""
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": self.logit_bias or None,
            "stop": self.stop_list,
            "seed": self.seed,
            "ignore_eos": bool(self.ignore_eos),
        }

    @property
    def num_choices(self) -> int:
        """The choices the response holds (n)."""
        return self.n or 1

    @property
    def num_siblings(self) -> int:
        """The sibling requests generated for it: best_of on /v1/completions, else n (times the
        prompts of a /v1/completions body)."""
        return self.num_choices

    @property
    def num_prompts(self) -> int:
        return 1

    @property
    def num_results(self) -> int:
        """The choices the response holds: n for each prompt."""
        return self.num_choices * self.num_prompts

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """GenerateRequest.prompt_logprobs (None: not asked)."""
        return None

    @property
    def top_logprobs_asked(self) -> int | None:
        """GenerateRequest.logprobs: the alternatives per token asked for, None when no logprobs are."""
        return None

    def choice_fields(self) -> dict[str, Any]:
        """The GenerateRequest fields of the choice parameters (logprobs; suffix on completions)."""
        return {"logprobs": self.top_logprobs_asked}

    def check_choices(self) -> None:
        """BodyError for choice parameters that contradict each other."""

    def structured_fields(self) -> dict[str, Any]:
        """The GenerateRequest's `structured`, from `structured_outputs`; BodyError for a
        constraint Weir cannot enforce (docs/design.md, "Structured output...": refuse, never relax)."""
        return {"structured": structured_outputs_spec(self.structured_outputs)}

    def tool_fields(self) -> dict[str, Any]:
        """The GenerateRequest's tool fields: none on /v1/completions (tools need messages)."""
        return {}


class ChatCompletionBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[_Message] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    metadata: dict[str, str] | None = Field(None, max_length=16, description=_UNUSED)
    safety_identifier: str | None = Field(None, max_length=256, description=_UNUSED)
    prompt_cache_key: str | None = Field(None, max_length=1024, description=_UNUSED)
    logprobs: bool | None = Field(None, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: this many most likely alternatives per token."
    )
    tools: list[_Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = _REFUSED
    function_call: Any = _REFUSED
    response_format: _ResponseFormat | None = None
    modalities: Any = _REFUSED
    audio: Any = _REFUSED
    prediction: Any = _REFUSED
    reasoning_effort: Any = _REFUSED
    verbosity: Any = _REFUSED
    web_search_options: Any = _REFUSED
    store: Any = _REFUSED
    service_tier: Any = _REFUSED

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for i, message in enumerate(self.messages):
            if message.name is not None:
                raise BodyError(
                    "participant names are not supported", param=f"messages.{i}.name", code="unsupported_parameter"
                )
        self._check_tool_turns()

    def _check_tool_turns(self) -> None:
        """As OpenAI: a tool message answers a call an earlier assistant message made (its
        tool_call_id is one of theirs); one that answers nothing is refused, not passed on."""
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            called.update(call.id for call in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id not in called:
                raise BodyError(
                    f"messages with role 'tool' must be a response to a preceding message with "
                    f"'tool_calls'; no earlier call has the id {message.tool_call_id!r}",
                    param=f"messages.{i}.tool_call_id",
                    code="invalid_value",
                )

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, or max_tokens (its deprecated name); None when neither is set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_choices(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:  # as OpenAI
            raise BodyError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")

    def structured_fields(self) -> dict[str, Any]:
        """`structured` from response_format or structured_outputs; both at once is refused."""
        fmt = response_format_spec(self.response_format)
        if fmt is not None and self.structured_outputs is not None:
            raise BodyError(
                "structured_outputs and a response_format other than text are exclusive",
                param="structured_outputs",
                code="invalid_value",
            )
        return {"structured": fmt} if fmt is not None else super().structured_fields()

    def tool_fields(self) -> dict[str, Any]:
        """`tools`, `tool_choice` and `parallel_tool_calls` (docs/design.md, "Structured
        output...": required and a named function constrain the output, so their parameter
        schemas are checked as a structured constraint is; `auto` does not constrain, so its
        schemas only describe the functions to the model and any object schema is accepted, but a
        `strict: true` it could not keep is refused)."""
        tools = self.tools or []
        if not tools:
            for param in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, param) not in (None, "none"):
                    raise BodyError(f"{param} is only allowed when tools are given", param=param, code="invalid_value")
            return {}
        names = [tool.function.name for tool in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise BodyError(
                    f"function names in tools must be unique; {name!r} is given twice",
                    param=f"tools.{i}.function.name",
                    code="invalid_value",
                )
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, _NamedToolChoice) else None
        if named is not None and named not in names:
            raise BodyError(
                f"tool_choice names the function {named!r}, which is not in tools",
                param="tool_choice.function.name",
                code="invalid_value",
            )
        constrained = set(names) if choice == "required" else {named} if named else set()
        if choice != "none" and (self.response_format_is_constraint or self.structured_outputs is not None):
            # the output is either a call or the constrained text, never both (docs/design.md, "Structured output...")
            param = "response_format" if self.response_format_is_constraint else "structured_outputs"
            raise BodyError(
                f'{param} and tools the model may call are exclusive (tool_choice "none" keeps the tools out of reach)',
                param=param,
                code="invalid_value",
            )
        wire_tools = [ToolDef.model_validate(tool.model_dump()) for tool in tools]
        if (problem := tools_problem(wire_tools)) is not None:
            param = f"tools.{problem[0]}.function.parameters"
            raise BodyError(f"{param}: {problem[1]}", param=param, code="invalid_value")
        is_parsed = choice in (None, "auto")  # calls the model makes in its own format, unconstrained
        for i, tool in enumerate(tools):
            _check_tool(i, tool, is_constraint=tool.function.name in constrained, is_parsed=is_parsed)
        wire_choice: ToolChoice | None = (
            NamedToolChoice.model_validate({"function": {"name": named}}) if named else choice  # type: ignore[assignment]  # named is set only for a _NamedToolChoice
        )
        return {
            "tools": wire_tools,
            "tool_choice": wire_choice,
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
        }

    @property
    def response_format_is_constraint(self) -> bool:
        return self.response_format is not None and self.response_format.type != "text"


Prompt = str | list[int]  # one prompt: its text, or the model's token ids (vLLM, lm-eval)
MAX_TOKEN_ID = 2**31  # token ids are below this (int32, as tokenizers and the engine hold them)
MAX_PROMPTS = 64  # prompts one /v1/completions body may batch (each is a request of its own, times n)


class CompletionBody(_Body):
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of token ids or a list
    of lists of token ids, as OpenAI's (and vLLM's): several prompts are sibling requests, their
    choices indexed in prompt order x n."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(
        None,
        ge=0,
        le=32768,
        description="0 (with echo) generates nothing: the echoed prompt, and its logprobs when asked, are the answer.",
    )
    best_of: int | None = Field(
        None, ge=1, le=MAX_N, description="Generate this many and return the n with the highest cumulative logprob."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description="Return each output token's logprob and this many most likely alternatives.",
    )
    echo: bool | None = Field(None, description="Put the prompt before each choice's text.")
    suffix: str | None = Field(
        None, description="Text after the completion (fill-in-the-middle); models with FIM tokens only."
    )

    @property
    def max_new_tokens(self) -> int | None:
        """max_tokens; None when not set."""
        return self.max_tokens

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts, in order: a string or a list of token ids each."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]  # all() does not narrow the element type
        return list(self.prompt)  # type: ignore[arg-type]  # all() does not narrow the element type

    @property
    def has_token_prompts(self) -> bool:
        return any(not isinstance(p, str) for p in self.prompts)

    @property
    def num_siblings_per_prompt(self) -> int:
        """The sibling requests of one prompt: best_of, else n."""
        return self.best_of or self.num_choices

    @property
    def num_siblings(self) -> int:
        return self.num_siblings_per_prompt * len(self.prompts)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """GenerateRequest.prompt_logprobs: echo with logprobs (lm-eval's loglikelihood) asks the
        prompt's own logprobs; so does echo of token ids (their text comes back with them) and
        max_tokens 0 (the prefill is the whole answer)."""
        if not self.echo:
            return None
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.has_token_prompts or self.max_tokens == 0 else None

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def choice_fields(self) -> dict[str, Any]:
        return {
            **super().choice_fields(),
            "suffix": self.suffix or None,  # "" asks for nothing
            "prompt_logprobs": self.prompt_logprobs_asked,
        }

    def check_choices(self) -> None:
        if self.best_of is not None and self.best_of < self.num_choices:  # as OpenAI
            raise BodyError(f"best_of must be at least n ({self.num_choices})", param="best_of", code="invalid_value")
        prompts = self.prompts
        if not prompts or any(len(p) == 0 for p in prompts if not isinstance(p, str)):
            raise BodyError(
                "prompt must be a string, or a non-empty list of strings or of token ids",
                param="prompt",
                code="invalid_value",
            )
        if len(prompts) > MAX_PROMPTS:
            raise BodyError(
                f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} are served per request",
                param="prompt",
                code="invalid_value",
            )
        if any(i < 0 for p in prompts if not isinstance(p, str) for i in p):
            raise BodyError("token ids must not be negative", param="prompt", code="invalid_value")
        # No vocabulary is near 2^31 ids; the model's own bound is checked where its tokenizer is (a larger
        # number would not even fit the tokenizer's integer type).
        if any(i >= MAX_TOKEN_ID for p in prompts if not isinstance(p, str) for i in p):
            raise BodyError(f"token ids must be below {MAX_TOKEN_ID}", param="prompt", code="invalid_value")
        if self.num_siblings_per_prompt > self.num_choices and len(prompts) > 1:
            raise BodyError(
                "best_of greater than n is served for one prompt at a time",
                param="best_of",
                code="unsupported_parameter",
            )
        if self.num_siblings > MAX_N * 8:
            raise BodyError(
                f"prompts x n (or best_of) is {self.num_siblings}; at most {MAX_N * 8} generations are "
                "served per request",
                param="prompt",
                code="invalid_value",
            )
        if self.stream and self.num_siblings_per_prompt > self.num_choices:  # as OpenAI: the best is known at the end
            raise BodyError("best_of greater than n cannot be streamed", param="best_of", code="invalid_value")
        if self.max_tokens == 0 and not self.echo:
            raise BodyError(
                "max_tokens 0 generates nothing; it is served with echo (the prompt, and its logprobs, are the answer)",
                param="max_tokens",
                code="invalid_value",
            )
        if self.suffix and self.has_token_prompts:
            raise BodyError("suffix needs a prompt of text", param="suffix", code="unsupported_parameter")
        if self.stream and self.echo and len(prompts) > 1:
            raise BodyError(
                "echo of several prompts is served with stream false", param="stream", code="unsupported_parameter"
            )
        if self.stream and self.prompt_logprobs_asked is not None:  # they come with the end, not the first chunk
            raise BodyError(
                "echo with logprobs, of token ids or with max_tokens 0 is served with stream false",
                param="stream",
                code="unsupported_parameter",
            )


def parse_body(kind: Kind, raw: bytes | str) -> ChatCompletionBody | CompletionBody:
    """Validate a raw JSON body for `kind`; raises BodyError naming the first bad parameter."""
    model = ChatCompletionBody if kind == "chat.completions" else CompletionBody
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise body_error(exc) from None
    body.refuse_unsupported()
    body.check_choices()
    body.structured_fields()  # refused at once (and on a batch file's upload), not when it is sent
    body.tool_fields()
    return body


def response_format_spec(fmt: _ResponseFormat | None) -> StructuredOutputs | None:
    """The constraint of OpenAI's response_format (None for text); BodyError naming
    response_format.json_schema.schema for a schema Weir cannot enforce."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    assert fmt.json_schema is not None  # the model's validator
    spec = StructuredOutputs(json_schema=fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))
    return _checked(spec, "response_format.json_schema.schema")


def structured_outputs_spec(raw: dict[str, Any] | None) -> StructuredOutputs | None:
    """The constraint of vLLM's structured_outputs (exactly one of json, regex, choice and
    json_object; `json` a schema object or its JSON text); BodyError naming the key at fault."""
    if raw is None:
        return None
    for key in raw:
        if key not in STRUCTURED_OUTPUT_KEYS:
            raise BodyError(
                f"structured_outputs.{key} is not supported (supported: {', '.join(STRUCTURED_OUTPUT_KEYS)})",
                param=f"structured_outputs.{key}",
                code="unsupported_parameter",
            )
    try:
        given = _StructuredOutputs.model_validate(raw)
    except ValidationError as exc:
        raise body_error(exc, prefix=("structured_outputs",)) from None
    if sum([given.json_ is not None, given.regex is not None, given.choice is not None, bool(given.json_object)]) != 1:
        raise BodyError(
            f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}",
            param="structured_outputs",
            code="invalid_value",
        )
    schema = given.json_
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise BodyError(
                f"structured_outputs.json is not valid JSON: {exc}",
                param="structured_outputs.json",
                code="invalid_value",
            ) from None
        if not isinstance(schema, dict):
            raise BodyError(
                "structured_outputs.json must be a JSON Schema object",
                param="structured_outputs.json",
                code="invalid_value",
            )
    try:
        spec = StructuredOutputs(
            json_schema=schema, regex=given.regex, choice=given.choice, json_object=bool(given.json_object)
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]  # a limit of schemas/messages.py (MAX_REGEX_CHARS, MAX_CHOICES...)
        param = ".".join(["structured_outputs", *({"json_schema": "json"}.get(str(p), str(p)) for p in first["loc"])])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise BodyError(f"invalid value for {param!r}: {message}", param=param, code="invalid_value") from None
    return _checked(spec, "structured_outputs.json")


def _check_tool(i: int, tool: _Tool, *, is_constraint: bool, is_parsed: bool) -> None:
    """A tool whose call constrains the output has a schema Weir enforces; one the model may call
    unconstrained (auto) may not ask for `strict`, a promise Weir could not keep for it."""
    function = tool.function
    if is_constraint and function.parameters is not None:
        spec = StructuredOutputs(json_schema=function.parameters, strict=bool(function.strict))
        _checked(spec, f"tools.{i}.function.parameters")
    elif function.strict and is_parsed:
        raise BodyError(
            'strict is enforced only when tool_choice is "required" or names this function; with '
            '"auto" the model\'s calls are parsed, not constrained',
            param=f"tools.{i}.function.strict",
            code="unsupported_parameter",
        )


def _checked(spec: StructuredOutputs, param: str) -> StructuredOutputs:
    try:
        check_structured(spec)
    except UnsupportedSchema as exc:
        raise BodyError(f"{param}: {exc}", param=param, code="unsupported_schema") from None
    return spec


# Union members add their type name to an error's location (e.g. stop.str): not part of the path.
_UNION_MEMBERS = {
    "str",
    "list[str]",
    "list[_TextPart]",
    "bool",
    "int",
    "dict[str,str]",
    "dict[str,any]",
    "literal['none','auto','required']",
    "_NamedToolChoice",
}


def body_error(exc: ValidationError, prefix: tuple[str, ...] = ()) -> BodyError:
    """The BodyError of a pydantic ValidationError of a request body (or of the part of it at
    `prefix`): names the parameter and the problem."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return BodyError(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    loc = [*prefix, *(str(part) for part in first["loc"] if str(part) not in _UNION_MEMBERS)]
    param = ".".join(loc) or None
    if first["type"] == "model_type" and not loc:
        return BodyError("the request body must be a JSON object", code="invalid_body")
    if first["type"] == "missing":
        return BodyError(f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return BodyError(f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if param in {"n", "best_of"} and first["type"] == "less_than_equal":
        return BodyError(
            f"{param} may be at most {MAX_N}: each choice is a whole generation, and Weir bounds them per request",
            param=param,
            code="invalid_value",
        )
    message = str(first["msg"]).removeprefix("Value error, ")
    return BodyError(f"invalid value for {param!r}: {message}", param=param, code="invalid_value")


def sibling_requests(request: GenerateRequest, num: int) -> list[GenerateRequest]:
    """The `num` sibling requests of a body asking for n (or best_of) > 1: ids `<request_id>/<i>`,
    seeds sibling_seed(the request's effective seed, i) (docs/design.md, "n and best_of are sibling
    requests"). The parent has no record of its own; its effective seed is derived from its
    request_id when the body gave none, as GenerateRequest.effective_seed does, so a rerun of
    the siblings gives the same texts. One request is itself. The gateway and the batch runner both use it."""
    if num == 1:
        return [request]
    seed = request.effective_seed
    return [
        request.model_copy(update={"request_id": f"{request.request_id}/{i}", "seed": sibling_seed(seed, i)})
        for i in range(num)
    ]


# ---------------------------------------------------------------------------------------------
# Responses: what the gateway and the batch runner answer alike


def assistant_message(text: str, tool_calls: list[ToolCall] | None) -> dict[str, Any]:
    """A chat.completion's message: the text, and the tool calls the model made in OpenAI's
    format; content is null when the reply is only calls, as OpenAI's is."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = [call.model_dump(mode="json") for call in tool_calls]
    return message


def finish_reason(end: ReplyEnd) -> str:
    """OpenAI's finish_reason of a finished reply: "tool_calls" when the model stopped after
    calling tools, else the worker's (a call cut short by max_tokens stays "length")."""
    return "tool_calls" if end.finish_reason == "stop" and end.tool_calls else end.finish_reason
