"""How an Exchange's events reach a client: SSE, one JSON body, or WebSocket frames.

SSE events are `id: <seq>` + `data: <chunk JSON>`: a delta's seq is the position (token index) of
its first token as the ReplyRouter delivered it (cut to the positions not delivered before, so
ids only grow however a worker coalesced), the terminal's the position after the last; the events
after the terminal (finish chunk, usage chunk, `[DONE]`) repeat the terminal's seq, so
Last-Event-ID always names the last reply event the client saw, and GET /v1/streams/{id} with it
sends what came after. The delivered events are a function of the reply topic's records in order,
so any gateway that renders the stream again (stream_index.py) gives the same ids. Text goes through
the output guard (guard/output_guard.py) on its way out. A client that goes away before the
terminal leaves the stream (resume.py): it is cancelled at once
(Cancellation(reason="client_disconnect")) or, when asked with a resume grace, held for a
reconnect; one that finished publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketState

from schemas.messages import EmbedRequest, GenerateRequest, ReplyDelta, ReplyEnd, TokenLogprob, ToolCallDelta
from services.gateway.guard.output_guard import LogprobGate, OutputGuard, TextFilter
from services.gateway.kafka_bus import Exchange
from services.gateway.metrics import GatewayMetrics, GenerationTimer
from services.gateway.openai_format import (
    ApiError,
    ChoiceResult,
    ChunkWriter,
    Kind,
    best_of,
    choice_results,
    choices_body,
    choices_usage,
    guarded_calls,
    terminal_error,
)
from services.gateway.replies import ReplyItem
from services.gateway.resume import RESUME_GRACE_HEADER, StreamEntry
from services.gateway.siblings import SiblingGroup, Streamed

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# `name@version:<manifest digest prefix>` of the version that serves a response (catalog.py:
# Catalog.version_tag); a WebSocket has no headers per request: its first chunk frame carries it.
VERSION_HEADER = "x-weir-model-version"
WS_VERSION_FIELD = "weir_model_version"
# How that version was chosen (default, canary, pinned: docs/design.md, "Traffic policies"); the
# same first WebSocket frame carries it.
ASSIGNMENT_HEADER = "x-weir-assignment"
WS_ASSIGNMENT_FIELD = "weir_assignment"


def served_headers(version_tag: str, request: GenerateRequest | EmbedRequest) -> dict[str, str]:
    """The headers that name the version serving `request` and how it was assigned."""
    headers = {VERSION_HEADER: version_tag}
    if request.assignment is not None:
        headers[ASSIGNMENT_HEADER] = request.assignment
    return headers


def sse_event(seq: int, data: dict[str, Any] | str) -> bytes:
    """One SSE event: `id: <seq>` and one `data:` line (JSON never holds a raw newline)."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"id: %d\ndata: %s\n\n" % (seq, payload)


Frame = dict[str, Any] | ApiError  # a chunk, or the error of an error terminal


class ChoiceFilters:
    """The output guard's filter of each choice of a stream: a filter holds back the text of one
    output, so the n choices of a request (siblings) each have their own."""

    def __init__(self, first: TextFilter, new_filter: Callable[[], TextFilter] | None = None) -> None:
        self._filters = {0: first}
        self._new_filter = new_filter
        self._outputs: dict[int, GuardedOutput] = {}

    @classmethod
    def of_guard(cls, output_guard: OutputGuard) -> ChoiceFilters:
        return cls(output_guard.stream(), output_guard.stream)

    def of(self, index: int) -> TextFilter:
        if index not in self._filters:
            if self._new_filter is None:
                raise ValueError("a stream of several choices needs a filter per choice")
            self._filters[index] = self._new_filter()
        return self._filters[index]

    def output(self, index: int, writer: ChunkWriter) -> GuardedOutput:
        """Choice `index`'s output through its filter on the way to `writer`'s chunks."""
        if index not in self._outputs:
            self._outputs[index] = GuardedOutput(writer, LogprobGate(self.of(index)), index)
        return self._outputs[index]

    @property
    def num_redacted(self) -> int:
        return sum(f.num_redacted for f in self._filters.values())


