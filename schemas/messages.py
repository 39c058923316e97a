"""Wire types of Weir: every message that crosses Kafka.

Each message carries `schema_version`, its correlation ids (request_id, and batch_id where there
is one) and epoch-millisecond timestamps (`*_ms`) that latencies are computed from. These types are
the public contract: any Kafka client may produce a GenerateRequest or an EmbedRequest and read
the ReplyEvents from the reply topic it named. Services convert them to their own state at their
edges.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, model_validator

from schemas.traffic import Assignment

SCHEMA_VERSION = 1

Priority = Literal["interactive", "bulk"]
FinishReason = Literal["stop", "length", "cancelled", "timeout", "rejected", "error"]
CancelReason = Literal["client_disconnect", "user", "deadline", "shutdown"]
CredentialKind = Literal["key", "jwt", "open"]  # an owner's kind of credential (docs/design.md, "Ownership")

# Most texts in one EmbedRequest. Its ReplyEnd carries one vector per text and must stay below
# Kafka's 1 MiB record limit: 128 x 384 floats of ~12 JSON bytes is ~600 KB. The gateway splits
# longer OpenAI inputs (up to 2048) into several EmbedRequests.
MAX_EMBED_INPUTS = 128

# OpenAI's limits: penalties in [-2, 2]; at most 300 logit_bias entries, each in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")


def _check_logit_bias(bias: dict[str, float]) -> dict[str, float]:
    """Keys are token ids written as decimal strings (JSON object keys), values within +-100."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise ValueError(f'key {key!r} is not a token id (a decimal integer such as "1234")')
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"the bias of token {key} is {value:g}; biases lie in [-100, 100]")
    return bias


LogitBias = Annotated[
    dict[str, float],
    AfterValidator(_check_logit_bias),
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
            "propertyNames": {"pattern": f"^({_TOKEN_ID.pattern})$"},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        }
    ),
]
"""OpenAI's logit_bias: token id (a decimal string, as JSON keys are) -> bias added to its logit."""


def now_ms() -> int:
    """Wall-clock time in epoch milliseconds, the unit of every `*_ms` field."""
    return int(time.time() * 1000)


_MIN_INT, _MAX_INT = -(2**63), 2**64 - 1


class _Wire(BaseModel):
    """Base of wire types: unknown fields are refused so a typo is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = Field(SCHEMA_VERSION, description="Wire schema version of this message.")

    @model_validator(mode="after")
    def _ints_fit_a_record(self) -> _Wire:
        # JSON has no integer bound, but a record is written again by whoever read it (orjson
        # encodes 64-bit integers only): one out of that range, read from Kafka and re-encoded,
        # would crash its reader on every restart (docs/design.md, invariant 6).
        for name, value in self.__dict__.items():
            if type(value) is int and not _MIN_INT <= value <= _MAX_INT:
                raise ValueError(f"{name} is {value}, outside the 64-bit range a record may carry")
        return self


# -- tools (docs/design.md, "Structured output, tools and logprobs") ------------------------------

MAX_TOOLS = 128
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class ToolFunction(BaseModel):
    """A function the model may call: OpenAI's `tools[].function`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN, description="The function's name.")
    description: str | None = Field(None, max_length=8192, description="What it does, for the model.")
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of its arguments (an object schema); absent: no arguments."
    )
    strict: bool | None = Field(None, description="OpenAI's strict: the schema must follow strict mode's rules.")


class ToolDef(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = Field("function", description="Only functions are tools.")
    function: ToolFunction


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: the model must call it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: _NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, a JSON object as text (as OpenAI returns them).")


class ToolCall(BaseModel):
    """A call the model made: OpenAI's `tool_calls[]` of an assistant message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=128, description="The call's id; a `tool` message answers it.")
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(BaseModel):
    """A piece of a tool call in a stream, as OpenAI streams them: the first piece of call `index`
    carries its id and name, later pieces add to its arguments text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, description="Which call of this reply (0, 1, ...).")
    id: str | None = Field(None, description="Set on the call's first piece.")
    name: str | None = Field(None, description="Set on the call's first piece.")
    arguments: str = Field("", description="Text appended to the call's arguments.")


class ChatMessage(BaseModel):
    """One chat turn, as in OpenAI's chat completions.

    An assistant turn that called tools carries `tool_calls` (its content may be empty); a `tool`
    turn answers one call, naming it in `tool_call_id`. The model's chat template renders them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"] = Field(description="Who speaks this turn.")
    content: str = Field(description='The text of the turn ("" for an assistant turn with only tool calls).')
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="assistant: the calls it made.")
    tool_call_id: str | None = Field(None, max_length=128, description="tool: the call this answers.")
    name: str | None = Field(None, max_length=64, description="tool: the function whose result this is.")

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, names its tool_call_id")
        return self


# -- structured output ---------------------------------------------------------------------------

MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema's size as compact JSON
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class StructuredOutputs(BaseModel):
    """A constraint on the generated text, enforced token by token (vLLM's `structured_outputs`).

    Exactly one of `json_schema`, `json_object`, `regex` and `choice` is set. `json_schema` is a JSON Schema the
    text must be an instance of; `json_object` any JSON object; `regex` a regular expression the
    whole text matches; `choice` one of the strings, exactly. A schema with a keyword Weir cannot
    enforce is refused (schemas/structured.py), never served unconstrained.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | None = Field(None, description="JSON Schema of the output (vLLM's `json`).")
    json_object: bool = Field(False, description="Any JSON object.")
    regex: str | None = Field(
        None, min_length=1, max_length=MAX_REGEX_CHARS, description="Pattern the whole output matches."
    )
    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES, description="The output is exactly one of these."
    )
    strict: bool = Field(False, description="json_schema: it follows OpenAI's strict rules (checked, not relaxed).")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None]
        if sum(given) != 1:
            raise ValueError("exactly one of json_schema, json_object, regex and choice must be set")
        return self


