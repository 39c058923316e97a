"""The one translator between OpenAI's bodies and Weir's wire messages, both ways.

In: a validated body (schemas/openai_bodies.py) becomes its GenerateRequest(s) or EmbedRequest(s),
with one set of defaults, and its charge (the tokens a rate limit or the batch quota holds for
it) is counted one way. Out: the terminal events (and deltas) of those requests become the
response body or the stream's chunks. The gateway's online routes, its batch upload check and the
batcher's job runner all call these functions, so a body gives the same request, the same charge
and the same response fields whichever way it came in (as vLLM's run_batch reuses its online
serving classes). What differs is only where a request goes and for whom (`Routing`: its id,
reply topic, deadline, lane, principal), and what the caller does with a refusal: the gateway
answers a BodyError with a 400, the runner writes it to the batch's error file.

Pure: no I/O, time passed in.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas import context_length
from schemas.messages import (
    MAX_EMBED_INPUTS,
    EmbedRequest,
    GenerateRequest,
    Priority,
    PromptLogprob,
    ReplyEnd,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from schemas.model_repo import ModelConfig
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
from schemas.registry import split_ref
from schemas.traffic import Assignment

DEFAULT_MAX_TOKENS = 256  # chat default when the body sets none (OpenAI's own is "up to context")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per /v1/embeddings request
ID_PREFIX: dict[str, str] = {"chat.completions": "chatcmpl-", "completions": "cmpl-", "embeddings": "embd-"}

Body = ChatCompletionBody | CompletionBody
Prompt = str | list[int]


@dataclass(frozen=True)
class Routing:
    """Where a translated request goes and for whom: all that differs between the online path
    (an HTTP request: interactive or a lane header, a deadline from timeouts) and a batch line
    (the bulk lane, the job's expiry as deadline, the job's reply topic)."""

    request_id: str
    reply_to: str
    created_ms: int
    deadline_ms: int
    principal: str = "anonymous"
    tenant: str = "default"
    priority: Priority = "interactive"
    assignment: Assignment | None = None
    stream: bool | None = None  # None: as the body says


def deadline_ms(now_ms: int, model: ModelConfig, max_timeout_s: float, *timeouts: float | None) -> int:
    """The absolute deadline of an online request: the tightest of the given client timeouts
    (header, body), the model's default_timeout_s and the gateway's cap."""
    timeout_s = min([*(t for t in timeouts if t is not None), model.default_timeout_s, max_timeout_s])
    return now_ms + int(timeout_s * 1000)


def default_max_tokens(kind: Kind, model: ModelConfig) -> int:
    """max_tokens of a body that sets none: 256 for chat, OpenAI's 16 for completions, never more
    than the model's context (the worker fits it to what the prompt leaves)."""
    return min(DEFAULT_MAX_TOKENS if kind == "chat.completions" else DEFAULT_COMPLETION_MAX_TOKENS, model.max_model_len)


def prompt_word(body: Body) -> context_length.PromptWord:
    """What a body's prompt is called in errors: a chat's `messages`, a completion's `prompt`."""
    return "prompt" if isinstance(body, CompletionBody) else "messages"


# A worker's rejection codes (the wire's) that OpenAI's clients know by another: a prompt the engine
# counted past the context is OpenAI's context_length_exceeded, which clients match. The gateway's
# answers and a batch's error lines both map through this.
CLIENT_CODE_OF_REJECTION = {"prompt_too_long": "context_length_exceeded", "input_too_long": "context_length_exceeded"}


def client_code(code: str | None) -> str | None:
    """The code a client is given for a worker's rejection `code`."""
    return CLIENT_CODE_OF_REJECTION.get(code or "", code)


def max_tokens_param(body: Body) -> str:
    """The parameter a body set its max_tokens with (for errors)."""
    return "max_completion_tokens" if isinstance(body, ChatCompletionBody) and body.max_tokens is None else "max_tokens"