async def tagged_events(exchange: Streamed) -> AsyncIterator[tuple[int, int, ReplyItem]]:
    """(id, choice index, event) of a stream from its start: an Exchange's seq and choice 0, or a
    SiblingGroup's position in its merged stream and the sibling's choice."""
    if isinstance(exchange, SiblingGroup):
        async for tagged in exchange.tagged():
            yield tagged
        return
    index = 0
    while True:
        event = await exchange.event_at(index)
        index += 1
        yield event.seq, 0, event
        if isinstance(event, ReplyEnd):
            return


def num_choices_of(exchange: Streamed) -> int:
    """The sibling requests whose terminal ends the stream (1 for one request)."""
    return exchange.size if isinstance(exchange, SiblingGroup) else 1


async def frames(
    exchange: Streamed,
    writer: ChunkWriter,
    text_filter: TextFilter | ChoiceFilters,
    timer: GenerationTimer | None = None,
) -> AsyncIterator[tuple[int, Frame]]:
    """The frames of a stream from its start, each with the seq of the event that released it
    (for siblings: the event's position in their merged stream).

    Deterministic in the events: a reader that reconnects renders the same frames again (fresh
    writer and filter) and skips those it already had. Text the output guard holds back goes
    out with a later delta or, at the end of its choice, before the finish chunk (tool-call
    arguments likewise); a delta that releases nothing gives no frame. Each choice ends with its
    finish chunk; after the last, the usage chunk (include_usage). An error terminal of any
    choice ends the stream with its error.

    `timer` (the first reader's only) learns of each content frame once its reader asks for
    the next frame, i.e. once the frame was written; of the terminal when it is reached.
    """
    filters = text_filter if isinstance(text_filter, ChoiceFilters) else ChoiceFilters(text_filter)
    ends: dict[int, ReplyEnd] = {}
    num_choices = num_choices_of(exchange)
    async for seq, choice, event in tagged_events(exchange):
        for chunk in writer.on_start(choice):
            yield seq, chunk
        output = filters.output(choice, writer)
        for chunk in output.on_delta(event) if isinstance(event, ReplyDelta) else output.flush():
            yield seq, chunk
            if timer is not None:
                timer.on_content()
        if isinstance(event, ReplyDelta):
            continue
        error = terminal_error(event)
        if error is not None:
            if timer is not None:
                timer.on_end(event, error.code or "unknown")
            yield seq, error
            return
        ends[choice] = event
        if len(ends) < num_choices:
            yield seq, writer.on_finish(event, choice)
            continue
        num_prompts = writer.body.num_prompts if writer.body is not None else 1
        usage = event.usage if num_choices == 1 else choices_usage([ends[i] for i in sorted(ends)], num_prompts)
        if timer is not None:
            timer.on_end(event if num_choices == 1 else event.model_copy(update={"usage": usage}), None)
        yield seq, writer.on_finish(event, choice)
        for chunk in writer.on_usage(usage):
            yield seq, chunk
        return


class GuardedOutput:
    """One choice's model output, text and tool-call arguments alike, through its output guard
    filter on the way to chunks: tool-call arguments are model output too, so they are redacted
    as text is, and the text's logprobs go out with the text they stand for (LogprobGate). The
    filter is flushed at each switch between the text and a call (or between calls), so what it
    holds back never moves from one into another."""

    def __init__(self, writer: ChunkWriter, gate: LogprobGate, index: int = 0) -> None:
        self.writer = writer
        self.gate = gate
        self.index = index  # the choice
        self._channel: int | None = None  # what the filter holds: None the text, else a call's index

    def on_delta(self, event: ReplyDelta) -> list[dict[str, Any]]:
        """The chunks a delta releases (none while the guard holds all it brought)."""
        chunks = []
        logprobs = event.logprobs if self.writer.logprobs is not None else None
        if event.text or logprobs:
            chunks += self._switch(None)
            text, released = self.gate.feed(event.text, logprobs)
            if text or released:
                chunks.append(self.writer.on_text(text, self.index, released or None))
        for piece in event.tool_calls or []:
            chunks += self._switch(piece.index)
            arguments = self.gate.filter.feed(piece.arguments)
            if arguments or piece.id is not None or piece.name is not None:  # a call's first piece always goes out
                chunks.append(self.writer.on_tool_call(piece.model_copy(update={"arguments": arguments}), self.index))
        return chunks

    def flush(self) -> list[dict[str, Any]]:
        """The chunks of what the filter still holds (and the logprobs not yet sent), at the end
        of the choice or at a switch."""
        rest, released = self.gate.flush()
        chunks = []
        if rest and self._channel is not None:
            chunks.append(self.writer.on_tool_call(ToolCallDelta(index=self._channel, arguments=rest), self.index))
            rest = ""
        if rest or released:
            chunks.append(self.writer.on_text(rest, self.index, released or None))
        return chunks

    def _switch(self, channel: int | None) -> list[dict[str, Any]]:
        if channel == self._channel:
            return []
        chunks = self.flush()
        self._channel = channel
        return chunks