# -- logprobs ------------------------------------------------------------------------------------

MAX_TOP_LOGPROBS = 20


class TopLogprob(BaseModel):
    """A token and its log-probability under the model's raw distribution (before penalties,
    temperature, truncation and any grammar mask; vLLM's `raw_logprobs`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_id: int = Field(ge=0)
    token: str = Field(description="The token's text (invalid UTF-8 pieces as U+FFFD).")
    bytes: list[int] = Field(description="The token's exact UTF-8 bytes.")
    logprob: float = Field(le=0.0, allow_inf_nan=False)


class TokenLogprob(TopLogprob):
    """One generated token's logprob and the most likely alternatives at its step."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list, max_length=MAX_TOP_LOGPROBS)


class PromptLogprob(TopLogprob):
    """A prompt token and its log-probability given the tokens before it (None for the first
    token, which nothing predicts), with the most likely alternatives asked for."""

    logprob: float | None = Field(le=0.0, allow_inf_nan=False)  # type: ignore[assignment]  # widens TopLogprob's: the first token has none
    top_logprobs: list[TopLogprob] = Field(default_factory=list, max_length=MAX_TOP_LOGPROBS)


class GenerateRequest(_Wire):
    """A request for text generation, published to `weir.requests` keyed by request_id.

    Exactly one of `prompt` and `messages` is set. The request ends in exactly one terminal
    ReplyEnd on `reply_to`.
    """

    kind: Literal["generate"] = Field("generate", description="Message kind discriminator.")
    request_id: str = Field(min_length=1, max_length=128, description="Unique id; deduplicates redeliveries.")
    model: str = Field(
        min_length=1,
        max_length=193,
        description="Model name, or name@version to pin one version "
        '(a name has at most 128 characters, a version 64; docs/design.md, "The model registry").',
    )
    prompt: str | None = Field(None, description="Completion prompt (exclusive with messages and prompt_token_ids).")
    prompt_token_ids: list[int] | None = Field(
        None,
        min_length=1,
        max_length=1 << 17,
        description="A completion prompt given as the model's token ids (exclusive with prompt and messages).",
    )
    messages: list[ChatMessage] | None = Field(None, description="Chat turns (exclusive with prompt).")
    max_tokens: int = Field(
        64,
        ge=0,
        le=32768,
        description="Most tokens to generate; 0 (with prompt_logprobs "
        "only) generates none: the prompt's logprobs are the answer.",
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    presence_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="OpenAI's presence penalty: subtracted once from the logit of every token the output holds so far.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="OpenAI's frequency penalty: subtracted from a token's logit once per time the output holds it.",
    )
    logit_bias: LogitBias | None = Field(
        None,
        description="Token id (decimal string) -> bias in [-100, 100] added to its logit before sampling, at most "
        "300 entries; -100 bans a token, +100 all but forces it. Ids outside the model's vocabulary are rejected.",
    )
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop strings, not included in output.")
    seed: int | None = Field(
        None,
        ge=-(2**63),
        le=2**64 - 1,
        description="Sampling seed (-2^63 to 2^64-1, as the gateway takes it); derived from request_id when absent.",
    )
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence (benchmarks), as in vLLM.")
    structured: StructuredOutputs | None = Field(
        None,
        description="Constrain the output (JSON Schema, any JSON "
        "object, regex or choice); enforced by a token mask at every step.",
    )
    tools: list[ToolDef] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="Functions the model may call (messages only); the chat template renders them.",
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description="none, auto (the default with tools), required or a "
        "named function; required and named constrain the output to a call.",
    )
    parallel_tool_calls: bool = Field(True, description="With tool_choice required: more than one call may be made.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return each generated token's "
        "logprob and this many most likely alternatives (0: the token's only); None: none.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return the logprob of "
        "each prompt token after the first (computed in the prefill, which then "
        "reuses no prefix cache) and this many most likely alternatives; None: none.",
    )
    suffix: str | None = Field(
        None,
        max_length=1 << 20,
        description="prompt only: text after the insertion "
        "(fill-in-the-middle), for models whose tokenizer has FIM tokens; refused otherwise.",
    )
    stream: bool = Field(True, description="Whether the client streams; workers always send deltas.")
    principal: str = Field("anonymous", description="Who asked (API key owner or JWT subject).")
    tenant: str = Field("default", description="Tenant the principal belongs to.")
    priority: Priority = Field("interactive", description="Scheduling lane.")
    user: str | None = Field(
        None,
        max_length=256,
        description="OpenAI's `user`: the key that sticks a request to a "
        "version under a traffic policy (schemas/traffic.py), else the principal is.",
    )
    assignment: Assignment | None = Field(
        None,
        description="How its version was chosen: default, canary, pinned "
        "(model named name@version) or mirror (a shadow copy); set where it is resolved.",
    )
    shadow_of: str | None = Field(
        None,
        max_length=128,
        description="A mirror copy: the request_id of the live "
        "request it copies. Its answer goes to the comparison, never to a client.",
    )
    mirrors: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="The live request of mirror copies: "
        "the versions that got one. The worker publishes its answer (ShadowLive) for the comparison.",
    )
    deadline_ms: int = Field(description="Absolute deadline, epoch ms; expired work is dropped.")
    reply_to: str = Field(min_length=1, max_length=249, description="Topic that receives the ReplyEvents.")
    created_ms: int = Field(default_factory=now_ms, description="When the request was accepted, epoch ms.")

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids and messages must be set")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 generates nothing: only with prompt_logprobs")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat request)")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice other than none needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if not any(t.function.name == name for t in self.tools or []):
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        if self.structured is not None and self.tool_choice not in (None, "none"):
            raise ValueError("structured and a tool_choice that calls tools are exclusive")
        if self.suffix is not None and self.prompt is None:
            raise ValueError("suffix needs a prompt (a completion request)")
        return self

    @property
    def calls_tools(self) -> bool:
        """True when the model may call tools: tools given and tool_choice not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def effective_seed(self) -> int:
        """The seed sampling uses: the given one, or a stable hash of request_id.

        A stable seed makes a request regenerated after a crash produce the same tokens.
        """
        if self.seed is not None:
            return self.seed
        return int.from_bytes(hashlib.sha256(self.request_id.encode()).digest()[:8], "big") >> 1


def sibling_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request asked for n > 1 choices (or best_of): choice 0
    keeps the request's seed, each other its own, derived stably so a rerun gives the same n texts."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class EmbedRequest(_Wire):
    """A request for text embeddings, published to `weir.requests` keyed by request_id.

    The request ends in exactly one terminal ReplyEnd on `reply_to`, whose `embeddings` holds one
    L2-normalised vector per input, in input order. Inputs longer than the model's window are
    embedded in fragments and pooled.
    """

    # `kind` has a default for Python callers, but on the wire it is required: a request without
    # it is read as a GenerateRequest.
    model_config = ConfigDict(json_schema_extra=lambda schema: schema.setdefault("required", []).insert(0, "kind"))

    kind: Literal["embed"] = Field("embed", description="Message kind discriminator; required on the wire.")
    request_id: str = Field(min_length=1, max_length=128, description="Unique id; deduplicates redeliveries.")
    model: str = Field(
        min_length=1, max_length=193, description="Embedding model name, or name@version to pin one version."
    )
    inputs: list[str] = Field(min_length=1, max_length=MAX_EMBED_INPUTS, description="Texts to embed, in order.")
    principal: str = Field("anonymous", description="Who asked (API key owner or JWT subject).")
    tenant: str = Field("default", description="Tenant the principal belongs to.")
    priority: Priority = Field("interactive", description="Scheduling lane.")
    user: str | None = Field(
        None,
        max_length=256,
        description="OpenAI's `user`: the key that sticks a request to a "
        "version under a traffic policy (schemas/traffic.py), else the principal is.",
    )
    assignment: Assignment | None = Field(
        None,
        description="How its version was chosen: default, canary, pinned "
        "(model named name@version) or mirror (a shadow copy); set where it is resolved.",
    )
    shadow_of: str | None = Field(
        None,
        max_length=128,
        description="A mirror copy: the request_id of the live "
        "request it copies. Its answer goes to the comparison, never to a client.",
    )
    mirrors: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="The live request of mirror copies: "
        "the versions that got one. The worker publishes its answer (ShadowLive) for the comparison.",
    )
    deadline_ms: int = Field(description="Absolute deadline, epoch ms; expired work is dropped.")
    reply_to: str = Field(min_length=1, max_length=249, description="Topic that receives the ReplyEnd.")
    created_ms: int = Field(default_factory=now_ms, description="When the request was accepted, epoch ms.")


def _request_kind(value: Any) -> str:
    # A GenerateRequest may omit `kind` (it was optional before EmbedRequest existed).
    if isinstance(value, dict):
        return str(value.get("kind", "generate"))
    return str(getattr(value, "kind", "generate"))


AnyRequest = Annotated[
    Annotated[GenerateRequest, Tag("generate")] | Annotated[EmbedRequest, Tag("embed")],
    Discriminator(_request_kind),
]
"""What `weir.requests` carries: a GenerateRequest or an EmbedRequest, told apart by `kind`."""


class Usage(BaseModel):
    """Token counts, as in OpenAI's usage object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(0, ge=0, description="Tokens in the prompt (all inputs, for embeddings).")
    completion_tokens: int = Field(0, ge=0, description="Tokens generated.")
    total_tokens: int = Field(0, ge=0, description="prompt_tokens + completion_tokens.")
    cached_prompt_tokens: int = Field(
        0,
        ge=0,
        description="Prompt tokens served from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens).",
    )


