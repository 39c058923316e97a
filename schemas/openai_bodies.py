"""The OpenAI request bodies Weir serves, /v1/chat/completions and /v1/completions: as the gateway
receives them over HTTP and as the batch job runner reads them from the lines of an input file,
so both accept and refuse the same things.

Pure. Bodies are validated strictly from raw JSON (a string where a number belongs is an error,
as with OpenAI). Every parameter of OpenAI's API is honoured; or refused with
`unsupported_parameter` when it asks for something Weir cannot do (UNSUPPORTED: tools,
structured output, ...); or, for the few that cannot change the output (`user`, `metadata`,
`safety_identifier`, `prompt_cache_key`), accepted by design and not used. A parameter OpenAI
does not have is refused with `unknown_parameter`, as OpenAI does: nothing is silently ignored.

n (and best_of) > 1 become sibling requests (sibling_requests; docs/design.md, "n and best_of are
sibling requests"); logprobs become GenerateRequest.logprobs; echo is the edge's to render.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas.messages import MAX_PENALTY, MAX_TOP_LOGPROBS, ChatMessage, GenerateRequest, LogitBias, sibling_seed

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
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "parallel_tool_calls": ((None,), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "response_format": ((None, {"type": "text"}), 'structured output is not supported; only {"type": "text"}'),
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


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]
    name: str | None = Field(None, description="Not supported: participant names are refused.")

    @field_validator("content", mode="before")
    @classmethod
    def _content_given(cls, value: Any) -> Any:
        # OpenAI allows null content only for an assistant message with tool_calls, which Weir
        # does not serve (tools are refused): every message carries its text.
        if value is None:
            raise ValueError("content must be a string or a list of text parts, not null")
        return value

    def to_wire(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=text)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Body(BaseModel):
    """Fields common to both endpoints. `top_k`, `ignore_eos` and `timeout_s` are Weir extensions
    (`top_k` and `ignore_eos` as in vLLM's OpenAI server)."""

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
    n: int | None = Field(None, ge=1, le=MAX_N, description=f"Choices to generate, at most {MAX_N}: "
                          "each is a sibling request with its own seed.")
    user: str | None = Field(None, max_length=256, description="Sticks the request to one version under a traffic "
                             "policy (docs/design.md, \"Traffic policies\"); recorded in the request.")
    timeout_s: float | None = Field(None, ge=0.001, description="Seconds; a deadline is in whole milliseconds.")

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
        """The sibling requests generated for it: best_of on /v1/completions, else n."""
        return self.num_choices

    @property
    def top_logprobs_asked(self) -> int | None:
        """GenerateRequest.logprobs: the alternatives per token asked for, None when no logprobs are."""
        return None

    def choice_fields(self) -> dict[str, Any]:
        """The GenerateRequest fields of the choice parameters (logprobs; suffix on completions)."""
        return {"logprobs": self.top_logprobs_asked}

    def check_choices(self) -> None:
        """BodyError for choice parameters that contradict each other."""


class ChatCompletionBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[_Message] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    metadata: dict[str, str] | None = Field(None, max_length=16, description=_UNUSED)
    safety_identifier: str | None = Field(None, max_length=256, description=_UNUSED)
    prompt_cache_key: str | None = Field(None, max_length=1024, description=_UNUSED)
    logprobs: bool | None = Field(None, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: this many most "
                                     "likely alternatives per token.")
    tools: Any = _REFUSED
    tool_choice: Any = _REFUSED
    parallel_tool_calls: Any = _REFUSED
    functions: Any = _REFUSED
    function_call: Any = _REFUSED
    response_format: Any = _REFUSED
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
                raise BodyError("participant names are not supported", param=f"messages.{i}.name",
                                code="unsupported_parameter")  # fmt: skip

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


class CompletionBody(_Body):
    """POST /v1/completions. Only a single string prompt is served."""

    prompt: str
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Generate this many and return the n with "
                                "the highest cumulative logprob.")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="Return each output token's "
                                 "logprob and this many most likely alternatives.")
    echo: bool | None = Field(None, description="Put the prompt before each choice's text.")
    suffix: str | None = Field(None, description="Text after the completion (fill-in-the-middle); models with FIM "
                               "tokens only.")

    @property
    def max_new_tokens(self) -> int | None:
        """max_tokens; None when not set."""
        return self.max_tokens

    @property
    def num_siblings(self) -> int:
        return self.best_of or self.num_choices

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def choice_fields(self) -> dict[str, Any]:
        return {**super().choice_fields(), "suffix": self.suffix or None}  # "" asks for nothing

    def check_choices(self) -> None:
        if self.best_of is not None and self.best_of < self.num_choices:  # as OpenAI
            raise BodyError(f"best_of must be at least n ({self.num_choices})", param="best_of", code="invalid_value")
        if self.stream and self.num_siblings > self.num_choices:  # as OpenAI: the best is known only at the end
            raise BodyError("best_of greater than n cannot be streamed", param="best_of", code="invalid_value")
        if self.echo and self.logprobs is not None:
            raise BodyError("echo with logprobs needs the prompt's logprobs, which Weir does not compute",
                            param="echo", code="unsupported_parameter")  # fmt: skip


def parse_body(kind: Kind, raw: bytes | str) -> ChatCompletionBody | CompletionBody:
    """Validate a raw JSON body for `kind`; raises BodyError naming the first bad parameter."""
    model = ChatCompletionBody if kind == "chat.completions" else CompletionBody
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise body_error(exc) from None
    body.refuse_unsupported()
    body.check_choices()
    return body


# Union members add their type name to an error's location (e.g. stop.str): not part of the path.
_UNION_MEMBERS = {"str", "list[str]", "list[_TextPart]", "bool", "int", "dict[str,str]"}


def body_error(exc: ValidationError) -> BodyError:
    """The BodyError of a pydantic ValidationError of a request body: names the parameter and the problem."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return BodyError(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    loc = [str(part) for part in first["loc"] if str(part) not in _UNION_MEMBERS]
    param = ".".join(loc) or None
    if first["type"] == "model_type" and not loc:
        return BodyError("the request body must be a JSON object", code="invalid_body")
    if first["type"] == "missing":
        return BodyError(f"missing required parameter: {param!r}", param=param, code="missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return BodyError(f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if param in {"n", "best_of"} and first["type"] == "less_than_equal":
        return BodyError(f"{param} may be at most {MAX_N}: each choice is a whole generation, and Weir bounds "
                         "them per request", param=param, code="invalid_value")  # fmt: skip
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
    return [request.model_copy(update={"request_id": f"{request.request_id}/{i}", "seed": sibling_seed(seed, i)})
            for i in range(num)]  # fmt: skip
