"""OpenAI's Files and Batch APIs on the gateway, over Kafka only.

    POST /v1/files (multipart: file, purpose=batch)   GET /v1/files/{id}   GET /v1/files/{id}/content
    POST /v1/batches   GET /v1/batches[?limit&after]   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

Uploads become FileChunks on `weir.files`; a new batch becomes its first BatchJob record on the
compacted `weir.jobs` and a "run" JobCommand on `weir.job_commands`, which the batcher's job runner
executes. Every gateway reads both topics whole and keeps following them, so any instance answers
for any file or batch; an instance sees its own writes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import orjson
from aiokafka import TopicPartition
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from schemas.codec import DecodeError, decode, encode
from schemas.messages import BatchJob, FileChunk, JobCommand, now_ms
from services.gateway.config import GatewaySettings
from services.gateway.guard.gate import Guard
from services.gateway.openai_format import ApiError
from weir.bus import instance_id, make_consumer, make_producer
from weir.bus import partitions_of
from weir.files import is_behind, FileIndex, chunk_file, write_file

log = logging.getLogger("weir.gateway.batches")

MAX_FILE_BYTES = 64 << 20
COMPLETION_WINDOW_MS = {"24h": 24 * 3600 * 1000}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class BatchStore:
    """This gateway's view of the files and jobs topics, and the producer that writes them."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.producer: Any = None  # AIOKafka clients need the running loop: made in start()
        self.follower: Any = None
        self.files = FileIndex()
        self.jobs: dict[str, BatchJob] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read both topics to their end, then keep following them."""
        client_id = instance_id("gateway-batches")
        self.producer = make_producer(self.settings, client_id=client_id)
        self.follower = make_consumer(self.settings, client_id=client_id, group_id=None)
        await self.producer.start()
        await self.follower.start()
        tps = [TopicPartition(topic, p) for topic in (self.topics.files, self.topics.jobs)
               for p in sorted(await partitions_of(self.follower, topic))]
        self.follower.assign(tps)
        await self.follower.seek_to_beginning(*tps)
        ends = await self.follower.end_offsets(tps)
        while await is_behind(self.follower, ends):
            self._apply(await self.follower.getmany(timeout_ms=200))
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        """Stop following and close the clients."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in (self.follower, self.producer):
            if client is not None:
                await client.stop()

    async def _follow(self) -> None:
        while True:
            self._apply(await self.follower.getmany(timeout_ms=500))

    def _apply(self, fetched: dict[TopicPartition, list[Any]]) -> None:
        for tp, records in fetched.items():
            for record in records:
                try:
                    if tp.topic == self.topics.files:
                        self.files.add(decode(FileChunk, record.value))
                    else:
                        self._keep(decode(BatchJob, record.value))
                except DecodeError as exc:
                    log.warning("ignored %s[%d]@%d: %s", tp.topic, tp.partition, record.offset, exc)

    def _keep(self, job: BatchJob) -> None:
        known = self.jobs.get(job.job_id)
        if known is None or job.updated_ms >= known.updated_ms:
            self.jobs[job.job_id] = job

    async def put_file(self, filename: str, purpose: str, data: bytes) -> FileChunk:
        """Store a file; returns its first chunk (the file's metadata)."""
        chunks = chunk_file(f"file-{uuid.uuid4().hex}", filename, purpose, data, now_ms())
        await write_file(self.producer, self.topics.files, chunks)
        for chunk in chunks:
            self.files.add(chunk)
        return chunks[0]

    async def create_job(self, job: BatchJob) -> None:
        """Write the job's first record, then the command that makes a runner take it."""
        await self.producer.send_and_wait(self.topics.jobs, encode(job), key=job.job_id.encode())
        self._keep(job)
        await self.command(job.job_id, "run")

    async def command(self, job_id: str, action: str) -> None:
        """Send a JobCommand to the job's runner."""
        command = JobCommand(job_id=job_id, action=action)  # type: ignore[arg-type]
        await self.producer.send_and_wait(self.topics.job_commands, encode(command), key=job_id.encode())


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