def to_generate_request(kind: Kind, body: Body, model: ModelConfig, routing: Routing) -> GenerateRequest:
    """The GenerateRequest of a validated body, pinned to `model`'s version (docs/design.md,
    invariant 10); one request, before n (or best_of) makes siblings of it (to_generate_requests).
    BodyError when an explicit max_tokens exceeds the model's context, or a value the wire type
    refuses."""
    max_tokens = body.max_new_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(kind, model)
    elif max_tokens > model.max_model_len:
        param = max_tokens_param(body)
        message = context_length.completion_too_long(model.max_model_len, max_tokens, param, prompt_word(body))
        raise BodyError(message, param=param, code="context_length_exceeded")
    constraints = {**body.structured_fields(), **body.tool_fields()}
    try:
        return GenerateRequest(
            request_id=routing.request_id,
            model=model.served_id,
            **(prompt_fields(body.prompts[0]) if isinstance(body, CompletionBody) else {}),
            messages=[m.to_wire() for m in body.messages] if isinstance(body, ChatCompletionBody) else None,
            max_tokens=max_tokens,
            **body.sampling_fields(),
            **body.choice_fields(),
            **constraints,
            stream=bool(body.stream) if routing.stream is None else routing.stream,
            principal=routing.principal,
            tenant=routing.tenant,
            priority=routing.priority,
            user=body.user,
            assignment=routing.assignment,
            deadline_ms=routing.deadline_ms,
            reply_to=routing.reply_to,
            created_ms=routing.created_ms,
        )
    except ValidationError as exc:  # a limit of the wire type the body's own checks do not repeat
        raise body_error(exc) from None


def prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """The GenerateRequest fields of one prompt: its text, or its token ids."""
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt": None, "prompt_token_ids": list(prompt)}


