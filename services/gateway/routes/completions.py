"""POST /v1/chat/completions and POST /v1/completions: one JSON body, or SSE when stream=true.

A request is opened (open_exchange: credentials, body, guard, published) and then answered
whole (collect) or streamed (streaming.event_stream, resumable with a grace).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from schemas.messages import GenerateRequest, StreamRecord, now_ms
from schemas.openai_bodies import ChatCompletionBody, CompletionBody
from schemas.openai_translate import ID_PREFIX, siblings_of
from services.gateway.guard.auth import Identity, Owner
from services.gateway.guard.gate import Admitted
from services.gateway.kafka_bus import Exchange
from services.gateway.metrics import GenerationTimer
from services.gateway.openai_format import (
    ApiError,
    ChunkWriter,
    Kind,
    parse_body,
    refuse_embedding_model,
    to_generate_request,
)
from services.gateway.routes.parts import GatewayParts
from services.gateway.routes.reading import header_timeout_s, read_body
from services.gateway.siblings import SiblingGroup, Streamed
from services.gateway.stream_index import durable_record
from services.gateway.streaming import collect, event_stream, served_headers


def add_completion_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add the two completion endpoints to `router` (the app's)."""

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(parts, "chat.completions", request)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(parts, "completions", request)


async def complete(parts: GatewayParts, kind: Kind, request: Request) -> Response:
    """Open the request, then stream it (stream=true) or answer with the whole result."""
    accepted_s = time.monotonic()
    request_id = request.state.request_id = new_request_id(kind)
    raw = await read_body(request, parts.settings.max_body_bytes)
    headers = dict(request.headers)
    grace_s = parts.grace_s(headers)
    exchange, writer, owner, record = await open_exchange(parts, kind, raw, headers, request_id, grace_s)
    request.state.is_submitted = True
    is_streamed = isinstance(exchange.request, GenerateRequest) and exchange.request.stream
    timer = GenerationTimer(parts.guard.metrics, exchange.request.model, kind, accepted_s, is_streamed=is_streamed)
    if is_streamed:
        entry = parts.streams.add(exchange, writer.fresh, grace_s, owner, record)
        tag = parts.catalog.version_tag(exchange.request.model)
        return event_stream(entry, -1, parts.output_guard, parts.bus.gateway_id, tag, timer)
    return await answer(parts, kind, request, exchange, writer, timer)


async def answer(
    parts: GatewayParts,
    kind: Kind,
    request: Request,
    exchange: Streamed,
    writer: ChunkWriter,
    timer: GenerationTimer | None = None,
) -> Response:
    """The whole result of a stream=false request as one JSON body; 499 when the client left first."""
    headers = {"x-request-id": exchange.request_id}
    status: int | str = 500
    try:
        body = await collect(
            exchange,
            kind,
            writer.created_s,
            request.receive,
            parts.output_guard.text,
            timer,
            writer,
            parts.output_guard.stream,
        )
        if body is None:
            status = "client_gone"
            return Response(status_code=499, headers=headers)
        status = 200
        headers.update(served_headers(parts.catalog.version_tag(body["model"]), exchange.request))
        return JSONResponse(body, headers=headers)
    except ApiError as error:
        status = error.status
        raise
    finally:
        exchange.close("client_disconnect", status=status)


async def open_exchange(
    parts: GatewayParts,
    kind: Kind,
    raw: bytes,
    headers: dict[str, str],
    request_id: str,
    grace_s: float = 0.0,
    is_streamed: bool | None = None,
) -> tuple[Streamed, ChunkWriter, Owner, StreamRecord | None]:
    """Credentials → body → GenerateRequest → guard → published; raises ApiError for anything the
    client got wrong or may not do. Returns the caller's Owner with it: who may resume the stream.
    A body with n (or best_of) > 1 is published as sibling requests, read as one SiblingGroup.
    A stream (`is_streamed`: a WebSocket's request; None: as the body's `stream` says) asked
    with `grace_s` > 0 is registered on weir.streams with its request (the StreamRecord
    returned; stream_index.py says which streams can be)."""
    identity = parts.guard.authenticate(headers)
    body = parse_body(kind, raw)
    # the version it names or is assigned (a canary, sticky per user); the request goes out pinned to it
    model, assignment = parts.model(body.model, identity, body.user, request_id)
    parts.guard.authorize(identity, model.served_id)
    refuse_embedding_model(model)
    max_timeout_s = parts.settings.max_timeout_s
    request = to_generate_request(
        kind,
        body,
        model,
        request_id=request_id,
        reply_to=parts.bus.reply_topic,
        now_ms=now_ms(),
        client_timeout_s=header_timeout_s(headers, max_timeout_s),
        max_timeout_s=max_timeout_s,
        assignment=assignment,
    )
    request, admitted = await parts.guard.admit(identity, body, model, request, headers)
    route = f"/v1/{kind.replace('.', '/')}"
    writer = ChunkWriter.of(kind, body, request)
    exchange: Streamed
    record = None
    if body.num_siblings > 1:
        exchange = await submit_siblings(parts, identity, request, admitted, body, headers, route)
        return exchange, writer, identity.owner, record
    if body.stream if is_streamed is None else is_streamed:
        bus = parts.bus  # start_offset: where this gateway reads its replies now, at or before the first event
        record = durable_record(
            request, writer, identity.owner, grace_s, bus.gateway_id, bus.reply_topic, bus.reply_position
        )
    exchange = await submit(parts, request, admitted, headers, route, record)
    return exchange, writer, identity.owner, record if exchange.is_durable else None


async def submit(
    parts: GatewayParts,
    request: GenerateRequest,
    admitted: Admitted,
    headers: dict[str, str],
    route: str,
    record: StreamRecord | None = None,
) -> Exchange:
    """Publish one admitted request (and its StreamRecord); its admission is released when its
    Exchange closes (or now, when it could not be published)."""
    try:
        exchange = await parts.bus.submit(request, headers, route, record)
    except BaseException:
        admitted.release(None)
        raise
    admitted.attach(exchange)
    return exchange


async def submit_siblings(
    parts: GatewayParts,
    identity: Identity,
    request: GenerateRequest,
    admitted: Admitted,
    body: ChatCompletionBody | CompletionBody,
    headers: dict[str, str],
    route: str,
) -> SiblingGroup:
    """Publish the sibling requests of `request`, one per choice of `body` (n, or best_of), read as
    one SiblingGroup that keeps `n` of them (docs/design.md, "n and best_of are sibling
    requests"). Each is admitted as a request of its own: a lane ticket, and its prompt +
    max_tokens charged to the rate limits, so n does not get around a tenant's limits. A refusal
    (429/503) or a failed publish withdraws the siblings already out (Cancellation)."""
    siblings = siblings_of(body, request)  # a sibling per choice of each prompt (schemas/openai_translate.py)
    tickets = [admitted]
    exchanges: list[Exchange] = []
    try:
        for _ in siblings[1:]:
            tickets.append(parts.guard.reserve(identity, request.model, request.priority, admitted.reserved_tokens))
        for sibling, ticket in zip(siblings, tickets, strict=True):
            exchanges.append(await submit(parts, sibling, ticket, headers, route))
    except BaseException:
        for ticket in tickets[len(exchanges) :]:
            ticket.release(None)
        for exchange in exchanges:
            exchange.close("client_disconnect", status="cancelled")
        raise
    return SiblingGroup(request, exchanges, body.num_results)


def new_request_id(kind: Kind) -> str:
    """A fresh request id with OpenAI's prefix for its kind (chatcmpl-, cmpl-)."""
    return f"{ID_PREFIX[kind]}{uuid.uuid4().hex}"