class ErrorInfo(BaseModel):
    """Why a request failed or was refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str = Field(description="Stable machine-readable code, e.g. 'prompt_too_long'.")
    message: str = Field(description="Human-readable explanation.")


class ReplyDelta(_Wire):
    """Generated output of one request, covering the positions [seq, seq + count) of its reply.

    A position is an output token: position i is the request's i-th generated token, with the
    text (and tool call pieces) its step released; text a step holds back (an incomplete UTF-8
    character, a possible stop string, a possible tool call) belongs to the later token whose step
    releases it. Text released only at the end, with no token of its own (held back until an
    end-of-sequence token, say), is one last position without a token, the tail. A worker may
    coalesce consecutive positions into one delta, and a regenerated request may coalesce them
    otherwise: a reader that holds positions up to k keeps only positions k.. of a delta that
    overlaps them (schemas/reply_stream.py: cut). A delta of one position (count 1, the default)
    is read whole, as deltas before coalescing were (docs/wire-contract.md).
    """

    type: Literal["delta"] = Field("delta", description="Event discriminator.")
    request_id: str = Field(description="The request this belongs to.")
    batch_id: str | None = Field(None, description="Batch that carried the request.")
    seq: int = Field(
        ge=0,
        description="Position of its first token (the index of that output token, from 0); "
        "repeats carry the same positions.",
    )
    count: int = Field(
        1,
        ge=1,
        description="Positions it covers, [seq, seq + count): its tokens, and the tail "
        "(the last position, with no token) when its token_ids has count - 1 entries.",
    )
    text: str = Field(description="Text added by this event (all its positions' text, in order).")
    texts: list[str] | None = Field(
        None,
        description="With count > 1: the text of each position, in order (they join to `text`); None with count 1.",
    )
    token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids behind the text; with count > 1, one per position, in order (none for a tail).",
    )
    logprobs: list[TokenLogprob] | None = Field(
        None, description="The request asked for logprobs: one per token of token_ids, in order."
    )
    tool_calls: list[ToolCallDelta] | None = Field(
        None,
        description="Pieces of tool calls, released by its last position; text a tool call is made of is "
        "not also in `text`.",
    )
    created_ms: int = Field(default_factory=now_ms, description="When the worker produced it, epoch ms.")

    @model_validator(mode="after")
    def _positions(self) -> ReplyDelta:
        if self.count == 1:
            if self.texts is not None:
                raise ValueError("texts: only a delta of several positions (count > 1) has it")
            return self
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs: {len(self.logprobs)} entries for {len(self.token_ids)} token_ids")
        if self.texts is None or len(self.texts) != self.count:
            raise ValueError(f"texts: a delta of {self.count} positions needs the text of each ({self.count} strings)")
        if "".join(self.texts) != self.text:
            raise ValueError("texts: they must join to text")
        if len(self.token_ids) not in (self.count, self.count - 1):
            raise ValueError(
                f"token_ids: a delta of {self.count} positions has one token per position "
                f"(a tail, last, has none), got {len(self.token_ids)}"
            )
        return self

    @property
    def end(self) -> int:
        """The position after its last: what a reader holds once it has this delta."""
        return self.seq + self.count


class ReplyEnd(_Wire):
    """The one terminal event of a request. Its `seq` is the position after the last delta's last
    (that delta's seq + count; 0 when no delta came): the same when a request is regenerated."""

    type: Literal["end"] = Field("end", description="Event discriminator.")
    request_id: str = Field(description="The request this ends.")
    batch_id: str | None = Field(None, description="Batch that carried the request, if it got one.")
    seq: int = Field(ge=0, description="The position after the last delta's last (its seq + count; 0: no delta).")
    finish_reason: FinishReason = Field(description="Why the request ended.")
    usage: Usage = Field(default_factory=lambda: Usage(), description="Token counts.")
    error: ErrorInfo | None = Field(None, description="Set when finish_reason is error/rejected/timeout.")
    model_version: str | None = Field(None, description="name@version of the model that served it.")
    received_ms: int | None = Field(None, description="When the worker received the request, epoch ms.")
    first_token_ms: int | None = Field(None, description="When the first token was produced, epoch ms.")
    embeddings: list[list[float]] | None = Field(
        None, description="EmbedRequest only: one L2-normalised vector per input, in input order."
    )
    cumulative_logprob: float | None = Field(
        None, allow_inf_nan=False, description="Sum of the raw logprobs of every generated token (ranks best_of)."
    )
    tool_calls: list[ToolCall] | None = Field(
        None, description="Every tool call the model made, complete (also streamed as ToolCallDelta pieces)."
    )
    prompt_logprobs: list[PromptLogprob] | None = Field(
        None,
        description="The request asked prompt_logprobs: one per prompt token, in order (the first's "
        "logprob null: nothing predicts it), each with its alternatives.",
    )
    structured_valid: bool | None = Field(
        None, description="A constrained request: whether the output is an instance of its constraint (None: none)."
    )
    created_ms: int = Field(default_factory=now_ms, description="When this event was produced, epoch ms.")


ReplyEvent = Annotated[ReplyDelta | ReplyEnd, Field(discriminator="type")]


class Cancellation(_Wire):
    """Cancel a request, on `weir.control` keyed by request_id."""

    kind: Literal["cancel"] = Field("cancel", description="Message kind discriminator.")
    request_id: str = Field(description="The request to cancel.")
    reason: CancelReason = Field("user", description="Why it is cancelled.")
    reply_to: str | None = Field(None, description="Reply topic of the request, when known.")
    created_ms: int = Field(default_factory=now_ms, description="When the cancel was issued, epoch ms.")


class Batch(_Wire):
    """A batch of requests for one model, from the batcher to `weir.batches.<model>`."""

    batch_id: str = Field(description="Unique batch id.")
    model: str = Field(description="The model version (name@version) all requests are for.")
    requests: list[AnyRequest] = Field(min_length=1, description="Requests, in scheduling order.")
    batcher_id: str = Field(description="Batcher instance that formed it.")
    created_ms: int = Field(default_factory=now_ms, description="When the batch closed, epoch ms.")


class DeviceInfo(BaseModel):
    """One compute device of a worker."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["cuda", "cpu"] = Field(description="Device kind.")
    name: str = Field(description="Device name, e.g. 'NVIDIA H200' or the CPU model.")
    memory_total_bytes: int = Field(0, ge=0, description="Device memory in bytes.")
    memory_free_bytes: int = Field(0, ge=0, description="Free device memory in bytes.")
    utilization_pct: float | None = Field(None, description="Compute utilisation, percent (NVML).")


class LatencyHistogram(BaseModel):
    """A latency histogram as Prometheus exposes one: cumulative counts per upper bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bounds: list[float] = Field(max_length=64, description="Upper bounds in seconds, ascending (+Inf implied last).")
    counts: list[int] = Field(
        max_length=65,
        description="Cumulative: observations at most each bound, then all "
        "of them (the +Inf bucket); one more entry than bounds, never decreasing.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LatencyHistogram:
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.counts)} counts for {len(self.bounds)} bounds: want one more (+Inf)")
        if any(b <= a for a, b in itertools.pairwise(self.bounds)):
            raise ValueError("bounds must ascend")
        if any(c < 0 for c in self.counts) or any(b < a for a, b in itertools.pairwise(self.counts)):
            raise ValueError("counts must be cumulative: >= 0 and never decreasing")
        return self