async def sse_events(
    exchange: Streamed,
    writer: ChunkWriter,
    text_filter: TextFilter | ChoiceFilters,
    after_seq: int = -1,
    timer: GenerationTimer | None = None,
) -> AsyncIterator[bytes]:
    """The SSE byte stream of a request, ending with `data: [DONE]`; only the events after
    `after_seq` (a reconnecting client's Last-Event-ID). An error terminal becomes a
    `data: {"error": {...}}` event (what the openai client raises as APIError) before [DONE]."""
    seq = after_seq
    async for seq, frame in frames(exchange, writer, text_filter, timer):
        if seq > after_seq:
            yield sse_event(seq, frame.body() if isinstance(frame, ApiError) else frame)
    yield sse_event(max(seq, after_seq), "[DONE]")


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
                await self._body.aclose()  # type: ignore[attr-defined]  # an async generator, typed as its iterator
            self._on_close()


def event_stream(
    entry: StreamEntry,
    after_seq: int,
    output_guard: OutputGuard,
    gateway_id: str,
    version_tag: str,
    timer: GenerationTimer | None = None,
) -> EventStreamResponse:
    """The SSE response of a registered stream from after `after_seq` (-1: its first reader), with
    the x-weir-model-version `version_tag` of the version it is pinned to and its x-weir-assignment.

    The first reader counts the redactions of its text filter when it closes, and is the one
    `timer` times; every reader leaves the entry then (a resumable one is held for a reconnect)."""
    if timer is not None and after_seq >= 0:
        raise ValueError("only a stream's first reader is timed")
    text_filter = ChoiceFilters.of_guard(output_guard)

    def on_close() -> None:
        if after_seq < 0:
            output_guard.count(text_filter.num_redacted)
        entry.leave()

    headers = {
        **stream_headers(entry.request_id, gateway_id, entry.is_resumable),
        **served_headers(version_tag, entry.exchange.request),
    }
    events = sse_events(entry.exchange, entry.new_writer(), text_filter, after_seq, timer)
    return EventStreamResponse(events, on_close, headers)


def stream_headers(request_id: str, gateway_id: str, is_resumable: bool) -> dict[str, str]:
    """Headers of an SSE response: the request and gateway it belongs to, and where a resumable
    stream is read again (GET /v1/streams/{request_id})."""
    headers = {"x-request-id": request_id, "x-weir-gateway": gateway_id}
    if is_resumable:
        headers["x-weir-resume-url"] = f"/v1/streams/{request_id}"
    return headers


