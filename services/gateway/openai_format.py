"""OpenAI's wire format at the gateway's edge: request bodies in, chunks, bodies and errors out.

Pure: no I/O, time passed in. Request bodies are schemas/openai_bodies.py's (shared with the
batch job runner): validated strictly from the raw JSON, every OpenAI parameter honoured or
refused with a 400 naming it, unknown parameters refused; here their errors become ApiErrors.
"""

from __future__ import annotations

import base64
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas import context_length, openai_bodies
from schemas.messages import (
    MAX_EMBED_INPUTS,
    EmbedRequest,
    GenerateRequest,
    Priority,
    ReplyEnd,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from schemas.model_repo import ModelConfig
# the body types are imported from here by the gateway's other modules
from schemas.registry import split_ref
from schemas.traffic import Assignment
from schemas.openai_bodies import (
    BodyError,
    ChatCompletionBody,
    CompletionBody,
    Kind,
    assistant_message,
    body_error,
    finish_reason,
    sibling_requests,
)

DEFAULT_MAX_TOKENS = 256  # chat default when the body sets none (OpenAI's own is "up to context")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per /v1/embeddings request

# Rejection codes that mean "come back later" (429) rather than "this request is wrong" (400).
RETRYABLE_REJECTIONS = frozenset(
    {"rate_limited", "rate_limit_exceeded", "overloaded", "queue_full", "no_capacity", "too_many_requests"}
)

# Rejection codes of a worker that name the request parameter at fault. A regex the grammar
# compiler refuses can only be structured_outputs.regex; a schema it refuses (invalid_schema: e.g.
# a pattern that does not parse) may be response_format's, structured_outputs.json or a tool's
# parameters, which the request no longer tells apart, so it names none.
PARAM_OF_REJECTION = {"invalid_logit_bias": "logit_bias", "suffix_unsupported": "suffix",
                      "invalid_regex": "structured_outputs.regex"}  # fmt: skip
# A worker's rejection codes (the wire's) that OpenAI's clients know by another: a prompt the engine
# counted past the context is OpenAI's context_length_exceeded, which clients match (schemas/context_length.py).
HTTP_CODE_OF_REJECTION = {"prompt_too_long": "context_length_exceeded", "input_too_long": "context_length_exceeded"}


class ApiError(Exception):
    """An error the client sees in OpenAI's format; raised anywhere, rendered by one handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return error_body(self.message, self.type, self.param, self.code)


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------
# Request bodies (schemas/openai_bodies.py: shared with the batch job runner)


def parse_body(kind: Kind, raw: bytes | str) -> ChatCompletionBody | CompletionBody:
    """Validate a raw JSON body for `kind`; raises ApiError(400) naming the first bad parameter."""
    try:
        return openai_bodies.parse_body(kind, raw)
    except BodyError as exc:
        raise api_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    """The 400 for a pydantic ValidationError of a request body: names the field and the problem."""
    return api_error(body_error(exc))


def api_error(exc: BodyError) -> ApiError:
    """The 400 of a refused body."""
    return ApiError(400, exc.message, param=exc.param, code=exc.code)


def to_generate_request(
    kind: Kind,
    body: ChatCompletionBody | CompletionBody,
    model: ModelConfig,
    *,
    request_id: str,
    reply_to: str,
    now_ms: int,
    client_timeout_s: float | None,
    max_timeout_s: float,
    assignment: Assignment | None = None,
) -> GenerateRequest:
    """The GenerateRequest for a validated body. The deadline is the tightest of the client's
    timeout (header or body), the model's default_timeout_s and the gateway's cap. It records the
    body's `user` and how `model` was chosen (`assignment`: docs/design.md, "Traffic policies")."""
    max_tokens = body.max_new_tokens
    if max_tokens is None:
        default = DEFAULT_MAX_TOKENS if kind == "chat.completions" else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = min(default, model.max_model_len)
    elif max_tokens > model.max_model_len:
        param = "max_completion_tokens" if kind == "chat.completions" and body.max_tokens is None else "max_tokens"
        word = "messages" if kind == "chat.completions" else "prompt"
        message = context_length.completion_too_long(model.max_model_len, max_tokens, param, word)
        raise ApiError(400, message, param=param, code="context_length_exceeded")
    timeouts = [t for t in (client_timeout_s, body.timeout_s) if t is not None]
    timeout_s = min([*timeouts, model.default_timeout_s, max_timeout_s])
    try:
        constraints = {**body.structured_fields(), **body.tool_fields()}
    except BodyError as exc:
        raise api_error(exc) from None
    return GenerateRequest(
        request_id=request_id,
        model=model.served_id,  # pinned: the version is known when the response starts (docs/design.md, invariant 10)
        prompt=body.prompt if isinstance(body, CompletionBody) else None,
        messages=[m.to_wire() for m in body.messages] if isinstance(body, ChatCompletionBody) else None,
        max_tokens=max_tokens,
        **body.sampling_fields(),
        **body.choice_fields(),
        **constraints,
        stream=bool(body.stream),
        principal="anonymous",
        tenant="default",
        priority="interactive",
        user=body.user,
        assignment=assignment,
        deadline_ms=now_ms + int(timeout_s * 1000),
        reply_to=reply_to,
        created_ms=now_ms,
    )


def refuse_embedding_model(model: ModelConfig) -> None:
    """ApiError(400) when a completions endpoint names an embedding model."""
    if model.engine == "onnx":
        raise ApiError(400, f"{model.name} is an embedding model; use /v1/embeddings",
                       param="model", code="unsupported_model")  # fmt: skip


class EmbeddingBody(BaseModel):
    """POST /v1/embeddings. Text inputs only; `timeout_s` is a Weir extension; another parameter
    is refused (400 unknown_parameter), not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=128)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)
    timeout_s: float | None = Field(None, ge=0.001)

    @property
    def inputs(self) -> list[str]:
        """The texts, in order (a single string is a list of one)."""
        return [self.input] if isinstance(self.input, str) else cast(list[str], self.input)


def parse_embedding_body(raw: bytes | str) -> EmbeddingBody:
    """Validate a raw /v1/embeddings body; ApiError(400) naming `input` for what Weir cannot embed."""
    try:
        body = EmbeddingBody.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    texts = body.input if isinstance(body.input, list) else [body.input]
    if any(not isinstance(t, str) for t in texts):
        raise ApiError(400, "token-id arrays are not supported as input; send the text",
                       param="input", code="unsupported_parameter")  # fmt: skip
    if not texts:
        raise ApiError(400, "input must hold at least one string", param="input", code="invalid_value")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise ApiError(400, f"input holds {len(texts)} strings; at most {MAX_EMBEDDING_INPUTS} are allowed",
                       param="input", code="invalid_value")  # fmt: skip
    if any(not t for t in texts):
        raise ApiError(400, "input must not contain empty strings", param="input", code="invalid_value")
    return body


def to_embed_requests(
    body: EmbeddingBody,
    model: ModelConfig,
    *,
    request_id: str,
    reply_to: str,
    now_ms: int,
    client_timeout_s: float | None,
    max_timeout_s: float,
    principal: str = "anonymous",
    tenant: str = "default",
    priority: Priority = "interactive",
    assignment: Assignment | None = None,
) -> list[EmbedRequest]:
    """The EmbedRequests of a validated body: MAX_EMBED_INPUTS inputs each (ids request_id-0, -1,
    ... when there are several), with the deadline chosen as for completions, the body's `user` and
    the `assignment` of `model`. ApiError(400) when the model does not embed or `dimensions` is not
    the model's."""
    if model.engine != "onnx":
        raise ApiError(400, f"{model.name} is not an embedding model", param="model", code="unsupported_model")
    if body.dimensions is not None and body.dimensions != model.dimensions:
        made = f"{model.dimensions}-dimensional embeddings" if model.dimensions else "embeddings of a fixed size"
        raise ApiError(400, f"{model.name} makes {made}; dimensions={body.dimensions} is not supported",
                       param="dimensions", code="invalid_value")  # fmt: skip
    timeouts = [t for t in (client_timeout_s, body.timeout_s) if t is not None]
    timeout_s = min([*timeouts, model.default_timeout_s, max_timeout_s])
    texts = body.inputs
    chunks = [texts[i : i + MAX_EMBED_INPUTS] for i in range(0, len(texts), MAX_EMBED_INPUTS)]
    return [
        EmbedRequest(
            request_id=request_id if len(chunks) == 1 else f"{request_id}-{i}", model=model.served_id, inputs=chunk,
            principal=principal, tenant=tenant, priority=priority, user=body.user, assignment=assignment,
            deadline_ms=now_ms + int(timeout_s * 1000), reply_to=reply_to, created_ms=now_ms,
        )  # fmt: skip
        for i, chunk in enumerate(chunks)
    ]


def embedding_body(model: str, ends: list[ReplyEnd], encoding_format: str | None) -> dict[str, Any]:
    """OpenAI's embedding list from the terminal events of a body's EmbedRequests, in order.

    base64 is the float32 little-endian bytes of each vector, as OpenAI sends it.
    """
    vectors = [vector for end in ends for vector in end.embeddings or []]
    if encoding_format == "base64":
        encoded: list[Any] = [base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() for v in vectors]
    else:
        encoded = vectors
    num_tokens = sum(end.usage.prompt_tokens for end in ends)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "model": served_version(ends[0], model) if ends else model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


# ---------------------------------------------------------------------------------------------
# Responses


def terminal_error(end: ReplyEnd) -> ApiError | None:
    """The client-facing error of a terminal event, or None when it finished (stop, length)."""
    if end.finish_reason in ("stop", "length"):
        return None
    code = end.error.code if end.error else None
    detail = end.error.message if end.error else None
    if end.finish_reason == "timeout":
        return ApiError(504, detail or "the request timed out before it finished", code=code or "timeout")
    if end.finish_reason == "rejected":
        status = 429 if code in RETRYABLE_REJECTIONS else 400
        param = PARAM_OF_REJECTION.get(code or "")
        code = HTTP_CODE_OF_REJECTION.get(code or "", code)
        return ApiError(status, detail or "the request was rejected", code=code or "rejected", param=param)
    if end.finish_reason == "cancelled":
        return ApiError(503, detail or "the request was cancelled", code=code or "cancelled")
    return ApiError(500, detail or "the request failed", code=code or "internal_error")


LogprobsFormat = Literal["chat", "legacy"]


def logprobs_format(kind: Kind, request: GenerateRequest) -> LogprobsFormat | None:
    """How a response renders logprobs: chat's `content` list, /v1/completions' legacy lists, or
    not at all (the request asked for none)."""
    if request.logprobs is None:
        return None
    return "chat" if kind == "chat.completions" else "legacy"


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [...], "refusal": null}."""
    def entry(t: TokenLogprob) -> dict[str, Any]:  # noqa: E306
        top = [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes} for a in t.top_logprobs]
        return {"token": t.token, "logprob": t.logprob, "bytes": t.bytes, "top_logprobs": top}
    return {"content": [entry(t) for t in logprobs], "refusal": None}


def legacy_logprobs(logprobs: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """A /v1/completions choice's (or chunk's) `logprobs` in OpenAI's legacy format; `text_offset`
    is where the first token starts in the choice's text (after an echoed prompt)."""
    offsets = []
    for t in logprobs:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in logprobs],
        "text_offset": offsets,
    }