class VersionLatency(BaseModel):
    """One version's time to first token and inter-token latency on one worker since it was loaded:
    vLLM's vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds, of every request
    (streamed, plain, a Batch API job's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft: LatencyHistogram = Field(description="Receipt by the worker to the first token.")
    itl: LatencyHistogram = Field(description="Between consecutive output tokens.")


VersionState = Literal[
    "verifying",  # checking every file against the manifest
    "loading",  # building the engine
    "golden",  # running its golden requests
    "ready",  # serving: the batcher may route to it
    "draining",  # no new batches; finishing what runs, then unloaded
    "unhealthy",  # a golden check departed from the expected output: out of routing, being reloaded
    "failed",  # could not be verified or loaded (reason says why); requests for it are refused
    "refused",  # does not fit the worker's memory budget; the worker keeps serving what it has
]


class VersionStatus(BaseModel):
    """One version on one worker, as its heartbeat reports it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: VersionState
    reason: str | None = Field(None, max_length=2048, description="Why failed, refused or unhealthy.")
    digest: str = Field("", description="ModelManifest.digest() of the version loaded.")
    engine: str = Field(
        "",
        max_length=128,
        description="The runtime chosen for it, e.g. 'torch-cuda+triton', 'torch-cpu', 'onnxruntime-cpu'.",
    )
    budget_bytes: int = Field(0, ge=0, description="The memory slice it was given.")
    used_bytes: int = Field(0, ge=0, description="Memory it takes now (weights + KV cache).")
    golden_checked_ms: int | None = Field(None, description="When its goldens last ran, epoch ms.")