def install_batch_api(app: FastAPI, settings: GatewaySettings, guard: Guard) -> BatchStore:
    """Add the Files and Batch endpoints to `app`; the store starts and stops with the app."""
    store = BatchStore(settings)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        async with inner(a) as state:
            await store.start()
            try:
                yield state
            finally:
                await store.stop()

    app.router.lifespan_context = lifespan

    @app.post("/v1/files", tags=["batch"], summary="Upload a batch input file")
    async def create_file(request: Request) -> JSONResponse:
        guard.authenticate(dict(request.headers))
        body = await request.body()
        if len(body) > MAX_FILE_BYTES:
            raise ApiError(413, f"files are limited to {MAX_FILE_BYTES} bytes", code="request_too_large")
        fields, upload = parse_multipart(request.headers.get("content-type", ""), body)
        if fields.get("purpose") != "batch":
            raise ApiError(400, "purpose must be 'batch'", param="purpose", code="invalid_value")
        if upload is None:
            raise ApiError(400, "a 'file' part is required", param="file", code="invalid_value")
        try:
            first = await store.put_file(upload[0], "batch", upload[1])
        except UnicodeDecodeError:
            raise ApiError(400, "the file must be UTF-8 JSONL", param="file", code="invalid_file") from None
        return JSONResponse(file_object(first))

    def stored(file_id: str) -> Any:
        found = store.files.get(file_id)
        if found is None:
            raise ApiError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return found

    @app.get("/v1/files/{file_id}", tags=["batch"], summary="A file's metadata")
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        guard.authenticate(dict(request.headers))
        return JSONResponse(file_object(stored(file_id).first))

    @app.get("/v1/files/{file_id}/content", tags=["batch"], summary="A file's content")
    async def get_file_content(file_id: str, request: Request) -> Response:
        guard.authenticate(dict(request.headers))
        return Response(stored(file_id).content(), media_type="application/jsonl")

    @app.post("/v1/batches", tags=["batch"], summary="Create a batch")
    async def create_batch(request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_value")
        if body.get("endpoint") not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {list(ENDPOINTS)}", param="endpoint", code="invalid_value")
        window = body.get("completion_window")
        if window not in COMPLETION_WINDOW_MS:
            raise ApiError(400, "completion_window must be '24h'", param="completion_window", code="invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
            raise ApiError(400, "metadata is at most 16 string pairs", param="metadata", code="invalid_value")
        for model in models_in(stored(str(body.get("input_file_id"))).content()):
            guard.authorize(identity, model)  # a key limited to some models stays limited in a batch
        created = now_ms()
        job = BatchJob(job_id=f"batch_{uuid.uuid4().hex}", status="validating", endpoint=body["endpoint"],
                       input_file_id=body["input_file_id"], completion_window=window,
                       metadata={str(k): str(v) for k, v in metadata.items()} if metadata else None,
                       principal=identity.principal, tenant=identity.tenant, created_ms=created,
                       expires_ms=created + COMPLETION_WINDOW_MS[window], updated_ms=created)
        await store.create_job(job)
        return JSONResponse(batch_object(job))

    def job_of(batch_id: str, tenant: str) -> BatchJob:
        job = store.jobs.get(batch_id)
        if job is None or job.tenant != tenant:  # another tenant's batch does not exist for the caller
            raise ApiError(404, f"No batch found with id '{batch_id}'", param="batch_id", code="not_found")
        return job

    @app.get("/v1/batches/{batch_id}", tags=["batch"], summary="A batch")
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        return JSONResponse(batch_object(job_of(batch_id, identity.tenant)))

    @app.get("/v1/batches", tags=["batch"], summary="List batches, newest first")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be between 1 and 100", param="limit", code="invalid_value")
        mine = (j for j in store.jobs.values() if j.tenant == identity.tenant)
        jobs = sorted(mine, key=lambda j: (j.created_ms, j.job_id), reverse=True)
        if after is not None:
            ids = [j.job_id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        page = jobs[:limit]
        return JSONResponse({"object": "list", "data": [batch_object(j) for j in page],
                             "first_id": page[0].job_id if page else None,
                             "last_id": page[-1].job_id if page else None, "has_more": len(jobs) > limit})

    @app.post("/v1/batches/{batch_id}/cancel", tags=["batch"], summary="Cancel a batch")
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        job = job_of(batch_id, identity.tenant)
        if job.status in ("validating", "in_progress", "finalizing"):
            await store.command(batch_id, "cancel")
            # The runner writes the record; the caller sees what it will read next.
            job = job.model_copy(update={"status": "cancelling", "cancelling_ms": now_ms()})
        return JSONResponse(batch_object(job))

    return store