async def collect(
    exchange: Streamed,
    kind: Kind,
    created_s: int,
    receive: Receive,
    guard_text: Callable[[str], str],
    timer: GenerationTimer | None = None,
    writer: ChunkWriter | None = None,
    new_filter: Callable[[], TextFilter] | None = None,
) -> dict[str, Any] | None:
    """Wait for the whole result of a stream=false request; returns the OpenAI body (each
    choice's text and tool-call arguments passed through `guard_text`; logprobs and echo as `writer` renders them), or
    None when the client left first (its caller then closes the Exchange, or the siblings, with
    client_disconnect). Siblings give a choice each; best_of keeps the group's num_choices with
    the highest cumulative logprob. `timer` learns of each delta with tokens and of the terminal
    when they arrive (a JSON body's TTFT and inter-token latency: metrics.py). Logprobs pass
    a LogprobGate on a fresh filter of `new_filter` (the output guard's): the tokens of what
    `guard_text` redacts are masked as in a stream.

    Raises ApiError for an error terminal (of any sibling: the request fails as a whole).
    """

    async def gather() -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        gates: dict[int, LogprobGate] = {}
        ends: dict[int, ReplyEnd] = {}
        num_siblings = num_choices_of(exchange)
        async for _, choice, event in tagged_events(exchange):
            if isinstance(event, ReplyDelta):
                if timer is not None and (event.token_ids or event.text or event.tool_calls):
                    timer.on_content()  # its first token, and the gaps after it, as they reach this gateway
                texts.setdefault(choice, []).append(event.text)
                if new_filter is None:
                    logprobs.setdefault(choice, []).extend(event.logprobs or [])
                else:
                    gate = gates.setdefault(choice, LogprobGate(new_filter()))
                    logprobs.setdefault(choice, []).extend(gate.feed(event.text, event.logprobs)[1])
                continue
            error = terminal_error(event)
            if error is not None:
                if timer is not None:
                    timer.on_end(event, error.code or "unknown")
                raise error
            ends[choice] = event
            if len(ends) == num_siblings:
                break
        for choice, gate in gates.items():
            logprobs[choice].extend(gate.flush()[1])
        body = writer.body if writer is not None else None
        ordered = [ends[i] for i in range(num_siblings)]
        usage = choices_usage(ordered, body.num_prompts if body is not None else 1)
        if timer is not None:
            timer.on_end(ends[num_siblings - 1].model_copy(update={"usage": usage}), None)
        asked = writer is not None and writer.logprobs is not None
        joined = ["".join(texts.get(i, [])) for i in range(num_siblings)]
        kept = [logprobs.get(i, []) for i in range(num_siblings)] if asked else None
        if body is not None:  # the translator's choices (schemas/openai_translate.py), as a batch line gets them
            results = choice_results(body, joined, ordered, kept)
        else:
            results = [
                ChoiceResult(i, joined[i], ordered[i], kept[i] if kept else None, ordered[i].tool_calls)
                for i in range(num_siblings)
            ]
        for r in results:  # model output passes the output guard: text and tool-call arguments
            r.text, r.tool_calls = guard_text(r.text), guarded_calls(r.tool_calls, guard_text)
        keep = exchange.num_choices if isinstance(exchange, SiblingGroup) else 1
        return choices_body(
            kind,
            exchange.request_id,
            exchange.request.model,
            created_s,
            best_of(results, keep),
            usage,
            writer.logprobs if writer else None,
            writer.echo if writer else None,
        )

    result = asyncio.ensure_future(gather())
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

Prepare = Callable[[Kind, bytes, dict[str, str]], Awaitable[StreamEntry]]
Resume = Callable[[str, dict[str, str]], Awaitable[StreamEntry]]