class WorkerHeartbeat(_Wire):
    """A worker's capacity, on the compacted `weir.workers` keyed by worker_id."""

    worker_id: str = Field(description="Worker instance id.")
    models: list[str] = Field(description="Models this worker serves.")
    is_ready: bool = Field(description="True once warmup has run.")
    num_running: int = Field(ge=0, description="Sequences in the decode loop.")
    num_waiting: int = Field(ge=0, description="Sequences queued in the worker.")
    max_num_seqs: int = Field(ge=1, description="Most sequences the worker runs at once.")
    free_kv_blocks: int = Field(ge=0, description="Free KV-cache blocks.")
    block_size_tokens: int = Field(ge=1, description="Tokens per KV-cache block.")
    kv_cache_usage_perc: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Share of KV-cache blocks in use (vLLM's kv_cache_usage_perc, 0..1); None: not reported.",
    )
    prefix_cache_queries: int = Field(0, ge=0, description="Prompt tokens looked up in the prefix cache since start.")
    prefix_cache_hits: int = Field(0, ge=0, description="Of those, tokens found cached since start.")
    partitions: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Per model, the partitions of its batch topic this worker owns now (its consumer group's "
        "assignment); the batcher routes batches to them.",
    )
    next_offsets: dict[str, dict[int, int]] = Field(
        default_factory=dict,
        description="Per model, per owned partition, the offset of the next batch the worker will read: batches "
        "below it are already counted in free_kv_blocks, so the batcher stops counting them against its room.",
    )
    devices: list[DeviceInfo] = Field(default_factory=list, description="Devices of the worker.")
    versions: dict[str, VersionStatus] = Field(
        default_factory=dict,
        description="Per model version (name@version) the worker holds or tried to: its state (only 'ready' ones "
        'are routed to), memory slice and reason (docs/design.md, "The model registry").',
    )
    finished_per_s: float | None = Field(
        None,
        ge=0,
        description="Requests this worker ended per second, averaged over its last minute (an exponentially "
        "weighted rate); the gateway's admission divides the queue ahead of a request by the fleet's sum of it "
        '(docs/design.md, "Scale-out and failover"). None: not measured yet.',
    )
    latency: dict[str, VersionLatency] = Field(
        default_factory=dict,
        description="Per model version it serves: its TTFT and inter-token histograms since loaded, every request "
        "(the gateway's dashboard shows them beside its own, which see no Batch API job). Empty: not reported.",
    )
    service_s: float | None = Field(
        None,
        gt=0,
        description="Mean seconds a request of this worker ran, from first scheduled to its end, weighted like "
        "finished_per_s; the gateway's admission takes K requests running at once to end K / service_s a second "
        "(Little's law), so a rate measured at a lower load does not stand for a burst's. None: none ended yet.",
    )
    sent_ms: int = Field(default_factory=now_ms, description="When it was sent, epoch ms.")


class StreamRecord(_Wire):
    """A resumable stream's durable entry, on the compacted `weir.streams` keyed by request_id.

    The gateway that accepts a streamed request with a resume grace writes it before it publishes
    the request; any gateway of the deployment reads the topic, so a client whose gateway died
    resumes through another (docs/design.md, "Scale-out and failover"). It holds no prompt text:
    only where the reply events are and what the stream's renderer needs. A later record with
    `ended_ms` marks the request ended; a tombstone (null value) forgets it.
    """

    kind: Literal["stream"] = Field("stream", description="Message kind discriminator.")
    request_id: str = Field(
        min_length=1,
        max_length=256,
        description="The stream's id (the request's, or the parent id of a body with n > 1).",
    )
    member_ids: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="The request ids whose events "
        "make the stream, in their kept order (one, or the siblings of n > 1).",
    )
    owner_tenant: str = Field(description='Owner: tenant (docs/design.md, "Ownership").')
    owner_credential: Literal["key", "jwt", "open"] = Field(description="Owner: kind of credential.")
    owner_principal: str = Field(description="Owner: principal.")
    gateway_id: str = Field(description="The gateway instance that accepted it.")
    reply_topic: str = Field(description="Where its ReplyDelta/ReplyEnd events are written (that gateway's).")
    reply_partition: int = Field(0, ge=0, description="The partition of reply_topic its events go to.")
    start_offset: int = Field(
        ge=0,
        description="An offset of reply_topic at or before its first event (read "
        "before the request was published): a reader starts there and filters by request id.",
    )
    grace_s: float = Field(gt=0, description="The resume grace it was asked with.")
    deadline_ms: int = Field(description="The request's absolute deadline, epoch ms.")
    render: dict[str, Any] = Field(
        default_factory=dict,
        description="What a gateway needs to render the stream "
        "again (endpoint, model as shown, created, options); never prompt text.",
    )
    created_ms: int = Field(default_factory=now_ms, description="When it was registered, epoch ms.")
    ended_ms: int | None = Field(None, description="When its terminal event was seen; None while it runs.")


