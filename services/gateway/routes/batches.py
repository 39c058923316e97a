"""OpenAI's Files and Batch APIs on the gateway (the store: batch_store.py; receiving an upload:
batch_upload.py; the objects and the checks of what a client sends: batch_format.py).

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files[?purpose&limit&order&after]
    GET /v1/files/{id}   GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches[?limit&after]   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

Every endpoint needs credentials. Files and batches belong to their owner, the (tenant,
principal) that uploaded or created them (output files: the batch's owner); anyone else, in
another tenant or the same, gets 404 for them and never sees them in a list (docs/design.md,
"Batch files"). Every line of an upload is checked as its endpoint checks a body, and checked
again with the batch's endpoint and the creator's credential when a batch names the file; a key
limited to some models stays limited in a batch. Output files pass the output guard.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import astuple
from typing import IO

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from schemas.batch_lines import iter_lines
from schemas.messages import BatchJob, now_ms
from services.gateway.batch_format import (
    CANCELLABLE,
    LineRules,
    batch_object,
    batch_page,
    check_batch_body,
    check_batch_lines,
    check_batch_quota,
    check_purpose,
    file_object,
    file_page,
    is_owned_by,
    new_batch_job,
    redact_result_line,
)
from services.gateway.batch_store import BatchStore, new_id
from services.gateway.batch_upload import receive_upload
from services.gateway.guard.auth import Identity
from services.gateway.openai_format import ApiError
from services.gateway.routes.parts import GatewayParts
from weir.files import StoredFile

_READ_BYTES = 1 << 20


def add_file_routes(router: APIRouter, store: BatchStore, parts: GatewayParts) -> None:
    """Add POST /v1/files, GET /v1/files and GET /v1/files/{file_id}[/content] to `router` (the app's)."""
    guard = parts.guard

    @router.post("/v1/files", tags=["batch"], summary="Upload a batch input file")
    async def create_file(request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        upload = await receive_upload(
            request.headers.get("content-type", ""),
            request.headers.get("content-length"),
            request.stream(),
            parts.settings.batch_max_file_bytes,
        )
        try:
            check_purpose(upload)
            assert upload.file is not None
            await asyncio.to_thread(check_batch_lines, _spooled(upload.file), line_rules(parts, identity))
            try:
                first = await store.put_upload(upload, identity)
            except UnicodeDecodeError:
                raise ApiError(400, "the file must be UTF-8 JSONL", param="file", code="invalid_file") from None
        finally:
            upload.close()
        return JSONResponse(file_object(first))

    @router.get("/v1/files", tags=["batch"], summary="List the caller's files")
    async def list_files(
        request: Request, purpose: str | None = None, limit: int = 10_000, order: str = "desc", after: str | None = None
    ) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        files = (stored.first for stored in store.files.complete())
        return JSONResponse(file_page(files, identity, purpose, limit, order, after))

    @router.get("/v1/files/{file_id}", tags=["batch"], summary="A file's metadata")
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        return JSONResponse(file_object(owned_file(store, file_id, identity).first))

    @router.get("/v1/files/{file_id}/content", tags=["batch"], summary="A file's content")
    async def get_file_content(file_id: str, request: Request) -> StreamingResponse:
        identity = guard.authenticate(dict(request.headers))
        stored = owned_file(store, file_id, identity)
        if stored.first.purpose != "batch_output":
            return StreamingResponse(stored.pieces(), media_type="application/jsonl")
        # A batch's results reach the client through the output guard, as an online response does.
        return StreamingResponse(_guarded(stored, parts.output_guard.text), media_type="application/jsonl")


def add_batch_routes(router: APIRouter, store: BatchStore, parts: GatewayParts) -> None:
    """Add POST /v1/batches, GET /v1/batches[/{batch_id}] and POST /v1/batches/{batch_id}/cancel to
    `router` (the app's)."""
    guard = parts.guard

    @router.post("/v1/batches", tags=["batch"], summary="Create a batch")
    async def create_batch(request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        try:
            parsed = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be JSON", code="invalid_json") from None
        body = check_batch_body(parsed)
        stored = owned_file(store, body["input_file_id"], identity)
        if stored.first.purpose != "batch":
            raise ApiError(
                400, f"{body['input_file_id']} is not a batch input file", param="input_file_id", code="invalid_value"
            )
        # Checked again: the creator's key may allow other models than the uploader's, and every
        # line's url must be the batch's endpoint.
        summary = await asyncio.to_thread(
            check_batch_lines, stored.pieces(), line_rules(parts, identity), body["endpoint"]
        )
        s = parts.settings
        quota = (s.batch_max_queued_requests, s.batch_max_queued_tokens)
        check_batch_quota(store.jobs.values(), identity, summary, *quota)
        job = new_batch_job(body, new_id("batch_"), identity, summary, now_ms())
        await store.create_job(job)
        return JSONResponse(batch_object(job))

    @router.get("/v1/batches/{batch_id}", tags=["batch"], summary="A batch")
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        return JSONResponse(batch_object(job_of(store, batch_id, identity)))

    @router.get("/v1/batches", tags=["batch"], summary="List the caller's batches, newest first")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        return JSONResponse(batch_page(store.jobs.values(), identity, limit, after))

    @router.post("/v1/batches/{batch_id}/cancel", tags=["batch"], summary="Cancel a batch")
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        job = job_of(store, batch_id, identity)
        if job.status in CANCELLABLE:
            await store.command(batch_id, "cancel")
            # The runner writes the record; the caller sees what it will read next.
            job = job.model_copy(update={"status": "cancelling", "cancelling_ms": now_ms()})
        return JSONResponse(batch_object(job))


def line_rules(parts: GatewayParts, identity: Identity) -> LineRules:
    """What the lines of a file `identity` uploads or runs are checked against."""
    s = parts.settings
    return LineRules(
        parts.catalog.resolve,
        identity,
        parts.guard.counter,
        s.max_input_tokens,
        s.max_stop_sequences,
        s.max_timeout_s,
        s.topics.job_replies("line-check"),
    )


def owned_file(store: BatchStore, file_id: str, identity: Identity) -> StoredFile:
    """The stored file `file_id` of `identity`; ApiError 404 when there is none, or it is someone
    else's (which does not exist for the caller)."""
    found = store.files.get(file_id)
    if found is None or not found.is_owned_by(*astuple(identity.owner)):
        raise ApiError(404, f"No such File object: {file_id}", param="id", code="not_found")
    return found


def job_of(store: BatchStore, batch_id: str, identity: Identity) -> BatchJob:
    """The batch `batch_id` of `identity`; ApiError 404 when there is none, or it is someone else's."""
    job = store.jobs.get(batch_id)
    if job is None or not is_owned_by(job, identity):
        raise ApiError(404, f"No batch found with id '{batch_id}'", param="batch_id", code="not_found")
    return job


def _spooled(file: IO[bytes]) -> Iterator[bytes]:
    file.seek(0)
    while piece := file.read(_READ_BYTES):
        yield piece


def _guarded(stored: StoredFile, redact: Callable[[str], str]) -> Iterator[bytes]:
    for _number, raw in iter_lines(stored.pieces()):
        yield redact_result_line(raw, redact) + b"\n"