@dataclass
class ChoiceResult:
    """One choice of a whole (stream=false) response: its text, logprobs (when asked) and terminal."""

    index: int
    text: str
    end: ReplyEnd
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None  # as the output guard released their arguments


def best_of(results: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """The n results with the highest cumulative logprob (best first, ties in sibling order),
    renumbered 0..n-1; all of them, in order, when n is all there are. ApiError(502) when a
    worker did not report a cumulative logprob to rank by (docs/design.md, "n and best_of are
    sibling requests")."""
    if n >= len(results):
        return results
    if any(r.end.cumulative_logprob is None for r in results):
        raise ApiError(502, "best_of cannot rank the choices: the worker reported no cumulative logprob",
                       code="cumulative_logprob_missing")  # fmt: skip
    ranked = sorted(results, key=lambda r: (-(r.end.cumulative_logprob or 0.0), r.index))[:n]
    return [ChoiceResult(i, r.text, r.end, r.logprobs, r.tool_calls) for i, r in enumerate(ranked)]


def choices_usage(ends: list[ReplyEnd]) -> Usage:
    """The usage of sibling requests as OpenAI counts one request with n choices: the prompt (and
    its cached tokens) once, the completion tokens of every sibling (best_of's discarded ones too)."""
    completion = sum(end.usage.completion_tokens for end in ends)
    first = ends[0].usage
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                 total_tokens=first.prompt_tokens + completion, cached_prompt_tokens=first.cached_prompt_tokens)