class AuditEvent(_Wire):
    """What was served, with no raw text: keyed hashes only (docs/design.md, invariant 7)."""

    event_id: str = Field(description="Idempotency key: one record per event_id.")
    request_id: str = Field(description="The request audited.")
    model: str = Field(description="Model name.")
    model_version: str = Field(description="name@version.")
    weights_sha256: str = Field(description="sha256 of the weights file(s).")
    principal: str = Field(description="Who asked.")
    tenant: str = Field(description="Tenant.")
    prompt_hmac: str = Field(description="HMAC-SHA256 (hex) of the normalised prompt.")
    output_hmac: str = Field(description="HMAC-SHA256 (hex) of the normalised output.")
    hmac_key_id: str = Field(description="Which key made the HMACs.")
    temperature: float = Field(description="Sampling temperature.")
    top_p: float = Field(description="Nucleus mass.")
    top_k: int = Field(description="Top-k.")
    max_tokens: int = Field(description="Token limit.")
    seed: int = Field(description="Seed used.")
    prompt_tokens: int = Field(ge=0, description="Prompt tokens.")
    completion_tokens: int = Field(ge=0, description="Generated tokens.")
    cached_prompt_tokens: int | None = Field(
        None, ge=0, description="Prompt tokens served from the prefix cache; None: not reported."
    )
    finish_reason: FinishReason = Field(description="How it ended.")
    assignment: Assignment | None = Field(None, description="How its version was chosen (schemas/traffic.py).")
    shadow_of: str | None = Field(None, description="For a mirror copy: the live request it copies.")
    worker_id: str = Field(description="Worker that served it.")
    request_created_ms: int = Field(description="When the request was accepted, epoch ms.")
    received_ms: int = Field(description="When the worker received it, epoch ms.")
    first_token_ms: int | None = Field(None, description="First token, epoch ms.")
    finished_ms: int = Field(description="When it finished, epoch ms.")
    prompt_simhash: str | None = Field(
        None,
        pattern="^[0-9a-f]{16}$",
        description="64-bit SimHash (16 hex) of the prompt's embedding: near-identical texts differ in few bits.",
    )
    output_simhash: str | None = Field(
        None, pattern="^[0-9a-f]{16}$", description="64-bit SimHash (16 hex) of the output's embedding."
    )
    fingerprint_model: str | None = Field(
        None, description="Embedding model and projection the SimHashes were made with; None: no SimHash."
    )
    mean_token_entropy: float | None = Field(
        None, ge=0, description="Mean entropy (nats) of the sampling distribution over the generated tokens."
    )
    watermark_z: float | None = Field(
        None, description="z-score of the tenant's green-list watermark over the output tokens; None: not watermarked."
    )
    structured_valid: bool | None = Field(
        None,
        description="A constrained request: whether the output is an instance of its constraint (ReplyEnd's); "
        "None: unconstrained.",
    )
    params_sha256: str | None = Field(
        None,
        pattern="^[0-9a-f]{64}$",
        description="sha256 of the canonical JSON of the request's parameters that can change its text (not the "
        "prompt: prompt_hmac is); equal version, prompt, parameters and seed must give equal output_hmac.",
    )


class ReviewFlag(_Wire):
    """A principal flagged for human review by a gateway's input guard, on `weir.audit` keyed by principal.

    A gateway publishes one when a principal reaches its threshold of high-risk detections within
    `window_s` (e.g. 5 prompt-injection detections in an hour). Like AuditEvent it holds no raw
    text (docs/design.md, invariant 7): only counts, times and the names of the rules that fired.
    """

    # `kind` has a default for Python callers, but on the wire it is required: an audit record
    # without it is read as an AuditEvent.
    model_config = ConfigDict(json_schema_extra=lambda schema: schema.setdefault("required", []).insert(0, "kind"))

    kind: Literal["review_flag"] = Field("review_flag", description="Message kind discriminator; required on the wire.")
    flag_id: str = Field(min_length=1, max_length=128, description="Idempotency key: one ledger record per flag_id.")
    principal: str = Field(min_length=1, max_length=256, description="Who is flagged (API key owner or JWT subject).")
    tenant: str = Field(min_length=1, max_length=256, description="Tenant the principal belongs to.")
    reason: Literal["prompt_injection"] = Field(description="What the detections were of.")
    num_detections: int = Field(ge=1, description="High-risk detections of the principal within the window.")
    window_s: int = Field(ge=1, description="Length of the sliding window the detections were counted in, seconds.")
    first_detection_ms: int = Field(description="First detection counted, epoch ms.")
    last_detection_ms: int = Field(description="Last detection counted (the one that raised the flag), epoch ms.")
    rules: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Names of the detector rules that fired in the window (rule names, never prompt text).",
    )
    gateway_id: str = Field(min_length=1, description="Gateway instance that raised the flag.")
    created_ms: int = Field(default_factory=now_ms, description="When the flag was raised, epoch ms.")

    @model_validator(mode="after")
    def _ordered(self) -> ReviewFlag:
        if self.last_detection_ms < self.first_detection_ms:
            raise ValueError(f"{self.last_detection_ms=} must be >= {self.first_detection_ms=}")
        return self


