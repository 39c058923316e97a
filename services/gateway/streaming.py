"""How an Exchange's events reach a client: SSE, one JSON body, or WebSocket frames.

SSE events are `id: <seq>` + `data: <chunk JSON>`; the events after the terminal (finish chunk,
usage chunk, `[DONE]`) repeat the terminal's seq, so Last-Event-ID always names the last reply
event the client saw. A client that goes away before the terminal makes the Exchange publish
Cancellation(reason="client_disconnect"); one that finished publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketState

from schemas.messages import ReplyDelta, ReplyEnd
from services.gateway.handlers import Exchange
from services.gateway.openai_format import ApiError, ChunkWriter, Kind, completion_body, terminal_error

log = logging.getLogger("weir.gateway")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_event(seq: int, data: dict[str, Any] | str) -> bytes:
    """One SSE event: `id: <seq>` and one `data:` line (JSON never holds a raw newline)."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"id: %d\ndata: %s\n\n" % (seq, payload)


async def sse_events(exchange: Exchange, writer: ChunkWriter) -> AsyncIterator[bytes]:
    """The SSE byte stream of a request, ending with `data: [DONE]`. An error terminal becomes a
    `data: {"error": {...}}` event (what the openai client raises as APIError) before [DONE]."""
    while True:
        event = await exchange.next_event()
        if isinstance(event, ReplyDelta):
            yield sse_event(event.seq, writer.on_delta(event))
            continue
        error = terminal_error(event)
        if error is not None:
            yield sse_event(event.seq, error.body())
        else:
            for chunk in writer.on_end(event):
                yield sse_event(event.seq, chunk)
        yield sse_event(event.seq, "[DONE]")
        return


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the HTTP client goes away (call only once the request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(StreamingResponse):
    """text/event-stream that notices a client leaving even while no event is being sent.

    Starlette's StreamingResponse only notices at the next send on ASGI 2.4 servers; a request
    waiting for its first token would never learn its client left. Here the body is streamed
    while the disconnect is awaited, and `on_close` runs however it ends.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(body, status_code=200, headers={**SSE_HEADERS, **headers})
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left (ASGI 2.4 servers)
                        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                        async for chunk in self._body:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._body.aclose()  # type: ignore[attr-defined]
            self._on_close()


async def collect(exchange: Exchange, kind: Kind, created_s: int, receive: Receive) -> dict[str, Any] | None:
    """Wait for the whole result of a stream=false request; returns the OpenAI body, or None when
    the client left first (its caller then closes the Exchange with client_disconnect).

    Raises ApiError for an error terminal.
    """

    async def gather_text() -> dict[str, Any]:
        parts: list[str] = []
        while True:
            event = await exchange.next_event()
            if isinstance(event, ReplyDelta):
                parts.append(event.text)
                continue
            error = terminal_error(event)
            if error is not None:
                raise error
            return completion_body(kind, exchange.request_id, exchange.request.model, created_s, "".join(parts), event)

    result = asyncio.ensure_future(gather_text())
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (result, gone):
            task.cancel()
    if not result.done() or result.cancelled():
        return None
    return result.result()


async def collect_ends(exchanges: list[Exchange], receive: Receive) -> list[ReplyEnd] | None:
    """Wait for the terminal event of every exchange (an embedding has no deltas); returns them in
    order, or None when the client left first (the caller then closes the Exchanges).

    Raises ApiError for the first error terminal, without waiting for the others.
    """

    async def end_of(exchange: Exchange) -> ReplyEnd:
        while not isinstance(event := await exchange.next_event(), ReplyEnd):
            pass
        error = terminal_error(event)
        if error is not None:
            raise error
        return event

    ends = [asyncio.ensure_future(end_of(e)) for e in exchanges]
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        waiting = set(ends)
        while waiting:
            done, _ = await asyncio.wait(waiting | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                return None
            for finished in done:
                finished.result()  # raises an error terminal's ApiError
            waiting -= done
    finally:
        gone.cancel()
        for task in ends:
            task.cancel()
    return [task.result() for task in ends]


# ---------------------------------------------------------------------------------------------
# WebSocket: /v1/stream

Prepare = Callable[[Kind, bytes, dict[str, str]], Awaitable[tuple[Exchange, ChunkWriter]]]


class WebSocketSession:
    """One /v1/stream socket: requests run one at a time; frames are JSON text.

    Client → server: {"type": "chat.completions" | "completions", "body": {...}} and {"type": "cancel"}.
    Server → client: the chunk objects of SSE, then {"type": "done"}; {"type": "error", "error":
    {...}} for a refused request or an error terminal; {"type": "cancelled", "request_id"} after a
    cancel. The socket stays open for the next request.
    """

    def __init__(self, ws: WebSocket, prepare: Prepare) -> None:
        self.ws = ws
        self.prepare = prepare
        self._send_lock = asyncio.Lock()
        self._exchange: Exchange | None = None
        self._pump: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Serve frames until the client closes; an open request is then cancelled."""
        await self.ws.accept()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self.on_frame(message.get("text"), message.get("bytes"))
        finally:
            await self._abandon("client_disconnect")

    async def on_frame(self, text: str | None, data: bytes | None) -> None:
        """Handle one client frame: a request, a cancel, or something to refuse."""
        try:
            frame = orjson.loads(text if text is not None else data or b"")
        except orjson.JSONDecodeError:
            return await self.send_error(ApiError(400, "frames must be JSON objects", code="invalid_json"))
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind == "cancel":
            return await self.on_cancel()
        if kind not in ("chat.completions", "completions"):
            message = 'frame type must be "chat.completions", "completions" or "cancel"'
            return await self.send_error(ApiError(400, message, param="type", code="invalid_frame"))
        if self._pump is not None and not self._pump.done():
            return await self.send_error(ApiError(409, "a request is already running on this socket", code="busy"))
        try:
            exchange, writer = await self.prepare(kind, orjson.dumps(frame.get("body")), dict(self.ws.headers))
        except ApiError as error:
            return await self.send_error(error)
        self._exchange = exchange
        self._pump = asyncio.create_task(self._stream(exchange, writer))

    async def on_cancel(self) -> None:
        """Publish Cancellation(reason="user") for the running request and acknowledge it."""
        exchange = self._exchange
        if exchange is None or exchange.is_closed:
            return await self.send({"type": "cancelled", "request_id": None})
        await self._abandon("user")
        await self.send({"type": "cancelled", "request_id": exchange.request_id})

    async def _stream(self, exchange: Exchange, writer: ChunkWriter) -> None:
        while True:
            event = await exchange.next_event()
            if isinstance(event, ReplyDelta):
                await self.send(writer.on_delta(event))
                continue
            error = terminal_error(event)
            if error is not None:
                await self.send_error(error)
            else:
                for chunk in writer.on_end(event):
                    await self.send(chunk)
                await self.send({"type": "done"})
            exchange.close(None, status="ws")
            return

    async def _abandon(self, reason: str) -> None:
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
        if self._exchange is not None:
            self._exchange.close(reason, status="ws")  # type: ignore[arg-type]

    async def send(self, frame: dict[str, Any]) -> None:
        """Send one JSON text frame (serialised: the pump and the reader both send)."""
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_text(orjson.dumps(frame).decode())

    async def send_error(self, error: ApiError) -> None:
        """Send {"type": "error", "error": {...OpenAI error...}}."""
        await self.send({"type": "error", **error.body()})