class WebSocketSession:
    """One /v1/stream socket: requests run one at a time; frames are JSON text.

    Client → server: {"type": "chat.completions" | "completions", "body": {...}, "resume_grace_s":
    optional}; {"type": "cancel"}; {"type": "resume", "request_id": ..., "offset": N} to read a
    resumable request again after its first N chunk frames. Server → client: the chunk objects of
    SSE (the first one sent for a request also has "weir_model_version" and "weir_assignment": what
    the x-weir-model-version and x-weir-assignment headers say over HTTP), then {"type": "done"};
    {"type": "error", "error": {...}} for a refused request or an error terminal; {"type":
    "cancelled", "request_id"} after a cancel. The socket stays open for the next request.
    """

    def __init__(
        self,
        ws: WebSocket,
        prepare: Prepare,
        resume: Resume,
        output_guard: OutputGuard,
        check_frame: Callable[[bytes], None],
        version_tag: Callable[[str], str],
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.ws = ws
        self.metrics = metrics  # times each request's generation (not a resumed one's)
        self.version_tag = version_tag
        self.prepare = prepare
        self.check_frame = check_frame
        self.resume = resume
        self.output_guard = output_guard
        self._send_lock = asyncio.Lock()
        self._entry: StreamEntry | None = None  # the stream this socket reads, until it detaches
        self._pump: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Serve frames until the client closes; an open request is then left (held when resumable)."""
        await self.ws.accept()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self.on_frame(message.get("text"), message.get("bytes"))
        finally:
            await self._stop_pump()
            self._detach()

    async def on_frame(self, text: str | None, data: bytes | None) -> None:
        """Handle one client frame: a request, a cancel, a resume, or something to refuse."""
        accepted_s = time.monotonic()
        raw = text.encode() if text is not None else data or b""
        try:
            self.check_frame(raw)  # before parsing: a frame nested past orjson's limits would raise
            frame = orjson.loads(raw)
        except ApiError as error:
            return await self.send_error(error)
        except orjson.JSONDecodeError:
            return await self.send_error(ApiError(400, "frames must be JSON objects", code="invalid_json"))
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind == "cancel":
            return await self.on_cancel()
        if kind not in ("chat.completions", "completions", "resume"):
            message = 'frame type must be "chat.completions", "completions", "resume" or "cancel"'
            return await self.send_error(ApiError(400, message, param="type", code="invalid_frame"))
        if self._pump is not None and not self._pump.done():
            return await self.send_error(ApiError(409, "a request is already running on this socket", code="busy"))
        headers = dict(self.ws.headers)
        try:
            if kind == "resume":
                request_id, offset = _resume_frame(frame)
                entry = await self.resume(request_id, headers)
            else:
                if "resume_grace_s" in frame:
                    headers[RESUME_GRACE_HEADER] = str(frame["resume_grace_s"])
                entry, offset = await self.prepare(kind, orjson.dumps(frame.get("body")), headers), 0
        except ApiError as error:
            return await self.send_error(error)
        self._entry = entry
        timer = None
        if kind != "resume" and self.metrics is not None:
            timer = GenerationTimer(self.metrics, entry.exchange.request.model, kind, accepted_s)
        self._pump = asyncio.create_task(self._stream(entry, offset, timer))

    async def on_cancel(self) -> None:
        """Publish Cancellation(reason="user") for the running request and acknowledge it."""
        entry = self._entry
        if entry is None or entry.exchange.is_closed:
            return await self.send({"type": "cancelled", "request_id": None})
        await self._stop_pump()
        self._entry = None
        entry.cancel("user")
        await self.send({"type": "cancelled", "request_id": entry.request_id})

    async def _stream(self, entry: StreamEntry, offset: int, timer: GenerationTimer | None) -> None:
        # offset: the chunk frames this client already has (a resume); they are rendered, not sent.
        text_filter = ChoiceFilters.of_guard(self.output_guard)
        num_frames = 0
        request = entry.exchange.request
        fields = {WS_VERSION_FIELD: self.version_tag(request.model), WS_ASSIGNMENT_FIELD: request.assignment}
        first: dict[str, Any] | None = {key: value for key, value in fields.items() if value is not None}
        async for _, frame in frames(entry.exchange, entry.new_writer(), text_filter, timer):
            num_frames += 1
            if num_frames <= offset:
                continue
            if isinstance(frame, ApiError):
                await self.send_error(frame)
                break
            if first is not None:
                frame, first = {**frame, **first}, None
            await self.send(frame)
        else:
            await self.send({"type": "done"})
        if offset == 0:
            self.output_guard.count(text_filter.num_redacted)
        self._detach()

    async def _stop_pump(self) -> None:
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump

    def _detach(self) -> None:
        if self._entry is not None:
            entry, self._entry = self._entry, None
            entry.leave()

    async def send(self, frame: dict[str, Any]) -> None:
        """Send one JSON text frame (serialised: the pump and the reader both send)."""
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_text(orjson.dumps(frame).decode())

    async def send_error(self, error: ApiError) -> None:
        """Send {"type": "error", "error": {...OpenAI error...}}."""
        await self.send({"type": "error", **error.body()})


def _resume_frame(frame: dict[str, Any]) -> tuple[str, int]:
    request_id, offset = frame.get("request_id"), frame.get("offset", 0)
    if not isinstance(request_id, str) or not request_id:
        raise ApiError(
            400, "a resume frame needs the request_id of the stream", param="request_id", code="invalid_value"
        )
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ApiError(
            400,
            "offset must be the number of chunk frames already received (>= 0)",
            param="offset",
            code="invalid_value",
        )
    return request_id, offset