def _audit_kind(value: Any) -> str:
    # AuditEvent has no `kind` field (its records predate ReviewFlag): absent means an AuditEvent.
    if isinstance(value, dict):
        return str(value.get("kind", "audit_event"))
    return str(getattr(value, "kind", "audit_event"))


AuditRecord = Annotated[
    Annotated[AuditEvent, Tag("audit_event")] | Annotated[ReviewFlag, Tag("review_flag")],
    Discriminator(_audit_kind),
]
"""What `weir.audit` carries: an AuditEvent (no `kind`) or a ReviewFlag (`"kind": "review_flag"`)."""


_HASH = r"^[0-9a-f]{64}$"


class AuditAnchor(_Wire):
    """A keyed checkpoint of one chain of the audit ledger, on `weir.audit.anchors` keyed by
    "<log>/<chain_id>": what `weir audit verify` checks the ledger's database against.

    The auditor publishes one as it writes each checkpoint (docs/design.md, "The audit chain";
    services/auditor/anchors.py). `checkpoint_hash` = sha256(prev_hash || canonical checkpoint
    JSON of the fields above it), and `mac` = HMAC-SHA256 under the deployment's checkpoint key of
    that hash with the log and chain: whoever lacks the key cannot make an anchor that verifies.
    """

    kind: Literal["audit_anchor"] = Field("audit_anchor", description="Message kind.")
    log: Literal["audit", "review_flags"] = Field(description="Which chains: the AuditEvents' or the ReviewFlags'.")
    chain_id: int = Field(ge=0, description="The chain (the audit-topic partition its records came from).")
    num: int = Field(ge=1, description="The checkpoint's number in its chain, from 1.")
    first_seq: int = Field(ge=1, description="First record (seq) the checkpoint covers.")
    last_seq: int = Field(ge=1, description="Last record (seq) it covers: how long the chain was when it was made.")
    merkle_root: str = Field(
        pattern=_HASH, description="RFC 6962 Merkle root of the record hashes first_seq..last_seq."
    )
    last_record_hash: str = Field(pattern=_HASH, description="record_hash of last_seq: the chain's head.")
    created_ms: int = Field(description="When the checkpoint was made, epoch ms.")
    prev_hash: str = Field(pattern=_HASH, description="checkpoint_hash of checkpoint num-1 (64 zeros for num 1).")
    checkpoint_hash: str = Field(pattern=_HASH, description="sha256(prev_hash || canonical checkpoint JSON).")
    mac: str = Field(pattern=_HASH, description="HMAC-SHA256 of the checkpoint under the deployment's checkpoint key.")


class DeadLetter(_Wire):
    """A message a consumer could not use, with the reason, on `weir.dlq`."""

    source_topic: str = Field(description="Topic the message came from.")
    partition: int = Field(description="Its partition.")
    offset: int = Field(description="Its offset.")
    key: str | None = Field(None, description="Its key, decoded as UTF-8 with replacement.")
    value: str = Field(description="Its value, decoded as UTF-8 with replacement (truncated to 64 KiB).")
    reason: str = Field(description="Why it was refused.")
    service: str = Field(description="Which service refused it.")
    created_ms: int = Field(default_factory=now_ms, description="When it was dead-lettered, epoch ms.")


class ApiKeyRecord(_Wire):
    """An API key of the gateway, on the compacted `weir.keys` keyed by key_id.

    Only a salted hash of the secret travels: sha256(salt || secret). The latest record of a
    key_id wins; revoking a key writes it again with is_revoked=True. Every gateway instance
    reads the whole topic into memory and keeps following it.
    """

    kind: Literal["api_key"] = Field("api_key", description="Message kind discriminator.")
    key_id: str = Field(min_length=1, max_length=64, description="Public id of the key; names it in revoke and list.")
    principal: str = Field(min_length=1, max_length=256, description="Who the key belongs to.")
    tenant: str = Field(min_length=1, max_length=256, description="Tenant the principal belongs to.")
    models: list[str] = Field(default_factory=list, description="Models the key may use; empty allows every model.")
    max_requests_per_min: int | None = Field(None, ge=1, description="Requests per minute of this key; None: no limit.")
    max_tokens_per_min: int | None = Field(
        None, ge=1, description="Prompt + completion tokens per minute of this key; None: no limit."
    )
    salt_hex: str = Field(min_length=16, description="Random per-key salt, hex.")
    secret_sha256: str = Field(min_length=64, max_length=64, description="sha256(salt || secret), hex.")
    is_revoked: bool = Field(False, description="True once the key is revoked; it then authenticates nothing.")
    created_ms: int = Field(default_factory=now_ms, description="When the key was created, epoch ms.")
    updated_ms: int = Field(default_factory=now_ms, description="When this record was written, epoch ms.")


class UsageRecord(_Wire):
    """Rate-limit consumption one gateway instance admitted, on `weir.usage` keyed by scope.

    Every gateway instance applies the records of the others to its own token buckets, so limits
    hold across instances (eventually: within the publish interval plus consumer lag).
    """

    gateway_id: str = Field(description="Gateway instance that admitted the consumption.")
    scope: str = Field(description="Limited scope, e.g. 'key:<key_id>', 'tenant:<tenant>', 'sub:<tenant>:<principal>'.")
    num_requests: int = Field(0, ge=0, description="Requests admitted since the previous record of this scope.")
    num_tokens: int = Field(
        0, description="Tokens reserved or corrected since the previous record; negative gives tokens back."
    )
    sent_ms: int = Field(default_factory=now_ms, description="When it was sent, epoch ms.")


BatchStatus = Literal[
    "validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired"
]
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]

# Statuses after which a batch job never changes again.
TERMINAL_BATCH_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled", "expired"})