class ChunkWriter:
    """Turns one request's reply events into OpenAI streaming chunks (dicts).

    Chat: chat.completion.chunk objects, the first of each choice carrying delta.role="assistant";
    tool calls as OpenAI streams them (delta.tool_calls, id, type and name on a call's first piece
    only). Completions: text_completion objects (with `echo`, each choice starts with a chunk of
    the prompt). Each choice's terminal gives a chunk with finish_reason; after the last,
    (include_usage) a chunk with empty choices and the usage; with include_usage the others carry
    "usage": null. A choice's chunks carry the logprobs of their tokens when asked (`logprobs`).
    """

    def __init__(self, kind: Kind, request_id: str, model: str, created_s: int, include_usage: bool,
                 logprobs: LogprobsFormat | None = None, echo: str | None = None) -> None:  # fmt: skip
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created_s = created_s
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.echo = echo
        self._has_started: set[int] = set()  # choices that sent their first chunk
        self._text_offset: dict[int, int] = {}  # legacy logprobs: where a choice's next token starts
        self._calls_begun: set[tuple[int, int]] = set()  # (choice, call index) whose first piece went out

    def fresh(self) -> ChunkWriter:
        """A new writer of the same stream, for a reader that renders it again from its start."""
        return ChunkWriter(self.kind, self.request_id, self.model, self.created_s, self.include_usage,
                           self.logprobs, self.echo)  # fmt: skip

    def on_start(self, index: int = 0) -> list[dict[str, Any]]:
        """The chunks a choice starts with before any output: its echoed prompt (completions, echo)."""
        if self.echo is None or self.kind != "completions" or index in self._has_started:
            return []
        self._has_started.add(index)
        self._text_offset[index] = len(self.echo)
        return [self._chunk([self._completion_choice(index, self.echo, None, None)])]

    def on_text(self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """The chunk of a piece of output text of choice `index` (one delta's, or what the output
        guard released), with the logprobs of its tokens when asked."""
        rendered = self._logprobs(index, logprobs or [])
        if self.kind == "chat.completions":
            return self._chunk([self._chat_choice(index, {"content": text}, None, rendered)])
        self._has_started.add(index)
        return self._chunk([self._completion_choice(index, text, rendered, None)])

    def on_tool_call(self, piece: ToolCallDelta, index: int = 0) -> dict[str, Any]:
        """The chunk of a piece of tool call `piece.index` of choice `index` (its arguments as the
        output guard released them): the call's first chunk carries its id, type and name, later
        ones only arguments, so the openai client's accumulators rebuild the call."""
        call: dict[str, Any] = {"index": piece.index}
        function: dict[str, Any] = {}
        if (index, piece.index) not in self._calls_begun:
            self._calls_begun.add((index, piece.index))
            call.update({"id": piece.id, "type": "function"})
            function["name"] = piece.name
        function["arguments"] = piece.arguments
        call["function"] = function
        return self._chunk([self._chat_choice(index, {"tool_calls": [call]}, None, None)])

    def on_finish(self, end: ReplyEnd, index: int = 0) -> dict[str, Any]:
        """The finish chunk of choice `index` (a stop/length terminal)."""
        reason = finish_reason(end)
        self.model = served_version(end, self.model)
        if self.kind == "chat.completions":
            return self._chunk([self._chat_choice(index, {}, reason, None)], fingerprint=end.model_version)
        return self._chunk([self._completion_choice(index, "", None, reason)])

    def on_usage(self, usage: Usage) -> list[dict[str, Any]]:
        """The usage chunk at the end of the stream, if asked (include_usage)."""
        return [self._chunk([], usage=usage_dict(usage))] if self.include_usage else []

    def on_end(self, end: ReplyEnd) -> list[dict[str, Any]]:
        """The chunks of a finished (stop/length) terminal of a one-choice stream: finish, then usage if asked."""
        return [self.on_finish(end), *self.on_usage(end.usage)]

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.logprobs == "chat":
            return chat_logprobs(logprobs)
        if self.logprobs == "legacy":
            offset = self._text_offset.get(index, 0)
            self._text_offset[index] = offset + sum(len(t.token) for t in logprobs)
            return legacy_logprobs(logprobs, offset)
        return None

    def _completion_choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chat_choice(
        self, index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        if index not in self._has_started:
            delta = {"role": "assistant", **delta}
            self._has_started.add(index)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(
        self, choices: list[dict[str, Any]], *, usage: dict[str, Any] | None = None, fingerprint: str | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.kind == "chat.completions" else "text_completion",
            "created": self.created_s,
            "model": self.model,
            "system_fingerprint": fingerprint,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return chunk


def completion_body(
    kind: Kind, request_id: str, model: str, created_s: int, text: str, end: ReplyEnd,
    tool_calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    """The non-streaming body of one choice without logprobs: chat.completion (with the
    `tool_calls` the model made, their arguments as the output guard released them) or
    text_completion, with usage."""
    return choices_body(kind, request_id, model, created_s, [ChoiceResult(0, text, end, tool_calls=tool_calls)], end.usage)


def choices_body(
    kind: Kind, request_id: str, model: str, created_s: int, results: list[ChoiceResult], usage: Usage,
    logprobs: LogprobsFormat | None = None, echo: str | None = None,
) -> dict[str, Any]:
    """The non-streaming body: chat.completion or text_completion with a choice per result (in
    their order), `usage`, each choice's logprobs when asked, its tool calls (chat), and the
    prompt before each text when `echo` is given (completions)."""
    prefix = echo if kind == "completions" and echo is not None else ""
    choices = []
    for r in results:
        rendered: dict[str, Any] | None = None
        if logprobs == "chat":
            rendered = chat_logprobs(r.logprobs or [])
        elif logprobs == "legacy":
            rendered = legacy_logprobs(r.logprobs or [], len(prefix))
        if kind == "chat.completions":
            choices.append({"index": r.index, "message": assistant_message(r.text, r.tool_calls),
                            "logprobs": rendered, "finish_reason": finish_reason(r.end)})  # fmt: skip
        else:
            choices.append({"index": r.index, "text": prefix + r.text, "logprobs": rendered,
                            "finish_reason": r.end.finish_reason})  # fmt: skip
    first = results[0].end
    return {
        "id": request_id,
        "object": "chat.completion" if kind == "chat.completions" else "text_completion",
        "created": created_s,
        "model": served_version(first, model),
        "system_fingerprint": first.model_version,
        "choices": choices,
        "usage": usage_dict(usage),
    }


def guarded_calls(calls: list[ToolCall] | None, guard_text: Callable[[str], str]) -> list[ToolCall] | None:
    """The tool calls with their arguments passed through the output guard's `guard_text`, as
    the text is: arguments are model output too."""
    if not calls:
        return calls
    return [c.model_copy(update={"function": c.function.model_copy(update={"arguments": guard_text(c.function.arguments)})})
            for c in calls]  # fmt: skip


def served_version(end: ReplyEnd, pinned: str) -> str:
    """The `name@version` a response names: the one the worker says served it (ReplyEnd.model_version),
    else the one the request was pinned to. A terminal without a version (the gateway's own
    timeout, an old worker's bare name) leaves the pinned one."""
    reported = end.model_version
    return reported if reported and split_ref(reported)[1] else pinned


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object (total recomputed, so it always adds up), with the prompt tokens the
    prefix cache served in prompt_tokens_details.cached_tokens."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


MIN_HEADER_SECONDS = 0.001  # the finest duration a header may give: a deadline is in whole milliseconds
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", re.ASCII)


def header_seconds(headers: dict[str, str], name: str, max_s: float, *, may_be_zero: bool) -> float | None:
    """A number of seconds from header `name` (None when absent): a finite decimal from 0.001
    (or exactly 0 when may_be_zero) to max_s; anything else (not a number, NaN, inf, negative,
    finer than a millisecond, larger than max_s) is ApiError(400) naming the header."""
    value = headers.get(name.lower())
    if value is None:
        return None
    # a plain decimal (HTTP has no use for float()'s "1_0", " 5", "nan" or "1e3" spellings)
    seconds = float(value) if len(value) <= 32 and _DECIMAL.fullmatch(value) else math.nan
    is_zero = may_be_zero and seconds == 0
    if not (is_zero or MIN_HEADER_SECONDS <= seconds <= max_s):  # NaN compares false: refused too
        lowest = "0 or from 0.001" if may_be_zero else "from 0.001"
        raise ApiError(400, f"{name} must be a number of seconds {lowest} to {max_s:g}, got {value[:40]!r}",
                       param=name, code="invalid_value")  # fmt: skip
    return seconds
