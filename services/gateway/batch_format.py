"""OpenAI's Files and Batch API formats, pure: the objects returned, and the checks of what a
client sends (an upload, a new batch, a page of batches). Every refusal is an ApiError in
OpenAI's format; the routes (routes/batches.py) read the request and the store, and call these.
"""

from __future__ import annotations

from collections.abc import Iterable
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import orjson

from schemas.messages import BatchJob, FileChunk
from services.gateway.openai_format import ApiError

MAX_FILE_BYTES = 64 << 20
MAX_METADATA_PAIRS = 16
COMPLETION_WINDOW_MS = {"24h": 24 * 3600 * 1000}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
CANCELLABLE = ("validating", "in_progress", "finalizing")  # statuses a cancel command still changes


def file_object(first: FileChunk) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": first.file_id, "object": "file", "bytes": first.num_bytes, "created_at": first.created_ms // 1000,
            "filename": first.filename, "purpose": first.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(job: BatchJob) -> dict[str, Any]:
    """OpenAI's batch object; times in epoch seconds."""
    def s(ms: int | None) -> int | None:  # noqa: E306
        return None if ms is None else ms // 1000
    errors = {"object": "list", "data": [e.model_dump(mode="json") for e in job.errors]} if job.errors else None
    return {
        "id": job.job_id, "object": "batch", "endpoint": job.endpoint, "errors": errors,
        "input_file_id": job.input_file_id, "completion_window": job.completion_window, "status": job.status,
        "output_file_id": job.output_file_id, "error_file_id": job.error_file_id,
        "created_at": s(job.created_ms), "in_progress_at": s(job.in_progress_ms), "expires_at": s(job.expires_ms),
        "finalizing_at": s(job.finalizing_ms), "completed_at": s(job.completed_ms), "failed_at": s(job.failed_ms),
        "expired_at": s(job.expired_ms), "cancelling_at": s(job.cancelling_ms), "cancelled_at": s(job.cancelled_ms),
        "request_counts": job.request_counts.model_dump(mode="json"), "metadata": job.metadata,
    }  # fmt: skip


def parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """(form fields, (filename, bytes) of the `file` part or None) of a multipart/form-data body."""
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(400, "POST /v1/files takes multipart/form-data", code="invalid_value")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    for part in message.iter_parts():  # type: ignore[attr-defined]
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        if name == "file":
            upload = (part.get_filename() or "upload.jsonl", data)
        elif isinstance(name, str):
            fields[name] = data.decode("utf-8", "replace")
    return fields, upload


def batch_upload(content_type: str, body: bytes) -> tuple[str, bytes]:
    """(filename, bytes) of a POST /v1/files body; ApiError 413 when too large, 400 when it is not
    multipart, its purpose is not 'batch' or it has no `file` part."""
    if len(body) > MAX_FILE_BYTES:
        raise ApiError(413, f"files are limited to {MAX_FILE_BYTES} bytes", code="request_too_large")
    fields, upload = parse_multipart(content_type, body)
    if fields.get("purpose") != "batch":
        raise ApiError(400, "purpose must be 'batch'", param="purpose", code="invalid_value")
    if upload is None:
        raise ApiError(400, "a 'file' part is required", param="file", code="invalid_value")
    return upload


def models_in(content: bytes) -> set[str]:
    """The models the lines of a batch input file name (lines that do not parse are the runner's to refuse)."""
    models: set[str] = set()
    for raw in content.splitlines():
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        body = row.get("body") if isinstance(row, dict) else None
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            models.add(body["model"])
    return models


def check_batch_body(body: Any) -> dict[str, Any]:
    """The parsed JSON of POST /v1/batches, checked: a JSON object with a known endpoint, the one
    completion window and at most 16 metadata pairs; ApiError 400 otherwise. The input file is
    the caller's to look up."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_value")
    if body.get("endpoint") not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {list(ENDPOINTS)}", param="endpoint", code="invalid_value")
    if body.get("completion_window") not in COMPLETION_WINDOW_MS:
        raise ApiError(400, "completion_window must be '24h'", param="completion_window", code="invalid_value")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS):
        raise ApiError(400, "metadata is at most 16 string pairs", param="metadata", code="invalid_value")
    return body


def new_batch_job(body: dict[str, Any], job_id: str, principal: str, tenant: str, created_ms: int) -> BatchJob:
    """The first record of a batch from a body check_batch_body accepted: validating, due by the
    end of its completion window."""
    window = body["completion_window"]
    metadata = body.get("metadata")
    return BatchJob(job_id=job_id, status="validating", endpoint=body["endpoint"],
                    input_file_id=body["input_file_id"], completion_window=window,
                    metadata={str(k): str(v) for k, v in metadata.items()} if metadata else None,
                    principal=principal, tenant=tenant, created_ms=created_ms,
                    expires_ms=created_ms + COMPLETION_WINDOW_MS[window], updated_ms=created_ms)  # fmt: skip


def batch_page(jobs: Iterable[BatchJob], tenant: str, limit: int, after: str | None) -> dict[str, Any]:
    """GET /v1/batches: the tenant's batches newest first, `limit` of them after the batch `after`
    (none when `after` is unknown); ApiError 400 unless 1 <= limit <= 100."""
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100", param="limit", code="invalid_value")
    mine = sorted((j for j in jobs if j.tenant == tenant), key=lambda j: (j.created_ms, j.job_id), reverse=True)
    if after is not None:
        ids = [j.job_id for j in mine]
        mine = mine[ids.index(after) + 1:] if after in ids else []
    page = mine[:limit]
    return {"object": "list", "data": [batch_object(j) for j in page],
            "first_id": page[0].job_id if page else None,
            "last_id": page[-1].job_id if page else None, "has_more": len(mine) > limit}  # fmt: skip
