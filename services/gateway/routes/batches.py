"""OpenAI's Files and Batch APIs on the gateway (the store: batch_store.py; the objects and the
checks of what a client sends: batch_format.py).

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files/{id}   GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches[?limit&after]   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

Every endpoint needs credentials; a batch belongs to the caller's tenant, and a key limited to
some models stays limited in a batch.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from schemas.messages import BatchJob, now_ms
from services.gateway.batch_format import (
    CANCELLABLE,
    batch_object,
    batch_page,
    batch_upload,
    check_batch_body,
    file_object,
    models_in,
    new_batch_job,
)
from services.gateway.batch_store import BatchStore
from services.gateway.guard.gate import Guard
from services.gateway.openai_format import ApiError
from weir.files import StoredFile


def add_file_routes(router: APIRouter, store: BatchStore, guard: Guard) -> None:
    """Add POST /v1/files and GET /v1/files/{file_id}[/content] to `router` (the app's)."""

    @router.post("/v1/files", tags=["batch"], summary="Upload a batch input file")
    async def create_file(request: Request) -> JSONResponse:
        guard.authenticate(dict(request.headers))
        filename, data = batch_upload(request.headers.get("content-type", ""), await request.body())
        try:
            first = await store.put_file(filename, "batch", data)
        except UnicodeDecodeError:
            raise ApiError(400, "the file must be UTF-8 JSONL", param="file", code="invalid_file") from None
        return JSONResponse(file_object(first))

    @router.get("/v1/files/{file_id}", tags=["batch"], summary="A file's metadata")
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        guard.authenticate(dict(request.headers))
        return JSONResponse(file_object(stored_file(store, file_id).first))

    @router.get("/v1/files/{file_id}/content", tags=["batch"], summary="A file's content")
    async def get_file_content(file_id: str, request: Request) -> Response:
        guard.authenticate(dict(request.headers))
        return Response(stored_file(store, file_id).content(), media_type="application/jsonl")


def add_batch_routes(router: APIRouter, store: BatchStore, guard: Guard) -> None:
    """Add POST /v1/batches, GET /v1/batches[/{batch_id}] and POST /v1/batches/{batch_id}/cancel to
    `router` (the app's)."""

    @router.post("/v1/batches", tags=["batch"], summary="Create a batch")
    async def create_batch(request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        try:
            parsed = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be JSON", code="invalid_json") from None
        body = check_batch_body(parsed)
        for model in models_in(stored_file(store, str(body.get("input_file_id"))).content()):
            guard.authorize(identity, model)  # a key limited to some models stays limited in a batch
        job = new_batch_job(body, f"batch_{uuid.uuid4().hex}", identity.principal, identity.tenant, now_ms())
        await store.create_job(job)
        return JSONResponse(batch_object(job))

    @router.get("/v1/batches/{batch_id}", tags=["batch"], summary="A batch")
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        return JSONResponse(batch_object(job_of(store, batch_id, identity.tenant)))

    @router.get("/v1/batches", tags=["batch"], summary="List batches, newest first")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        return JSONResponse(batch_page(store.jobs.values(), identity.tenant, limit, after))

    @router.post("/v1/batches/{batch_id}/cancel", tags=["batch"], summary="Cancel a batch")
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        job = job_of(store, batch_id, identity.tenant)
        if job.status in CANCELLABLE:
            await store.command(batch_id, "cancel")
            # The runner writes the record; the caller sees what it will read next.
            job = job.model_copy(update={"status": "cancelling", "cancelling_ms": now_ms()})
        return JSONResponse(batch_object(job))


def stored_file(store: BatchStore, file_id: str) -> StoredFile:
    """The stored file `file_id`; ApiError 404 when there is none."""
    found = store.files.get(file_id)
    if found is None:
        raise ApiError(404, f"No such File object: {file_id}", param="id", code="not_found")
    return found


def job_of(store: BatchStore, batch_id: str, tenant: str) -> BatchJob:
    """The batch `batch_id` of `tenant`; ApiError 404 when there is none (another tenant's batch
    does not exist for the caller)."""
    job = store.jobs.get(batch_id)
    if job is None or job.tenant != tenant:
        raise ApiError(404, f"No batch found with id '{batch_id}'", param="batch_id", code="not_found")
    return job
