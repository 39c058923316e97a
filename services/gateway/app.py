"""Wiring of the gateway: the FastAPI app (built by `create_app`, never at import) and `main`.

Endpoints: POST /v1/chat/completions, POST /v1/completions (JSON or SSE), POST /v1/embeddings,
WS /v1/stream, GET /v1/models, GET /healthz, GET /readyz, and OpenAI's Files and Batch APIs
(batch_api.py). Every error leaves through one handler, in OpenAI's format. Kafka starts in the
lifespan, before the server accepts a connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import uvicorn
from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.messages import GenerateRequest, ReplyEnd, Usage, now_ms
from schemas.model_repo import ModelRepository, load_model_repo
from services.gateway.batch_api import install_batch_api
from services.gateway.config import GatewaySettings
from services.gateway.guard.gate import Guard
from services.gateway.openapi_doc import install_openapi
from services.gateway.handlers import Exchange, GatewayBus
from services.gateway.openai_format import (
    ApiError,
    ChunkWriter,
    Kind,
    embedding_body,
    error_body,
    error_type,
    header_seconds,
    models_list,
    parse_body,
    parse_embedding_body,
    refuse_embedding_model,
    to_embed_requests,
    to_generate_request,
    validation_error,
)
from services.gateway.guard.output_guard import OutputGuard
from services.gateway.resume import ResumableStreams, StreamEntry, resume_grace_s
from services.gateway.streaming import EventStreamResponse, WebSocketSession, collect, collect_ends, sse_events

log = logging.getLogger("weir.gateway")

_ID_PREFIX: dict[Kind, str] = {"chat.completions": "chatcmpl-", "completions": "cmpl-"}


def create_app(settings: GatewaySettings, repo: ModelRepository | None = None) -> FastAPI:
    """The gateway app for `settings`; loads the model repository now (a bad one fails here)."""
    repo = repo if repo is not None else load_model_repo(settings.model_repo)
    bus = GatewayBus(settings)
    guard = Guard(settings, bus)
    output_guard = OutputGuard(
        settings.output_guard == "redact", settings.output_holdback_chars,
        on_redacted=lambda n: guard.metrics.redactions.add(n),
    )  # fmt: skip
    streams = ResumableStreams(settings.resume_keep_s, settings.max_resumable_streams)
    started_s = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await bus.start()
        try:
            await guard.start()
            yield
        finally:
            await guard.stop()
            await bus.stop()

    app = FastAPI(title="Weir gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings, app.state.repo, app.state.bus, app.state.guard = settings, repo, bus, guard
    guard.install(app)
    app.state.batches = install_batch_api(app, settings, guard)
    for exc_class in (ApiError, StarletteHTTPException, RequestValidationError, ValidationError, Exception):
        app.add_exception_handler(exc_class, on_error)

    def grace_of(headers: dict[str, str]) -> float:
        return resume_grace_s(headers, settings.resume_grace_s, settings.max_resume_grace_s)

    async def prepare(kind: Kind, raw: bytes, headers: dict[str, str]) -> StreamEntry:
        """Validate a body, publish its GenerateRequest, and register the stream (WebSocket)."""
        grace_s = grace_of(headers)
        exchange, writer = await open_exchange(bus, guard, repo, kind, raw, headers, _new_request_id(kind))
        return streams.add(exchange, writer.fresh, grace_s)

    def resume(request_id: str, headers: dict[str, str]) -> StreamEntry:
        """A reader reconnects to a resumable stream of the same principal."""
        entry = streams.attach(request_id, guard.authenticate(headers).principal)
        guard.metrics.streams_resumed.add(1)
        return entry

    def event_stream(entry: StreamEntry, after_seq: int, headers: dict[str, str]) -> EventStreamResponse:
        text_filter = output_guard.stream()

        def on_close() -> None:
            if after_seq < 0:
                output_guard.count(text_filter.num_redacted)
            entry.leave()

        headers = {**headers, "x-request-id": entry.request_id, "x-weir-gateway": bus.gateway_id}
        if entry.is_resumable:
            headers["x-weir-resume-url"] = f"/v1/streams/{entry.request_id}"
        return EventStreamResponse(sse_events(entry.exchange, entry.new_writer(), text_filter, after_seq), on_close, headers)

    async def complete(kind: Kind, request: Request) -> Response:
        request_id = request.state.request_id = _new_request_id(kind)
        raw = await read_body(request, settings.max_body_bytes)
        grace_s = grace_of(dict(request.headers))
        exchange, writer = await open_exchange(bus, guard, repo, kind, raw, dict(request.headers), request_id)
        request.state.is_submitted = True
        headers = {"x-request-id": request_id}
        if isinstance(exchange.request, GenerateRequest) and exchange.request.stream:
            return event_stream(streams.add(exchange, writer.fresh, grace_s), -1, {})
        status: int | str = 500
        try:
            body = await collect(exchange, kind, writer.created_s, request.receive, output_guard.text)
            if body is None:
                status = "client_gone"
                return Response(status_code=499, headers=headers)
            status = 200
            return JSONResponse(body, headers=headers)
        except ApiError as error:
            status = error.status
            raise
        finally:
            exchange.close("client_disconnect", status=status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete("chat.completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete("completions", request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        request_id = request.state.request_id = f"embd-{uuid.uuid4().hex}"
        raw = await read_body(request, settings.max_body_bytes)
        headers = dict(request.headers)
        identity = guard.authenticate(headers)
        body = parse_embedding_body(raw)
        model = repo.get(body.model)
        if model is None:
            raise ApiError(404, f"The model {body.model!r} does not exist", param="model", code="model_not_found")
        guard.authorize(identity, model.name)
        embeds = to_embed_requests(
            body, model, request_id=request_id, reply_to=bus.reply_topic, now_ms=now_ms(),
            client_timeout_s=header_timeout_s(headers), max_timeout_s=settings.max_timeout_s,
            principal=identity.principal, tenant=identity.tenant,
        )  # fmt: skip
        lane, admitted = await guard.admit_embedding(identity, model, body.inputs, headers)
        exchanges: list[Exchange] = []
        status: int | str = 500
        usage: ReplyEnd | None = None  # what the reservation is corrected by, once every part ended
        try:
            for embed in embeds:  # more than one when the input exceeds what one reply can carry
                exchanges.append(await bus.submit(embed.model_copy(update={"priority": lane})))
                request.state.is_submitted = True
            ends = await collect_ends(exchanges, request.receive)
            if ends is None:
                status = "client_gone"
                return Response(status_code=499, headers={"x-request-id": request_id})
            num_tokens = sum(end.usage.prompt_tokens for end in ends)
            usage = ReplyEnd(request_id=request_id, seq=0, finish_reason="stop", usage=Usage(prompt_tokens=num_tokens))
            status = 200
            content = orjson.dumps(embedding_body(model.name, ends, body.encoding_format))
            return Response(content, media_type="application/json", headers={"x-request-id": request_id})
        except ApiError as error:
            status = error.status
            raise
        finally:
            for exchange in exchanges:
                exchange.close("client_disconnect", status=status)
            admitted.release(usage)

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket) -> None:
        await WebSocketSession(ws, prepare, resume, output_guard).run()

    @app.get("/v1/streams/{request_id}")
    async def resume_stream(request_id: str, request: Request) -> Response:
        entry = resume(request_id, dict(request.headers))
        try:
            after_seq = last_event_id(request)
        except ApiError:
            entry.leave()
            raise
        return event_stream(entry, after_seq, {})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        identity = guard.authenticate(dict(request.headers))
        listed = models_list(repo, started_s)
        listed["data"] = [m for m in listed["data"] if identity.may_use(m["id"])]
        return JSONResponse(listed)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok", "gateway_id": bus.gateway_id})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        is_ready, reason = bus.readiness()
        live = {model: len(hbs) for model, hbs in bus.fleet.live_by_model(now_ms()).items()}
        body = {"ready": is_ready, "reason": reason, "gateway_id": bus.gateway_id, "live_workers": live}
        return JSONResponse(body, status_code=200 if is_ready else 503)

    install_openapi(app)
    return app


async def open_exchange(
    bus: GatewayBus,
    guard: Guard,
    repo: ModelRepository,
    kind: Kind,
    raw: bytes,
    headers: dict[str, str],
    request_id: str,
) -> tuple[Exchange, ChunkWriter]:
    """Credentials → body → GenerateRequest → guard → published; raises ApiError for anything the
    client got wrong or may not do."""
    identity = guard.authenticate(headers)
    body = parse_body(kind, raw)
    model = repo.get(body.model)
    if model is None:
        raise ApiError(404, f"The model {body.model!r} does not exist", param="model", code="model_not_found")
    guard.authorize(identity, model.name)
    refuse_embedding_model(model)
    request = to_generate_request(
        kind,
        body,
        model,
        request_id=request_id,
        reply_to=bus.reply_topic,
        now_ms=now_ms(),
        client_timeout_s=header_timeout_s(headers),
        max_timeout_s=bus.settings.max_timeout_s,
    )
    request, admitted = await guard.admit(identity, body, model, request, headers)
    try:
        exchange = await bus.submit(request)
    except BaseException:
        admitted.release(None)
        raise
    admitted.attach(exchange)
    writer = ChunkWriter(kind, request_id, model.name, request.created_ms // 1000, body.include_usage)
    return exchange, writer


def last_event_id(request: Request) -> int:
    """The seq a reconnecting SSE client saw last: Last-Event-ID (or ?last_event_id=); -1: none."""
    value = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if value is None or value == "":
        return -1
    if not value.lstrip("-").isdigit() or int(value) < -1:
        raise ApiError(400, f"Last-Event-ID must be the id of an event of this stream, got {value!r}",
                       param="Last-Event-ID", code="invalid_value")
    return int(value)


def header_timeout_s(headers: dict[str, str]) -> float | None:
    """The client's timeout from X-Weir-Timeout-S, or None; ApiError(400) when it is not > 0."""
    return header_seconds(headers, "X-Weir-Timeout-S", lambda s: 0 < s < math.inf, "greater than 0")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or ApiError(413) as soon as it is known to exceed max_bytes."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {max_bytes} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    """The one place errors become responses: OpenAI's {"error": {...}} with a fitting status."""
    if isinstance(exc, ApiError):
        status, body = exc.status, exc.body()
    elif isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        code = "not_found" if status == 404 else "method_not_allowed" if status == 405 else None
        body = error_body(str(exc.detail), error_type(status), None, code)
    elif isinstance(exc, ValidationError):
        error = validation_error(exc)
        status, body = error.status, error.body()
    elif isinstance(exc, RequestValidationError):
        status, body = 400, error_body(str(exc.errors()[:1]), "invalid_request_error", None, "invalid_value")
    else:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        status, body = 500, error_body("internal error", "server_error", None, "internal_error")
    headers = dict(getattr(exc, "headers", None) or {})  # Retry-After, WWW-Authenticate
    request_id = getattr(request.state, "request_id", None)
    if request_id:
        headers["x-request-id"] = request_id
    if not getattr(request.state, "is_submitted", False):  # else the Exchange logs the request's end
        log.info("request_end request_id=%s path=%s status=%d code=%s",
                 request_id or "-", request.url.path, status, body["error"]["code"])
    return JSONResponse(body, status_code=status, headers=headers)