# Bytes of file content per FileChunk: well below Kafka's 1 MiB record limit once JSON-escaped.
MAX_FILE_CHUNK_BYTES = 256 * 1024


class FileChunk(_Wire):
    """One piece of an uploaded or produced file, on `weir.files` keyed by file_id.

    A file is its chunks 0..num_chunks-1 joined in index order; it exists once all are read. A
    file written again under the same id (a job runner that restarted) has identical chunks.
    """

    file_id: str = Field(min_length=1, max_length=128, description="File id, e.g. 'file-<hex>'.")
    index: int = Field(ge=0, description="Position of this chunk, from 0.")
    num_chunks: int = Field(ge=1, description="How many chunks the file has.")
    filename: str = Field(max_length=512, description="Name the file was uploaded or produced under.")
    purpose: str = Field(description="OpenAI file purpose: 'batch' (input) or 'batch_output'.")
    tenant: str = Field(min_length=1, description="Tenant of the owner: the uploader, or the batch's owner.")
    credential: CredentialKind = Field(
        description="Kind of credential of the owner: 'key' (API key), 'jwt' (bearer token) or 'open' (open mode)."
    )
    principal: str = Field(
        min_length=1,
        description="Principal of the owner; only the owner (tenant, credential kind, principal) may read the file.",
    )
    num_bytes: int = Field(ge=0, description="Size of the whole file in bytes.")
    data: str = Field(description="UTF-8 text of this chunk.")
    created_ms: int = Field(default_factory=now_ms, description="When the file was created, epoch ms.")


class RequestCounts(BaseModel):
    """Progress of a batch job, as in OpenAI's request_counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    total: int = Field(0, ge=0, description="Requests in the input file.")
    completed: int = Field(0, ge=0, description="Requests that ended with a response.")
    failed: int = Field(0, ge=0, description="Requests that ended with an error.")


class BatchLineError(BaseModel):
    """Why a batch failed validation, as in OpenAI's batch errors.data[]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str = Field(description="Machine-readable code, e.g. 'invalid_json', 'duplicate_custom_id'.")
    message: str = Field(description="Human-readable explanation.")
    line: int | None = Field(None, description="1-based line of the input file, when one is at fault.")
    param: str | None = Field(None, description="The field at fault, when one is.")


class BatchJob(_Wire):
    """The state of one batch job, on the compacted `weir.jobs` keyed by job_id: the latest wins.

    The gateway writes the first record (validating); from then on only the job runner that owns
    the job's partition of `weir.job_commands` writes it.
    """

    job_id: str = Field(min_length=1, max_length=64, description="Batch id, e.g. 'batch_<hex>'.")
    status: BatchStatus = Field(description="OpenAI batch status.")
    endpoint: BatchEndpoint = Field(description="Endpoint every line of the input file calls.")
    input_file_id: str = Field(description="File holding the JSONL requests.")
    completion_window: str = Field("24h", description="Time the job may take; only '24h'.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 caller key-value pairs.")
    principal: str = Field("anonymous", description="Who created the job.")
    tenant: str = Field("default", description="Tenant of the principal.")
    credential: CredentialKind = Field(
        "open",
        description="Kind of credential it was created with: 'key', 'jwt' "
        "or 'open'; with tenant and principal, the job's owner.",
    )
    request_counts: RequestCounts = Field(default_factory=lambda: RequestCounts(), description="Progress.")
    usage: Usage | None = Field(
        None,
        description="Token counts of its requests, summed from their ReplyEnds when "
        "it ended (completed, cancelled or expired); None before, or for a job that failed validation.",
    )
    output_file_id: str | None = Field(None, description="File of successful results, once finished.")
    error_file_id: str | None = Field(None, description="File of failed requests, once finished (if any).")
    errors: list[BatchLineError] = Field(default_factory=list, description="Why validation failed.")
    queued_tokens: int = Field(
        0,
        ge=0,
        description="Tokens its requests may use (prompts + max_tokens), "
        "counted against its owner's batch quota while it is live.",
    )
    queued_requests: int = Field(
        0,
        ge=0,
        description="Requests its lines run as (a line with n choices is n), "
        "counted against its owner's batch quota while it is live; 0: as "
        "request_counts.total.",
    )
    planned_output_file_id: str | None = Field(
        None,
        description="Random id the runner will write the output "
        "file under (recorded before writing, so a restart reuses it).",
    )
    planned_error_file_id: str | None = Field(None, description="Random id of the error file (see above).")
    created_ms: int = Field(default_factory=now_ms, description="When the job was created, epoch ms.")
    expires_ms: int = Field(description="When the job expires (created + completion window), epoch ms.")
    in_progress_ms: int | None = Field(None, description="When validation passed, epoch ms.")
    finalizing_ms: int | None = Field(None, description="When every request had ended, epoch ms.")
    completed_ms: int | None = Field(None, description="When it completed, epoch ms.")
    failed_ms: int | None = Field(None, description="When validation failed, epoch ms.")
    cancelling_ms: int | None = Field(None, description="When a cancel was received, epoch ms.")
    cancelled_ms: int | None = Field(None, description="When it was cancelled, epoch ms.")
    expired_ms: int | None = Field(None, description="When it expired, epoch ms.")
    updated_ms: int = Field(default_factory=now_ms, description="When this record was written, epoch ms.")


class JobCommand(_Wire):
    """An order for the job runners, on `weir.job_commands` keyed by job_id.

    Runners share the topic in one consumer group, so the owner of a job's partition runs it.
    """

    kind: Literal["job_command"] = Field("job_command", description="Message kind discriminator.")
    job_id: str = Field(min_length=1, max_length=64, description="The job ordered.")
    action: Literal["run", "cancel"] = Field(description="Start (or resume) the job, or cancel it.")
    created_ms: int = Field(default_factory=now_ms, description="When the command was issued, epoch ms.")