def siblings_of(body: Body, request: GenerateRequest) -> list[GenerateRequest]:
    """The requests of `body`, from the first one (to_generate_request's): one, or a sibling per
    choice of n (or best_of) of each of its prompts, in prompt order (docs/design.md, "n and
    best_of are sibling requests"): sibling k runs prompt k // (n or best_of), and is choice k."""
    siblings = sibling_requests(request, body.num_siblings)
    if not isinstance(body, CompletionBody) or body.num_prompts == 1:
        return siblings
    per, prompts = body.num_siblings_per_prompt, body.prompts
    return [
        s.model_copy(update={"prompt": None, "prompt_token_ids": None, **prompt_fields(prompts[k // per])})
        for k, s in enumerate(siblings)
    ]


def to_generate_requests(kind: Kind, body: Body, model: ModelConfig, routing: Routing) -> list[GenerateRequest]:
    """The requests a body is published as (siblings_of). BodyError as to_generate_request, and
    for an embedding model."""
    check_generation_model(model)
    return siblings_of(body, to_generate_request(kind, body, model, routing))


def check_generation_model(model: ModelConfig) -> None:
    """BodyError when a completions body names an embedding model."""
    if model.engine == "onnx":
        raise BodyError(
            f"{model.name} is an embedding model; use /v1/embeddings", param="model", code="unsupported_model"
        )


def to_requests(
    kind: str, body: Body | EmbeddingBody, model: ModelConfig, routing: Routing
) -> list[GenerateRequest] | list[EmbedRequest]:
    """The requests of a body of endpoint kind `kind` (a batch line's: chat.completions,
    completions or embeddings); BodyError for what its endpoint refuses."""
    if isinstance(body, EmbeddingBody):
        return to_embed_requests(body, model, routing)
    return to_generate_requests(cast(Kind, kind), body, model, routing)


def check_context(
    body: Body,
    request: GenerateRequest,
    model: ModelConfig,
    prompt_tokens: int | list[int],
    *,
    max_input_tokens: int | None,
    max_stop_sequences: int,
) -> int:
    """The tokens one request of `body` is charged (its prompt + the most it may generate in the
    room the prompt leaves: a default max_tokens is fitted there, as the worker fits it; of
    several prompts, the largest); BodyError naming the field when there are too many stops, a
    prompt is too long, or prompt + an explicit max_tokens exceeds the model's context. What a
    rate limit reserves online and what the batch quota counts per line and choice are both this."""
    if isinstance(prompt_tokens, list):
        return max(
            check_context(
                body, request, model, n, max_input_tokens=max_input_tokens, max_stop_sequences=max_stop_sequences
            )
            for n in prompt_tokens
        )
    prompt_param = prompt_word(body)
    if len(request.stop) > max_stop_sequences:
        raise BodyError(
            f"at most {max_stop_sequences} stop sequences are allowed, got {len(request.stop)}",
            param="stop",
            code="invalid_value",
        )
    # The refusals in OpenAI's and vLLM's words, which clients match (schemas/context_length.py).
    if max_input_tokens is not None and max_input_tokens < model.max_model_len - 1 and prompt_tokens > max_input_tokens:
        message = context_length.input_over_limit(model.max_model_len, max_input_tokens, prompt_tokens, prompt_param)
        raise BodyError(message, param=prompt_param, code="context_length_exceeded")
    is_explicit = body.max_new_tokens is not None
    if prompt_tokens > model.max_model_len - 1:  # at least one token must remain for the output
        if is_explicit:
            message = context_length.requested_too_much(
                model.max_model_len, prompt_tokens, request.max_tokens, prompt_param
            )
        else:
            message = context_length.prompt_too_long(model.max_model_len, prompt_tokens, prompt_param)
        raise BodyError(message, param=prompt_param, code="context_length_exceeded")
    room = model.max_model_len - prompt_tokens
    if request.max_tokens > room and is_explicit:  # a default is fitted, not refused
        message = context_length.requested_too_much(
            model.max_model_len, prompt_tokens, request.max_tokens, prompt_param
        )
        raise BodyError(message, param=max_tokens_param(body), code="context_length_exceeded")
    return prompt_tokens + min(request.max_tokens, room)


# ---------------------------------------------------------------------------------------------
# Embeddings


class EmbeddingBody(BaseModel):
    """POST /v1/embeddings (and a batch line of it). Text inputs only; `timeout_s` is a Weir
    extension; another parameter is refused (400 unknown_parameter), not ignored."""

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
    """Validate a raw /v1/embeddings body; BodyError naming `input` for what Weir cannot embed."""
    try:
        body = EmbeddingBody.model_validate_json(raw)
    except ValidationError as exc:
        raise body_error(exc) from None
    texts = body.input if isinstance(body.input, list) else [body.input]
    if any(not isinstance(t, str) for t in texts):
        raise BodyError(
            "token-id arrays are not supported as input; send the text", param="input", code="unsupported_parameter"
        )
    if not texts:
        raise BodyError("input must hold at least one string", param="input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise BodyError(f"input holds {len(texts)} strings; at most {MAX_EMBEDDING_INPUTS} are allowed", param="input")
    if any(not t for t in texts):
        raise BodyError("input must not contain empty strings", param="input")
    return body


def check_embedding_model(body: EmbeddingBody, model: ModelConfig) -> None:
    """BodyError when the model does not embed or `dimensions` is not the model's."""
    if model.engine != "onnx":
        raise BodyError(f"{model.name} is not an embedding model", param="model", code="unsupported_model")
    if body.dimensions is not None and body.dimensions != model.dimensions:
        made = f"{model.dimensions}-dimensional embeddings" if model.dimensions else "embeddings of a fixed size"
        raise BodyError(f"{model.name} makes {made}; dimensions={body.dimensions} is not supported", param="dimensions")


def to_embed_requests(body: EmbeddingBody, model: ModelConfig, routing: Routing) -> list[EmbedRequest]:
    """The EmbedRequests of a validated body: MAX_EMBED_INPUTS inputs each (ids request_id-0, -1,
    ... when there are several), with the body's `user`; BodyError as check_embedding_model."""
    check_embedding_model(body, model)
    texts = body.inputs
    chunks = [texts[i : i + MAX_EMBED_INPUTS] for i in range(0, len(texts), MAX_EMBED_INPUTS)]
    return [
        EmbedRequest(
            request_id=routing.request_id if len(chunks) == 1 else f"{routing.request_id}-{i}",
            model=model.served_id,
            inputs=chunk,
            principal=routing.principal,
            tenant=routing.tenant,
            priority=routing.priority,
            user=body.user,
            assignment=routing.assignment,
            deadline_ms=routing.deadline_ms,
            reply_to=routing.reply_to,
            created_ms=routing.created_ms,
        )
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


class Unrankable(ValueError):
    """best_of cannot rank the choices: a worker reported no cumulative logprob."""


LogprobsFormat = Literal["chat", "legacy"]


def logprobs_format(kind: Kind, request: GenerateRequest) -> LogprobsFormat | None:
    """How a response renders logprobs: chat's `content` list, /v1/completions' legacy lists, or
    not at all (the request asked for none)."""
    if request.logprobs is None:
        return None
    return "chat" if kind == "chat.completions" else "legacy"


def echo_of(body: Body) -> str | None:
    """The prompt a /v1/completions body of one text prompt asks to have put before each choice's
    text (echo); a stream's (several prompts, or token ids, are echoed in whole bodies only)."""
    if not isinstance(body, CompletionBody) or not body.echo or body.num_prompts != 1:
        return None
    prompt = body.prompts[0]
    return prompt if isinstance(prompt, str) else None


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [...], "refusal": null}."""

    def entry(t: TokenLogprob) -> dict[str, Any]:
        top = [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes} for a in t.top_logprobs]
        return {"token": t.token, "logprob": t.logprob, "bytes": t.bytes, "top_logprobs": top}

    return {"content": [entry(t) for t in logprobs], "refusal": None}


def legacy_logprobs(
    logprobs: list[TokenLogprob], text_offset: int, prompt: list[PromptLogprob] | None = None
) -> dict[str, Any]:
    """A /v1/completions choice's (or chunk's) `logprobs` in OpenAI's legacy format; `text_offset`
    is where the first token starts in the choice's text (after an echoed prompt). With `prompt`
    (echo with logprobs) the prompt's tokens come first, from offset 0, the first one's logprob
    and alternatives null, as OpenAI's."""
    offsets: list[int] = []
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    at = 0
    for p in prompt or []:
        offsets.append(at)
        at += len(p.token)
        tokens.append(p.token)
        values.append(p.logprob)
        tops.append(None if p.logprob is None else {a.token: a.logprob for a in p.top_logprobs})
    for t in logprobs:
        offsets.append(text_offset)
        text_offset += len(t.token)
        tokens.append(t.token)
        values.append(t.logprob)
        tops.append({a.token: a.logprob for a in t.top_logprobs})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_text_of(entries: list[PromptLogprob]) -> str:
    """The text of a prompt given as token ids, from its tokens' bytes (the worker's prompt logprobs)."""
    return bytes(b for e in entries for b in e.bytes).decode("utf-8", errors="replace")


@dataclass
class ChoiceResult:
    """One choice of a whole (stream=false) response: its text, logprobs (when asked) and terminal."""

    index: int
    text: str
    end: ReplyEnd
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None  # as the output guard released their arguments
    echo: str | None = None  # the prompt put before the text (completions, echo)
    prompt_logprobs: list[PromptLogprob] | None = None  # echo with logprobs: the prompt's, first


def best_of(results: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """The n results with the highest cumulative logprob (best first, ties in sibling order),
    renumbered 0..n-1; all of them, in order, when n is all there are. Unrankable when a worker
    did not report a cumulative logprob to rank by."""
    if n >= len(results):
        return results
    if any(r.end.cumulative_logprob is None for r in results):
        raise Unrankable("best_of cannot rank the choices: the worker reported no cumulative logprob")
    ranked = sorted(results, key=lambda r: (-(r.end.cumulative_logprob or 0.0), r.index))[:n]
    return [
        ChoiceResult(i, r.text, r.end, r.logprobs, r.tool_calls, r.echo, r.prompt_logprobs)
        for i, r in enumerate(ranked)
    ]


def choices_usage(ends: list[ReplyEnd], num_prompts: int = 1) -> Usage:
    """The usage of sibling requests as OpenAI counts one request with n choices of each of its
    prompts: each prompt (and its cached tokens) once, the completion tokens of every sibling
    (best_of's discarded ones too)."""
    completion = sum(end.usage.completion_tokens for end in ends)
    per = max(1, len(ends) // num_prompts)
    firsts = [end.usage for end in ends[::per]]
    prompt = sum(u.prompt_tokens for u in firsts)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_prompt_tokens=sum(u.cached_prompt_tokens for u in firsts),
    )


def choice_results(
    body: Body, texts: list[str], ends: list[ReplyEnd], logprobs: list[list[TokenLogprob]] | None = None
) -> list[ChoiceResult]:
    """The choices of a body's finished siblings (a text, a terminal and the logprobs of its
    tokens each, in sibling order), before best_of: tool calls as the worker parsed them, the
    echoed prompt of each (a prompt of token ids: its text from the prompt's logprobs) and, with
    echo and logprobs, the prompt's logprobs."""
    asked = body.top_logprobs_asked is not None
    results = []
    per = body.num_siblings_per_prompt if isinstance(body, CompletionBody) else body.num_siblings
    for i, (text, end) in enumerate(zip(texts, ends, strict=True)):
        echo = prompt_lps = None
        if isinstance(body, CompletionBody) and body.echo:
            prompt = body.prompts[i // per]
            echo = prompt if isinstance(prompt, str) else prompt_text_of(end.prompt_logprobs or [])
            prompt_lps = end.prompt_logprobs if body.logprobs is not None else None
        results.append(
            ChoiceResult(
                i, text, end, (logprobs[i] if logprobs else []) if asked else None, end.tool_calls, echo, prompt_lps
            )
        )
    return results


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object (total recomputed, so it always adds up), with the prompt tokens the
    prefix cache served in prompt_tokens_details.cached_tokens."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def served_version(end: ReplyEnd, pinned: str) -> str:
    """The `name@version` a response names: the one the worker says served it (ReplyEnd.model_version),
    else the one the request was pinned to. A terminal without a version (the gateway's own
    timeout, an old worker's bare name) leaves the pinned one."""
    reported = end.model_version
    return reported if reported and split_ref(reported)[1] else pinned


def choices_body(
    kind: Kind,
    request_id: str,
    model: str,
    created_s: int,
    results: list[ChoiceResult],
    usage: Usage,
    logprobs: LogprobsFormat | None = None,
    echo: str | None = None,
) -> dict[str, Any]:
    """The non-streaming body: chat.completion or text_completion with a choice per result (in
    their order), `usage`, each choice's logprobs when asked, its tool calls (chat), and the
    prompt before each text when `echo` is given (completions)."""
    choices = []
    for r in results:
        prefix = r.echo if r.echo is not None else echo if kind == "completions" and echo is not None else ""
        rendered: dict[str, Any] | None = None
        if logprobs == "chat":
            rendered = chat_logprobs(r.logprobs or [])
        elif logprobs == "legacy":
            rendered = legacy_logprobs(r.logprobs or [], len(prefix), r.prompt_logprobs)
        if kind == "chat.completions":
            choices.append(
                {
                    "index": r.index,
                    "message": assistant_message(r.text, r.tool_calls),
                    "logprobs": rendered,
                    "finish_reason": finish_reason(r.end),
                }
            )
        else:
            choices.append(
                {"index": r.index, "text": prefix + r.text, "logprobs": rendered, "finish_reason": r.end.finish_reason}
            )
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


def completion_body(
    kind: Kind,
    request_id: str,
    model: str,
    created_s: int,
    text: str,
    end: ReplyEnd,
    tool_calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    """The non-streaming body of one choice without logprobs: chat.completion (with the
    `tool_calls` the model made) or text_completion, with usage."""
    return choices_body(
        kind, request_id, model, created_s, [ChoiceResult(0, text, end, tool_calls=tool_calls)], end.usage
    )


def response_body(
    kind: Kind,
    request_id: str,
    request: GenerateRequest,
    body: Body,
    texts: list[str],
    ends: list[ReplyEnd],
    logprobs: list[list[TokenLogprob]] | None = None,
) -> dict[str, Any]:
    """The whole body of `body`'s finished siblings (a text, a terminal and the logprobs of its
    tokens each, in sibling order): what the batch runner writes for a line, as the gateway's
    collect builds it online (choice_results; usage as choices_usage counts n and prompts;
    best_of ranks). Unrankable as best_of."""
    results = best_of(choice_results(body, texts, ends, logprobs), body.num_results)
    return choices_body(
        kind,
        request_id,
        request.model,
        request.created_ms // 1000,
        results,
        choices_usage(ends, body.num_prompts),
        logprobs_format(kind, request),
    )


class ChunkWriter:
    """Turns one request's reply events into OpenAI streaming chunks (dicts).

    Chat: chat.completion.chunk objects, the first of each choice carrying delta.role="assistant";
    tool calls as OpenAI streams them (delta.tool_calls, id, type and name on a call's first piece
    only). Completions: text_completion objects (with `echo`, each choice starts with a chunk of
    the prompt). Each choice's terminal gives a chunk with finish_reason; after the last,
    (include_usage) a chunk with empty choices and the usage; with include_usage the others carry
    "usage": null. A choice's chunks carry the logprobs of their tokens when asked (`logprobs`).
    """

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created_s: int,
        include_usage: bool,
        logprobs: LogprobsFormat | None = None,
        echo: str | None = None,
        body: Body | None = None,
    ) -> None:
        self.body = body  # the body it answers, when known: whole responses render its choices (choice_results)
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

    @classmethod
    def of(cls, kind: Kind, body: Body, request: GenerateRequest) -> ChunkWriter:
        """The writer of the stream of `request`, translated from `body`."""
        return cls(
            kind,
            request.request_id,
            request.model,
            request.created_ms // 1000,
            body.include_usage,
            logprobs_format(kind, request),
            echo_of(body),
            body,
        )

    def fresh(self) -> ChunkWriter:
        """A new writer of the same stream, for a reader that renders it again from its start."""
        return ChunkWriter(
            self.kind,
            self.request_id,
            self.model,
            self.created_s,
            self.include_usage,
            self.logprobs,
            self.echo,
            self.body,
        )

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
