"""OpenAI's Files and Batch API formats, pure: the objects returned, and the checks of what a
client sends (an upload and every line of it, a new batch and its owner's quota, a page of files
or batches). Every refusal is an ApiError in OpenAI's format; the routes (routes/batches.py) read
the request and the store, and call these. Files and batches are their owner's alone
(docs/design.md, "Batch files").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from schemas.batch_lines import (
    ENDPOINT_KINDS,
    MAX_BATCH_LINES,
    Envelope,
    LineError,
    iter_lines,
    parse_envelope,
    parse_line_body,
)
from schemas.messages import TERMINAL_BATCH_STATUSES, BatchJob, FileChunk, GenerateRequest, RequestCounts, Usage, now_ms
from schemas.model_repo import ModelConfig
from schemas.openai_bodies import BodyError
from schemas.openai_translate import EmbeddingBody, Routing, check_context, to_requests
from services.gateway.batch_upload import Upload
from services.gateway.guard.auth import Identity, Owner
from services.gateway.guard.validation import TokenCounter
from services.gateway.openai_format import ApiError

MAX_METADATA_PAIRS = 16
COMPLETION_WINDOW_MS = {"24h": 24 * 3600 * 1000}
ENDPOINTS = tuple(ENDPOINT_KINDS)
CANCELLABLE = ("validating", "in_progress", "finalizing")  # statuses a cancel command still changes


def file_object(first: FileChunk) -> dict[str, Any]:
    """OpenAI's file object."""
    return {
        "id": first.file_id,
        "object": "file",
        "bytes": first.num_bytes,
        "created_at": first.created_ms // 1000,
        "filename": first.filename,
        "purpose": first.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(job: BatchJob) -> dict[str, Any]:
    """OpenAI's batch object; times in epoch seconds."""

    def s(ms: int | None) -> int | None:
        return None if ms is None else ms // 1000

    errors = {"object": "list", "data": [e.model_dump(mode="json") for e in job.errors]} if job.errors else None
    return {
        "id": job.job_id,
        "object": "batch",
        "endpoint": job.endpoint,
        "errors": errors,
        "input_file_id": job.input_file_id,
        "completion_window": job.completion_window,
        "status": job.status,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "created_at": s(job.created_ms),
        "in_progress_at": s(job.in_progress_ms),
        "expires_at": s(job.expires_ms),
        "finalizing_at": s(job.finalizing_ms),
        "completed_at": s(job.completed_ms),
        "failed_at": s(job.failed_ms),
        "expired_at": s(job.expired_ms),
        "cancelling_at": s(job.cancelling_ms),
        "cancelled_at": s(job.cancelled_ms),
        "request_counts": job.request_counts.model_dump(mode="json"),
        "metadata": job.metadata,
        "usage": batch_usage(job.usage),
    }


def batch_usage(usage: Usage | None) -> dict[str, Any] | None:
    """OpenAI's batch `usage` (BatchUsage) of a job that ended; None before. reasoning_tokens is 0:
    Weir's workers keep no reasoning apart from the output, so every generated token is an output token."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def check_purpose(upload: Upload) -> None:
    """ApiError 400 unless the upload is a batch input file: purpose 'batch' (the only purpose
    Weir stores) and a `file` part."""
    purpose = upload.fields.get("purpose")
    if purpose is None:
        raise ApiError(
            400,
            "purpose is required; Weir stores batch input files: purpose 'batch'",
            param="purpose",
            code="missing_required_parameter",
        )
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported; Weir stores batch input files only (purpose 'batch')",
            param="purpose",
            code="invalid_value",
        )
    if upload.file is None:
        raise ApiError(400, "a 'file' part is required", param="file", code="invalid_value")


@dataclass(frozen=True)
class LineRules:
    """What a batch line is checked against at the gateway: the models, the caller, and the
    limits the online endpoint applies (docs/design.md, "Batch files")."""

    resolve: Callable[[str], ModelConfig]  # a line's `model` to its version (catalog.py); ApiError 400/404
    identity: Identity
    counter: TokenCounter
    max_input_tokens: int | None
    max_stop_sequences: int
    max_timeout_s: float
    reply_to: str  # a reply topic for the trial GenerateRequest of each line; nothing is sent


@dataclass(frozen=True)
class FileSummary:
    """What a checked batch file asks for: its lines, the requests they run as (a line with n
    choices is n requests, as it is online), and the tokens the online endpoint would reserve for
    them (prompt tokens + max_tokens fitted to the context, for each of a line's n choices; an
    embedding line's input tokens), which the batch quota counts."""

    num_lines: int
    num_requests: int
    num_tokens: int


def check_batch_lines(pieces: Iterable[bytes], rules: LineRules, endpoint: str | None = None) -> FileSummary:
    """Check every line of a batch file given as byte pieces, with the batcher's own splitter and
    parser (schemas/batch_lines.py) and the one translator (schemas/openai_translate.py): the
    envelope (and url == `endpoint` when given), the body as its endpoint checks it over HTTP, the
    model known, allowed to the caller and of the endpoint's kind, the prompt within the context.
    ApiError 400 naming the first bad line; CPU-bound, so a route runs it off the event loop."""
    seen: set[str] = set()
    num_lines = num_requests = num_tokens = 0
    for number, raw in iter_lines(pieces):
        num_lines += 1
        if num_lines > MAX_BATCH_LINES:
            raise ApiError(
                400,
                f"the file has more than {MAX_BATCH_LINES} requests, the most a batch takes",
                param="file",
                code="too_many_requests",
            )
        try:
            requests, tokens = check_line(parse_envelope(number, raw, seen, endpoint), rules)
        except LineError as exc:
            raise ApiError(400, f"line {exc.line}: {exc.message}", param=exc.param, code=exc.code) from None
        num_requests += requests
        num_tokens += tokens
    if num_lines == 0:
        raise ApiError(400, "the file has no requests", param="file", code="empty_file")
    return FileSummary(num_lines, num_requests, num_tokens)


def check_line(envelope: Envelope, rules: LineRules) -> tuple[int, int]:
    """(the requests line `envelope` runs as, the tokens it is charged), as the online endpoint
    would count them; LineError when that endpoint would refuse it."""
    body = parse_line_body(envelope)
    try:
        model = rules.resolve(body.model)
    except ApiError as exc:
        raise LineError(envelope.line, exc.code or "model_not_found", exc.message, "model") from None
    if not rules.identity.may_use(model.served_id):
        raise LineError(
            envelope.line,
            "model_not_allowed",
            f"{rules.identity.principal} may not use the model {model.served_id!r}",
            "model",
        )
    now = now_ms()
    routing = Routing("batch-line-check", rules.reply_to, now, now + int(rules.max_timeout_s * 1000))
    try:
        requests = to_requests(ENDPOINT_KINDS[envelope.url], body, model, routing)
        if isinstance(body, EmbeddingBody):
            return len(requests), sum(rules.counter.count(model, text) for text in body.inputs)
        request = requests[0]
        assert isinstance(request, GenerateRequest)
        charge = check_context(
            body,
            request,
            model,
            rules.counter.count_prompts(model, body),
            max_input_tokens=rules.max_input_tokens,
            max_stop_sequences=rules.max_stop_sequences,
        )
    except BodyError as exc:
        raise LineError(envelope.line, exc.code, exc.message, exc.param) from None
    return len(requests), charge * len(requests)  # n choices: a request each


def check_batch_body(body: Any) -> dict[str, Any]:
    """The parsed JSON of POST /v1/batches, checked: a JSON object with a known endpoint, the one
    completion window, an input_file_id and at most 16 metadata pairs; ApiError 400 otherwise.
    The input file is the caller's to look up."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_value")
    if not isinstance(body.get("input_file_id"), str) or not body["input_file_id"]:
        raise ApiError(400, "input_file_id must be a file id", param="input_file_id", code="invalid_value")
    if body.get("endpoint") not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {list(ENDPOINTS)}", param="endpoint", code="invalid_value")
    if body.get("completion_window") not in COMPLETION_WINDOW_MS:
        raise ApiError(400, "completion_window must be '24h'", param="completion_window", code="invalid_value")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS):
        raise ApiError(400, "metadata is at most 16 string pairs", param="metadata", code="invalid_value")
    return body


def new_batch_job(
    body: dict[str, Any], job_id: str, identity: Identity, summary: FileSummary, created_ms: int
) -> BatchJob:
    """The first record of a batch from a body check_batch_body accepted, owned by `identity`:
    validating, due by the end of its completion window, its requests and tokens counted."""
    window = body["completion_window"]
    metadata = body.get("metadata")
    return BatchJob(
        job_id=job_id,
        status="validating",
        endpoint=body["endpoint"],
        input_file_id=body["input_file_id"],
        completion_window=window,
        metadata={str(k): str(v) for k, v in metadata.items()} if metadata else None,
        principal=identity.principal,
        tenant=identity.tenant,
        credential=identity.owner.credential,
        created_ms=created_ms,
        request_counts=RequestCounts(total=summary.num_lines),
        queued_requests=summary.num_requests,
        queued_tokens=summary.num_tokens,
        expires_ms=created_ms + COMPLETION_WINDOW_MS[window],
        updated_ms=created_ms,
    )


def is_owned_by(job: BatchJob, identity: Identity) -> bool:
    """True when `identity` owns the batch: same tenant, kind of credential and principal
    (docs/design.md, "Ownership" and "Batch files")."""
    return Owner(job.tenant, job.credential, job.principal) == identity.owner


def check_batch_quota(
    jobs: Iterable[BatchJob], identity: Identity, summary: FileSummary, max_requests: int, max_tokens: int
) -> None:
    """ApiError 429 when the new batch `summary` would take its owner's live batches past the
    batch quota: `max_requests` and `max_tokens`, and for a credential with per-minute limits at
    most what those allow over a completion window (docs/batch.md, "Batch quota")."""
    window_min = COMPLETION_WINDOW_MS["24h"] // 60_000
    if identity.max_requests_per_min is not None:
        max_requests = min(max_requests, identity.max_requests_per_min * window_min)
    if identity.max_tokens_per_min is not None:
        max_tokens = min(max_tokens, identity.max_tokens_per_min * window_min)
    live = [j for j in jobs if is_owned_by(j, identity) and j.status not in TERMINAL_BATCH_STATUSES]
    queued_requests = sum(j.queued_requests or j.request_counts.total for j in live) + summary.num_requests
    queued_tokens = sum(j.queued_tokens for j in live) + summary.num_tokens
    for kind, queued, limit in (("requests", queued_requests, max_requests), ("tokens", queued_tokens, max_tokens)):
        if queued > limit:
            raise ApiError(
                429,
                f"Batch quota exceeded for {identity.principal}: live batches would hold {queued} "
                f"{kind}, the quota is {limit}; wait for a batch to finish or split the file",
                code="batch_quota_exceeded",
            )


def batch_page(jobs: Iterable[BatchJob], identity: Identity, limit: int, after: str | None) -> dict[str, Any]:
    """GET /v1/batches: the caller's own batches newest first, `limit` of them after the batch
    `after` (none when `after` is unknown); ApiError 400 unless 1 <= limit <= 100."""
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100", param="limit", code="invalid_value")
    mine = sorted((j for j in jobs if is_owned_by(j, identity)), key=lambda j: (j.created_ms, j.job_id), reverse=True)
    if after is not None:
        ids = [j.job_id for j in mine]
        mine = mine[ids.index(after) + 1 :] if after in ids else []
    page = mine[:limit]
    return {
        "object": "list",
        "data": [batch_object(j) for j in page],
        "first_id": page[0].job_id if page else None,
        "last_id": page[-1].job_id if page else None,
        "has_more": len(mine) > limit,
    }


def file_page(
    files: Iterable[FileChunk], identity: Identity, purpose: str | None, limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """GET /v1/files: the caller's own files (of `purpose` when given), by created_at in `order`,
    `limit` of them after the file `after`; ApiError 400 for a limit outside 1..10000 or another order."""
    if not 1 <= limit <= 10_000:
        raise ApiError(400, "limit must be between 1 and 10000", param="limit", code="invalid_value")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order", code="invalid_value")
    mine = sorted(
        (
            f
            for f in files
            if Owner(f.tenant, f.credential, f.principal) == identity.owner
            and (purpose is None or f.purpose == purpose)
        ),
        key=lambda f: (f.created_ms, f.file_id),
        reverse=order == "desc",
    )
    if after is not None:
        ids = [f.file_id for f in mine]
        mine = mine[ids.index(after) + 1 :] if after in ids else []
    page = mine[:limit]
    return {
        "object": "list",
        "data": [file_object(f) for f in page],
        "first_id": page[0].file_id if page else None,
        "last_id": page[-1].file_id if page else None,
        "has_more": len(mine) > limit,
    }


def redact_result_line(raw: bytes, redact: Callable[[str], str]) -> bytes:
    """One line of a batch output or error file with the model's text in its response body
    (choices[].message.content, choices[].text, and the arguments of choices[].message.tool_calls:
    model output too) passed through `redact`, the output guard's function for a whole online
    response; other lines, and the rest of the line, as they were."""
    try:
        row = orjson.loads(raw)
        choices = row["response"]["body"]["choices"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return raw
    if not isinstance(choices, list):
        return raw
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = redact(message["content"])
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    function["arguments"] = redact(function["arguments"])
        if isinstance(choice.get("text"), str):
            choice["text"] = redact(choice["text"])
    return orjson.dumps(row)