def _new_request_id(kind: Kind) -> str:
    return f"{_ID_PREFIX[kind]}{uuid.uuid4().hex}"


def main(argv: list[str]) -> int:
    """`weir gateway [--host H] [--port P] [--model-repo PATH]`: serve until interrupted.

    Returns 0 after a clean shutdown (SIGINT/SIGTERM), 3 when startup failed (Kafka unreachable,
    bad model repository, port taken).
    """
    parser = argparse.ArgumentParser(prog="weir gateway", description="Weir's OpenAI-compatible gateway")
    parser.add_argument("--host", help="bind address (WEIR_GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (WEIR_GATEWAY_PORT, default 8000)")
    parser.add_argument("--model-repo", help="model repository TOML (WEIR_MODEL_REPO)")
    parser.add_argument("--kafka-bootstrap", help="Kafka bootstrap servers (WEIR_KAFKA_BOOTSTRAP)")
    args = parser.parse_args(argv)
    overrides = {
        key: value
        for key, value in {
            "gateway_host": args.host,
            "gateway_port": args.port,
            "model_repo": args.model_repo,
            "kafka_bootstrap": args.kafka_bootstrap,
        }.items()
        if value is not None
    }
    settings = GatewaySettings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app = create_app(settings)
    except ValueError as exc:  # ModelRepoError names the entry and the fix
        log.error("gateway cannot start: %s", exc)
        return 3
    config = uvicorn.Config(
        app, host=settings.gateway_host, port=settings.gateway_port, log_level=settings.log_level.lower(),
        access_log=False, timeout_graceful_shutdown=10, ws_max_size=settings.max_body_bytes + 1024,
    )
    return asyncio.run(_serve(app.state.bus, uvicorn.Server(config)))


async def _serve(bus: GatewayBus, server: uvicorn.Server) -> int:
    # Kafka first, outside uvicorn's lifespan: a broker that is not there is one clear log line
    # and exit code 3, not a traceback; the lifespan's own start() then finds it started.
    try:
        await bus.start()
    except (KafkaError, OSError, TimeoutError) as exc:
        log.error("gateway cannot start: Kafka at %s: %s; is Kafka up? (weir kafka up)",
                  bus.settings.kafka_bootstrap, exc)
        await bus.stop()
        return 3
    # SIGTERM/SIGINT end the server gracefully and main returns 0 (uvicorn's own handling would
    # re-raise the signal after shutdown, so a supervisor would see death by signal).
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits this way when binding or the lifespan fails
        log.error("gateway did not start (exit %s)", exc.code)
        await bus.stop()
        return 3
    return 0
