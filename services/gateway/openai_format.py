"""OpenAI's wire format at the gateway's edge: errors out, and the one translator's refusals as them.

Pure: no I/O, time passed in. Request bodies are schemas/openai_bodies.py's and their translation
to requests and back to response bodies and chunks is schemas/openai_translate.py's, shared with
the batch job runner (the same body gives the same request, charge and response online and in a
batch); here a refusal (BodyError) becomes an ApiError, the 400 in OpenAI's format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from schemas import openai_bodies
from schemas import openai_translate as translate
from schemas.messages import EmbedRequest, GenerateRequest, Priority, ReplyEnd, ToolCall
from schemas.model_repo import ModelConfig

# the body types and the response rendering are imported from here by the gateway's other modules
from schemas.openai_bodies import (  # noqa: F401
    BodyError,
    ChatCompletionBody,
    CompletionBody,
    Kind,
    assistant_message,
    body_error,
    finish_reason,
    sibling_requests,
)
from schemas.openai_translate import (  # noqa: F401
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    MAX_EMBEDDING_INPUTS,
    ChoiceResult,
    ChunkWriter,
    EmbeddingBody,
    LogprobsFormat,
    Routing,
    Unrankable,
    chat_logprobs,
    choice_results,
    choices_body,
    choices_usage,
    completion_body,
    deadline_ms,
    embedding_body,
    legacy_logprobs,
    logprobs_format,
    served_version,
    usage_dict,
)
from schemas.traffic import Assignment

# Rejection codes that mean "come back later" (429) rather than "this request is wrong" (400).
RETRYABLE_REJECTIONS = frozenset(
    {"rate_limited", "rate_limit_exceeded", "overloaded", "queue_full", "no_capacity", "too_many_requests"}
)

# Rejection codes of a worker that name the request parameter at fault. A regex the grammar
# compiler refuses can only be structured_outputs.regex; a schema it refuses (invalid_schema: e.g.
# a pattern that does not parse) may be response_format's, structured_outputs.json or a tool's
# parameters, which the request no longer tells apart, so it names none.
PARAM_OF_REJECTION = {
    "invalid_logit_bias": "logit_bias",
    "suffix_unsupported": "suffix",
    "invalid_regex": "structured_outputs.regex",
}


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
    """The GenerateRequest of a validated body, as the one translator makes it
    (schemas/openai_translate.py); the deadline is the tightest of the client's timeout (header
    or body), the model's default_timeout_s and the gateway's cap. ApiError(400) for a refusal."""
    routing = Routing(
        request_id,
        reply_to,
        now_ms,
        deadline_ms(now_ms, model, max_timeout_s, client_timeout_s, body.timeout_s),
        assignment=assignment,
    )
    try:
        return translate.to_generate_request(kind, body, model, routing)
    except BodyError as exc:
        raise api_error(exc) from None


def refuse_embedding_model(model: ModelConfig) -> None:
    """ApiError(400) when a completions endpoint names an embedding model."""
    try:
        translate.check_generation_model(model)
    except BodyError as exc:
        raise api_error(exc) from None


def parse_embedding_body(raw: bytes | str) -> EmbeddingBody:
    """Validate a raw /v1/embeddings body; ApiError(400) naming `input` for what Weir cannot embed."""
    try:
        return translate.parse_embedding_body(raw)
    except BodyError as exc:
        raise api_error(exc) from None


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
    """The EmbedRequests of a validated body (schemas/openai_translate.py), with the deadline
    chosen as for completions. ApiError(400) when the model does not embed or `dimensions` is not
    the model's."""
    routing = Routing(
        request_id,
        reply_to,
        now_ms,
        deadline_ms(now_ms, model, max_timeout_s, client_timeout_s, body.timeout_s),
        principal,
        tenant,
        priority,
        assignment,
    )
    try:
        return translate.to_embed_requests(body, model, routing)
    except BodyError as exc:
        raise api_error(exc) from None


# ---------------------------------------------------------------------------------------------
# Responses (rendered by schemas/openai_translate.py; here only what becomes an HTTP error)


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
        code = translate.client_code(code)  # a worker's prompt_too_long is context_length_exceeded
        return ApiError(status, detail or "the request was rejected", code=code or "rejected", param=param)
    if end.finish_reason == "cancelled":
        return ApiError(503, detail or "the request was cancelled", code=code or "cancelled")
    return ApiError(500, detail or "the request failed", code=code or "internal_error")


def best_of(results: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """translate.best_of; ApiError(502) when a worker did not report a cumulative logprob to rank
    by (docs/design.md, "n and best_of are sibling requests")."""
    try:
        return translate.best_of(results, n)
    except Unrankable as exc:
        raise ApiError(502, str(exc), code="cumulative_logprob_missing") from None


def guarded_calls(calls: list[ToolCall] | None, guard_text: Callable[[str], str]) -> list[ToolCall] | None:
    """The tool calls with their arguments passed through the output guard's `guard_text`, as
    the text is: arguments are model output too."""
    if not calls:
        return calls
    return [
        c.model_copy(update={"function": c.function.model_copy(update={"arguments": guard_text(c.function.arguments)})})
        for c in calls
    ]


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
        raise ApiError(
            400,
            f"{name} must be a number of seconds {lowest} to {max_s:g}, got {value[:40]!r}",
            param=name,
            code="invalid_value",
        )
    return seconds
