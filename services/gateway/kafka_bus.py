"""Kafka I/O of one gateway instance: the producer, the reply consumer, the heartbeat watcher.

The gateway publishes GenerateRequests and Cancellations, reads only its own reply topic
(docs/design.md, invariant 5) and watches worker heartbeats. An Exchange is one request in flight: it
hands the request's ordered, deduplicated events to the HTTP/WebSocket edge, ends the request at
its deadline when no terminal comes, and publishes a Cancellation when it is abandoned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from schemas.codec import DecodeError, decode, decode_reply, encode
from schemas.messages import (
    Cancellation,
    CancelReason,
    EmbedRequest,
    ErrorInfo,
    GenerateRequest,
    ReplyEnd,
    ReviewFlag,
    StreamRecord,
    WorkerHeartbeat,
    now_ms,
)
from services.gateway.config import GatewaySettings
from services.gateway.fleet import Fleet
from services.gateway.openai_format import ApiError
from services.gateway.queue_wait import BatchBacklog
from services.gateway.replies import ReplyItem, ReplyRouter
from weir.bus import instance_id, make_consumer, make_producer, send_dead_letter
from weir.kafka.admin import ensure_topics, wait_for_broker
from weir.tracing import (
    Tracing,
    child_context,
    end_attributes,
    ending,
    from_carrier,
    inject,
    messaging,
    request_attributes,
)

log = logging.getLogger(__name__)

SERVICE = "gateway"
_MAX_SEND_WAIT_S = 30.0


class GatewayBus:
    """Kafka clients and background loops of one gateway instance."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.gateway_id = settings.gateway_id or instance_id(SERVICE)
        self.reply_topic = self.topics.replies(self.gateway_id)
        self.router = ReplyRouter()
        self.fleet = Fleet(live_ms=int(settings.heartbeat_live_s * 1000))
        self.backlog = BatchBacklog(settings, self.fleet, settings.lag_interval_s)  # admission from the queue
        self.is_producer_started = False
        self.is_reply_assigned = False
        self.reply_position = 0  # the offset of the reply topic this instance reads next (a StreamRecord's start)
        self._producer: AIOKafkaProducer | None = None
        self._replies: AIOKafkaConsumer | None = None
        self._heartbeats: AIOKafkaConsumer | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._publishing: set[asyncio.Task[None]] = set()  # fire-and-forget cancels in flight
        self._exchanges: dict[str, Exchange] = {}
        self._is_started = False
        self.on_cancel: list[Callable[[CancelReason], None]] = []  # called per published cancel (metrics)
        self.tracing = Tracing(SERVICE, self.gateway_id, settings)

    async def start(self) -> None:
        """Create the topics, start the clients, and return once replies can be read.

        Called before the server accepts a request (by main, and by the app's lifespan), so no
        reply can be produced before this instance reads its topic. A second call does nothing.
        """
        if self._is_started:
            return
        self._is_started = True
        s = self.settings
        await wait_for_broker(s.kafka_bootstrap, timeout_s=max(s.startup_timeout_s, s.kafka_wait_s))
        await ensure_topics(s.kafka_bootstrap, [*self.topics.core_specs(), self.topics.reply_spec(self.gateway_id)])
        self._producer = make_producer(s, client_id=self.gateway_id)
        await self._producer.start()
        self.is_producer_started = True
        await self.tracing.start()

        self._replies = make_consumer(s, client_id=f"{self.gateway_id}-replies", group_id=None)
        tp = TopicPartition(self.reply_topic, 0)
        await self._replies.start()
        self._replies.assign([tp])
        await self._replies.seek_to_end(tp)
        self.reply_position = await self._replies.position(tp)  # resolve the end offset now, not at the first fetch
        self.is_reply_assigned = True

        self._heartbeats = make_consumer(s, self.topics.workers, client_id=f"{self.gateway_id}-fleet", group_id=None)
        await self._heartbeats.start()
        self._loops = [
            asyncio.create_task(self._run(self._consume_replies), name="gateway-replies"),
            asyncio.create_task(self._run(self._consume_heartbeats), name="gateway-heartbeats"),
        ]
        await self.backlog.start()  # polls in the background; admission reads its last values
        log.info("gateway %s reads replies from %s", self.gateway_id, self.reply_topic)

    async def stop(self) -> None:
        """Cancel what is still in flight (reason shutdown), flush publishes, close the clients.
        A stream registered on weir.streams is left running: its client resumes it through
        another gateway (docs/design.md, "Streams outlive their gateway")."""
        for exchange in list(self._exchanges.values()):
            exchange.close(None if exchange.is_durable else "shutdown", status="shutdown")
        if self._publishing:
            await asyncio.wait(self._publishing, timeout=5.0)
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.backlog.stop()
        self.is_reply_assigned = False
        self.is_producer_started = False
        for client in (self._replies, self._heartbeats, self._producer):
            if client is not None:
                try:
                    await client.stop()
                except Exception:  # closing anyway
                    log.exception("closing a Kafka client failed")
        await self.tracing.stop()

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): producer started, reply consumer assigned, at least one live worker."""
        if not self.is_producer_started:
            return False, "producer not started"
        if not self.is_reply_assigned:
            return False, "reply consumer not assigned"
        if any(task.done() for task in self._loops):
            return False, "a consumer loop has stopped"
        if not self.fleet.live(now_ms()):
            return False, "no live worker heartbeat"
        return True, "ready"

    async def submit(
        self,
        request: GenerateRequest | EmbedRequest,
        client_headers: Mapping[str, str] | None = None,
        route: str = "",
        stream_record: StreamRecord | None = None,
    ) -> Exchange:
        """Open the request's route, then publish it (keyed by request_id) and wait until durable.

        Its server span continues the client's `traceparent` (in `client_headers`) and ends when
        the exchange closes; the record's headers carry the publish span's context
        (docs/design.md, "Observability"). Raises ApiError(503) when Kafka does not take it;
        nothing is left registered then. A resumable stream's `stream_record` is queued on
        weir.streams just before the request, in the same producer batch, and both are durable
        before this returns: the client learns the id only once another gateway could resume it
        (docs/design.md, "Streams outlive their gateway"), at no extra round trip.
        """
        if self._producer is None or not self.is_producer_started:
            raise ApiError(503, "the gateway is not connected to Kafka yet", code="unavailable")
        queue = self.router.register(request.request_id)
        exchange = Exchange(self, request, queue)
        exchange.span = self._server_span(request, client_headers or {}, route)
        self._exchanges[request.request_id] = exchange
        timeout_s = min(_MAX_SEND_WAIT_S, max(0.1, (request.deadline_ms - now_ms()) / 1000))
        topic = self.topics.requests
        publish = self.tracing.start_span(
            f"{topic} publish",
            child_context(exchange.span),
            kind=SpanKind.PRODUCER,
            request_id=request.request_id,
            attributes=messaging("send", topic),
        )
        try:
            with ending(publish):
                sent, exchange.is_durable = await asyncio.wait_for(
                    self._send_with_record(
                        topic, encode(request), request.request_id, inject(child_context(publish)), stream_record
                    ),
                    timeout_s,
                )
                publish.set_attributes(messaging("send", topic, offset=sent.offset, partition=sent.partition))
        except (KafkaError, TimeoutError) as exc:
            if stream_record is not None:
                self.publish_stream(stream_record.request_id, None)  # nothing will run: forget it
            # A send that timed out may still land: cancel it so nothing runs for nobody.
            exchange.close(None if isinstance(exc, KafkaError) else "deadline", status=503)
            raise ApiError(503, f"the request could not be queued: {exc!r}", code="unavailable") from None
        except BaseException:
            exchange.close("client_disconnect", status="cancelled")
            raise
        return exchange

    async def _send_with_record(
        self, topic: str, value: bytes, key: str, headers: list[tuple[str, bytes]], stream_record: StreamRecord | None
    ) -> tuple[RecordMetadata, bool]:
        # Both sends are queued before either is awaited, so they leave together. Returns the
        # request's metadata and whether the record is durable: a record Kafka refused leaves a
        # stream resumable here only, never a published request unanswered.
        assert self._producer is not None
        stored = None
        if stream_record is not None:
            stored = await self._producer.send(self.topics.streams, encode(stream_record), key=key.encode())
        sent = await (await self._producer.send(topic, value, key=key.encode(), headers=headers))
        if stored is None:
            return sent, False
        try:
            await stored
        except KafkaError as exc:
            log.warning("stream record of %s not written, resumable at this gateway only: %r", key, exc)
            return sent, False
        return sent, True

    def publish_stream(self, request_id: str, record: StreamRecord | None) -> None:
        """Publish a resumable stream's StreamRecord (an update: it ended) or, with None, its
        tombstone (it can no longer be resumed), without waiting."""
        value = encode(record) if record is not None else None
        self._publish_later(self.topics.streams, value, request_id, f"stream record of {request_id}")

    def _server_span(
        self, request: GenerateRequest | EmbedRequest, client_headers: Mapping[str, str], route: str
    ) -> Span:
        """The request's HTTP server span, from its acceptance (created_ms), under the client's traceparent."""
        attrs = {"http.request.method": "POST", "http.route": route, **request_attributes(request)}
        return self.tracing.start_span(
            f"POST {route}".strip(),
            from_carrier(client_headers),
            kind=SpanKind.SERVER,
            request_id=request.request_id,
            attributes=attrs,
            start_ns=request.created_ms * 1_000_000,
        )

    def publish_cancel(self, request_id: str, reason: CancelReason) -> None:
        """Publish a Cancellation on the control topic without waiting (safe from cancelled code)."""
        if self._producer is None:
            return
        for hook in self.on_cancel:
            hook(reason)
        cancel = Cancellation(request_id=request_id, reason=reason, reply_to=self.reply_topic)
        self._publish_later(self.topics.control, encode(cancel), request_id, f"cancel of {request_id}")

    def publish_review_flag(self, flag: ReviewFlag) -> None:
        """Publish a ReviewFlag on the audit topic (keyed by principal) without waiting."""
        if self._producer is None:
            return
        self._publish_later(self.topics.audit, encode(flag), flag.principal, f"review flag of {flag.principal}")

    def _publish_later(self, topic: str, value: bytes | None, key: str, what: str) -> None:
        # Fire and forget, but tracked: stop() waits for what is still being published.
        task = asyncio.get_running_loop().create_task(self._send(topic, value, key, what))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _send(self, topic: str, value: bytes | None, key: str, what: str) -> None:
        assert self._producer is not None
        try:
            await self._producer.send_and_wait(topic, value, key=key.encode())
        except KafkaError as exc:
            log.warning("%s not published: %r", what, exc)

    def _forget(self, request_id: str) -> None:
        self.router.unregister(request_id)
        self._exchanges.pop(request_id, None)

    async def _run(self, loop_fn: Callable[[], Awaitable[None]]) -> None:
        # Keeps a consumer loop alive across unexpected errors; a cancel ends it.
        while True:
            try:
                await loop_fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must go on (STYLE: per-message failure is data)
                log.exception("gateway consumer loop failed; restarting in 1 s")
                await asyncio.sleep(1.0)

    async def _consume_replies(self) -> None:
        assert self._replies is not None and self._producer is not None
        while True:
            batches = await self._replies.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    self.reply_position = record.offset + 1
                    try:
                        event = decode_reply(record.value)
                    except DecodeError as exc:
                        await self._dead_letter(record, str(exc))
                        continue
                    self.router.on_event(event)

    async def _dead_letter(self, record: object, reason: str) -> None:
        assert self._producer is not None
        try:
            await send_dead_letter(self._producer, self.topics, record, reason, SERVICE)
        except KafkaError:
            log.exception("dead-lettering failed; dropping the record")

    async def _consume_heartbeats(self) -> None:
        # Not dead-lettered: every gateway replica reads this topic from the beginning, so each
        # would letter the same bad heartbeat again on every start. Logged instead.
        assert self._heartbeats is not None
        while True:
            batches = await self._heartbeats.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    if record.value is None:  # tombstone: the worker left
                        if isinstance(record.key, bytes):
                            self.fleet.forget(record.key.decode("utf-8", "replace"))
                        continue
                    try:
                        self.fleet.observe(decode(WorkerHeartbeat, record.value))
                    except DecodeError as exc:
                        log.warning(
                            "ignoring heartbeat %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc
                        )


class Exchange:
    """One request in flight: its events in order, its deadline, and what happens when abandoned."""

    def __init__(
        self, bus: GatewayBus, request: GenerateRequest | EmbedRequest, queue: asyncio.Queue[ReplyItem]
    ) -> None:
        self.bus = bus
        self.router = bus.router  # orders and dedupes its events (a remote resume has its own: stream_index.py)
        self.request = request
        self._queue = queue
        self.end: ReplyEnd | None = None
        self.history: list[ReplyItem] = []  # every event handed out, in order
        self._getter: asyncio.Task[ReplyItem] | None = None  # a queue.get() that outlives a cancelled reader
        self._reading = asyncio.Lock()
        self.first_token_ms: int | None = None
        self.num_deltas = 0
        self.is_closed = False
        self.is_durable = False  # registered on weir.streams: resumable through any gateway
        self.on_close: list[Callable[[Exchange], None]] = []  # called once when closed (the guard's release)
        self.span: Span = INVALID_SPAN  # its HTTP server span (GatewayBus.submit), ended by close()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def next_event(self) -> ReplyItem:
        """The next event in seq order for the one reader of this request; a ReplyEnd is the last.
        Never hangs past deadline + grace: then it returns a synthetic timeout ReplyEnd and
        publishes Cancellation(reason="deadline")."""
        return await self.event_at(len(self.history))

    async def event_at(self, index: int) -> ReplyItem:
        """The index-th event of the request (0-based), waiting for it; past the end, the terminal.

        Every event handed out stays in `history`, so any number of readers (a client that
        reconnects, while its old connection has not noticed it is gone) each read the whole
        stream from any point; a cancelled wait loses nothing.
        """
        while index >= len(self.history):
            if self.end is not None:
                return self.end
            async with self._reading:
                if index >= len(self.history) and self.end is None:
                    self._take(await self._read_next())
        return self.history[index]

    async def _read_next(self) -> ReplyItem:
        if self._getter is None and not self._queue.empty():
            return self._queue.get_nowait()  # already here: no waiter task, no timer (the hot path under load)
        s = self.bus.settings
        router = self.router
        give_up_ms = self.request.deadline_ms + int(s.reply_grace_s * 1000)
        while True:
            remaining_s = (give_up_ms - now_ms()) / 1000
            if remaining_s <= 0:
                return self._expire()
            has_gap = router.has_gap(self.request_id)
            wait_s = min(remaining_s, s.gap_timeout_s) if has_gap else remaining_s
            if self._getter is None:
                self._getter = asyncio.ensure_future(self._queue.get())
            # asyncio.wait neither cancels the getter on timeout nor when this reader is cancelled:
            # an event taken off the queue is always kept.
            done, _ = await asyncio.wait({self._getter}, timeout=wait_s)
            if not done:
                if has_gap:
                    router.skip_gap(self.request_id)
                continue
            event = self._getter.result()
            self._getter = None
            return event

    def drain(self) -> None:
        """Move the events already queued into `history` without waiting (for a stream nobody reads)."""
        if self._getter is not None and self._getter.done():
            self._take(self._getter.result())
            self._getter = None
        while self._getter is None and self.end is None and not self._queue.empty():
            self._take(self._queue.get_nowait())

    def _take(self, event: ReplyItem) -> None:
        if isinstance(event, ReplyEnd):
            self.end = event
        else:
            self.num_deltas += 1
            if self.first_token_ms is None:
                self.first_token_ms = now_ms()
                self.span.add_event("first_byte")  # handed to the client's connection now
        self.history.append(event)

    def _expire(self) -> ReplyEnd:
        self.end = ReplyEnd(
            request_id=self.request_id,
            seq=self.router.next_seq(self.request_id),
            finish_reason="timeout",
            error=ErrorInfo(code="timeout", message="no result before the request's deadline"),
        )
        self.bus.publish_cancel(self.request_id, "deadline")
        return self.end

    def close(self, abandon_reason: CancelReason | None, status: int | str) -> None:
        """Forget the request; publish a Cancellation when it has not ended (and a reason is given).

        Called exactly when the edge is done with the request: finished, failed, or its client
        went away. Logs the one line per request.
        """
        if self.is_closed:
            return
        self.is_closed = True
        if self._getter is not None:
            self._getter.cancel()
        self.bus._forget(self.request_id)
        for hook in self.on_close:
            try:
                hook(self)
            except Exception:  # closing must finish
                log.exception("an on_close hook of %s failed", self.request_id)
        outcome = self.end.finish_reason if self.end is not None else (abandon_reason or "abandoned")
        self._end_span(status, outcome)
        if self.end is None and abandon_reason is not None:
            self.bus.publish_cancel(self.request_id, abandon_reason)
        created = self.request.created_ms
        ttft = f"{self.first_token_ms - created}" if self.first_token_ms is not None else "-"
        log.info(
            "request_end request_id=%s model=%s status=%s outcome=%s ttft_ms=%s total_ms=%d deltas=%d",
            self.request_id,
            self.request.model,
            status,
            outcome,
            ttft,
            now_ms() - created,
            self.num_deltas,
        )

    def _end_span(self, status: int | str, outcome: str) -> None:
        if self.end is not None:
            self.span.set_attributes(end_attributes(self.end))
        self.span.set_attribute("weir.outcome", outcome)
        if isinstance(status, int):  # else the client left, or the gateway stopped, before an answer
            self.span.set_attribute("http.response.status_code", status)
        self.span.end()
