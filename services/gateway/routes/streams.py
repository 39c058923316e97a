"""Streams a client reads over time: WS /v1/stream, and GET /v1/streams/{request_id}, which reads
a resumable SSE stream again from the Last-Event-ID the client saw (docs/gateway.md)."""

from __future__ import annotations

import re
from functools import partial

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from services.gateway.openai_format import ApiError, Kind
from services.gateway.request_limits import check_json_depth
from services.gateway.resume import StreamEntry
from services.gateway.routes.completions import new_request_id, open_exchange
from services.gateway.routes.parts import GatewayParts
from services.gateway.streaming import WebSocketSession, event_stream

_EVENT_ID = re.compile(r"-1|[0-9]{1,18}")


def add_stream_routes(router: APIRouter, parts: GatewayParts) -> None:
    """Add the WebSocket endpoint and the SSE resume endpoint to `router` (the app's)."""

    @router.websocket("/v1/stream")
    async def stream(ws: WebSocket) -> None:
        await WebSocketSession(
            ws,
            partial(prepare, parts),
            partial(resume, parts),
            parts.output_guard,
            partial(check_frame, parts),
            parts.catalog.version_tag,
            parts.guard.metrics,
        ).run()

    @router.get("/v1/streams/{request_id}")
    async def resume_stream(request_id: str, request: Request) -> Response:
        entry = await resume(parts, request_id, dict(request.headers))
        try:
            value = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
            after_seq = last_event_id(value)
        except ApiError:
            entry.leave()
            raise
        tag = parts.catalog.version_tag(entry.exchange.request.model)
        return event_stream(entry, after_seq, parts.output_guard, parts.bus.gateway_id, tag)


def check_frame(parts: GatewayParts, raw: bytes) -> None:
    """ApiError unless a WebSocket frame meets an HTTP body's limits (request_limits.py); its body
    sits one level inside the frame object."""
    if len(raw) > parts.settings.max_body_bytes:
        raise ApiError(
            413, f"frame exceeds the limit of {parts.settings.max_body_bytes} bytes", code="request_too_large"
        )
    check_json_depth(raw, parts.settings.max_json_depth + 1)


async def prepare(parts: GatewayParts, kind: Kind, raw: bytes, headers: dict[str, str]) -> StreamEntry:
    """Validate a body, publish its GenerateRequest, and register the stream (WebSocket). The
    body meets the limits of an HTTP body (request_limits.py)."""
    if len(raw) > parts.settings.max_body_bytes:
        raise ApiError(
            413, f"request body exceeds the limit of {parts.settings.max_body_bytes} bytes", code="request_too_large"
        )
    check_json_depth(raw, parts.settings.max_json_depth)
    grace_s = parts.grace_s(headers)
    exchange, writer, owner, record = await open_exchange(
        parts, kind, raw, headers, new_request_id(kind), grace_s, True
    )
    return parts.streams.add(exchange, writer.fresh, grace_s, owner, record)


async def resume(parts: GatewayParts, request_id: str, headers: dict[str, str]) -> StreamEntry:
    """A reader reconnects to a resumable stream of its own: same tenant, kind of credential and
    principal (docs/design.md, "Ownership"); anyone else's is a 404. One this gateway does not
    hold is read from Kafka, wherever it started (stream_index.py)."""
    owner = parts.guard.authenticate(headers).owner
    if request_id in parts.streams:
        entry = parts.streams.attach(request_id, owner)
    else:
        entry = await parts.remote.attach(request_id, owner)
    parts.guard.metrics.streams_resumed.add(1)
    return entry


def last_event_id(value: str | None) -> int:
    """The seq a reconnecting SSE client saw last, from Last-Event-ID (or ?last_event_id=); -1: none."""
    if value is None or value == "":
        return -1
    if not _EVENT_ID.fullmatch(value):  # ASCII digits only, and few enough for a seq (int64)
        raise ApiError(
            400,
            f"Last-Event-ID must be the id of an event of this stream, got {value[:40]!r}",
            param="Last-Event-ID",
            code="invalid_value",
        )
    return int(value)
