"""Traces of one service: W3C context in Kafka record headers, spans exported to the traces topic.

docs/design.md, "Observability": a trace follows the request across every Kafka hop. Each service
holds one `Tracing`: its own TracerProvider (not the global one, so tests can build several
services in one process), sampling ParentBased(TraceIdRatioBased(WEIR_TRACE_SAMPLE)): the parent's
decision when a record carries one, else the ratio. Context travels only in record headers, never
in the wire JSON: `inject` makes the `traceparent` (and `tracestate`) headers, `extract` reads them
back; a batch record also carries each of its requests' contexts (`weir-traceparents`, JSON
{request_id: traceparent}) since one batch holds many requests. A header that is malformed or
forged past reading starts a new trace: it never raises (invariant 6).

Finished spans go to a bounded in-memory queue (the hot path only appends; a full queue drops and
counts) and a task of the service's loop publishes them as SpanRecords to `<prefix>.traces` about
once a second, keyed `<request_id>/<span_id>` (compacted: a span written twice is kept once). With
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set they also go over OTLP/HTTP.
Spans hold ids, timings, sizes and model names, never raw text (invariant 7).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    StatusCode,
    Tracer,
    format_span_id,
    format_trace_id,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.codec import encode
from schemas.messages import EmbedRequest, GenerateRequest, ReplyEnd
from schemas.telemetry import SpanEvent, SpanRecord
from weir.bus import BusSettings

log = logging.getLogger(__name__)

TRACEPARENTS_HEADER = "weir-traceparents"
REQUEST_ID = "weir.request_id"  # the attribute that names a span's request (SpanRecord.request_id)
_PROPAGATOR = TraceContextTextMapPropagator()
_FIELDS = ("traceparent", "tracestate")
_MAX_TRACEPARENTS_BYTES = 1 << 20  # a batch of a thousand requests is ~80 KB of contexts
_KINDS = {
    SpanKind.INTERNAL: "internal",
    SpanKind.SERVER: "server",
    SpanKind.CLIENT: "client",
    SpanKind.PRODUCER: "producer",
    SpanKind.CONSUMER: "consumer",
}
_STATUS = {StatusCode.UNSET: "unset", StatusCode.OK: "ok", StatusCode.ERROR: "error"}

Headers = Sequence[tuple[str, bytes | None]]
Send = Callable[[str, bytes, bytes], Awaitable[Any]]  # (topic, key, value): a service's own publisher


class TraceSettings(BaseSettings):
    """Tracing settings every service shares (env: WEIR_TRACE_SAMPLE, ...)."""

    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore")

    trace_sample: float = Field(
        1.0, ge=0, le=1, description="Share of new traces recorded (a record's parent decides for its own)."
    )
    trace_kafka: bool = Field(
        True, description="Whether finished spans are published to the traces topic (`weir trace` reads it)."
    )
    trace_queue_max: int = Field(
        10_000, ge=1, description="Most finished spans waiting for export; more are dropped and counted."
    )
    trace_export_interval_s: float = Field(1.0, gt=0, description="How often queued spans are published.")


# --- context in headers ----------------------------------------------------------------------------


def inject(ctx: Context | None) -> list[tuple[str, bytes]]:
    """The Kafka headers that carry `ctx`'s span (traceparent, and tracestate when there is one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return [(key, value.encode()) for key, value in carrier.items()]


def extract(headers: Headers | None) -> Context:
    """The context a record's headers carry; an empty Context (a new trace) for a missing,
    malformed or unreadable header. Never raises."""
    carrier: dict[str, str] = {}
    for key, value in headers or ():
        if key in _FIELDS and isinstance(value, bytes):
            with contextlib.suppress(UnicodeDecodeError):
                carrier[key] = value.decode("ascii")
    return from_carrier(carrier)


def from_carrier(carrier: Mapping[str, str]) -> Context:
    """The context of a text carrier (an HTTP request's headers, lower-case names); never raises."""
    try:
        return _PROPAGATOR.extract({key: carrier[key] for key in _FIELDS if key in carrier})
    except Exception:  # noqa: BLE001 - a forged header costs its sender their trace, nothing else
        return Context()


def traceparent(ctx: Context | None) -> str | None:
    """`ctx`'s W3C traceparent, or None when it holds no valid span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent")


def inject_many(contexts: Mapping[str, Context]) -> list[tuple[str, bytes]]:
    """The `weir-traceparents` header of a batch record: each request's context by request_id."""
    parents = {rid: tp for rid, ctx in contexts.items() if (tp := traceparent(ctx)) is not None}
    return [(TRACEPARENTS_HEADER, orjson.dumps(parents))] if parents else []


def extract_many(headers: Headers | None) -> dict[str, Context]:
    """{request_id: context} from a batch record's `weir-traceparents` header; {} when it is
    missing or malformed; an entry that is no valid traceparent is left out (a new trace)."""
    raw = next((value for key, value in headers or () if key == TRACEPARENTS_HEADER), None)
    if not isinstance(raw, bytes) or len(raw) > _MAX_TRACEPARENTS_BYTES:
        return {}
    try:
        parents = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(parents, dict):
        return {}
    out: dict[str, Context] = {}
    for rid, value in parents.items():
        if isinstance(value, str) and (ctx := from_carrier({"traceparent": value})) and _has_span(ctx):
            out[rid] = ctx
    return out


def _has_span(ctx: Context) -> bool:
    return get_current_span(ctx).get_span_context().is_valid


def child_context(span: Span) -> Context:
    """A context whose parent is `span` (to inject, or to start a child span from)."""
    return set_span_in_context(span)


# --- attributes ------------------------------------------------------------------------------------


def messaging(
    operation: str,
    destination: str,
    *,
    offset: int | None = None,
    partition: int | None = None,
    group: str | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """OpenTelemetry's messaging attributes of a Kafka publish or receive/process."""
    attrs: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.operation.type": operation,
        "messaging.destination.name": destination,
    }
    if offset is not None:
        attrs["messaging.kafka.offset"] = offset
    if partition is not None:
        attrs["messaging.destination.partition.id"] = str(partition)
    if group is not None:
        attrs["messaging.consumer.group.name"] = group
    if key is not None:
        attrs["messaging.kafka.message.key"] = key
    return attrs


def request_attributes(request: GenerateRequest | EmbedRequest) -> dict[str, Any]:
    """OpenTelemetry's GenAI request attributes of a request (no text: invariant 7)."""
    if isinstance(request, EmbedRequest):
        return {"gen_ai.operation.name": "embeddings", "gen_ai.request.model": request.model}
    return {
        "gen_ai.operation.name": "chat" if request.messages is not None else "text_completion",
        "gen_ai.request.model": request.model,
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
    }


def end_attributes(end: ReplyEnd) -> dict[str, Any]:
    """The GenAI usage and outcome attributes of a request's terminal event."""
    attrs: dict[str, Any] = {
        "gen_ai.usage.input_tokens": end.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": end.usage.completion_tokens,
        "gen_ai.response.finish_reasons": [end.finish_reason],
    }
    if end.model_version is not None:
        attrs["gen_ai.response.model"] = end.model_version
    if end.error is not None:
        attrs["error.type"] = end.error.code
    return attrs


@contextlib.contextmanager
def ending(span: Span) -> Iterator[Span]:
    """Ends `span` when the block ends; an exception that leaves the block marks it an error."""
    try:
        yield span
    except BaseException as exc:
        span.set_status(StatusCode.ERROR, repr(exc)[:1024])
        raise
    finally:
        span.end()


# --- export ---------------------------------------------------------------------------------------


def span_record(span: ReadableSpan) -> SpanRecord:
    """A finished SDK span as the SpanRecord the traces topic holds (ValidationError if it cannot be one)."""
    ctx = span.context
    resource = span.resource.attributes
    attrs = {key: list(value) if isinstance(value, tuple) else value for key, value in (span.attributes or {}).items()}
    request_id = attrs.get(REQUEST_ID)
    return SpanRecord(
        trace_id=format_trace_id(ctx.trace_id),
        span_id=format_span_id(ctx.span_id),
        parent_span_id=format_span_id(span.parent.span_id)
        if span.parent is not None and span.parent.is_valid
        else None,
        name=span.name[:256],
        kind=_KINDS.get(span.kind, "internal"),
        service=str(resource.get("service.name", "")),
        instance=str(resource.get("service.instance.id", "")),
        request_id=request_id if isinstance(request_id, str) else None,
        start_ns=span.start_time or 0,
        end_ns=span.end_time or span.start_time or 0,
        status=_STATUS.get(span.status.status_code, "unset"),
        status_message=(span.status.description or "")[:1024],
        attributes=attrs,
        events=[
            SpanEvent(
                name=e.name[:128],
                time_ns=e.timestamp,
                attributes={k: list(v) if isinstance(v, tuple) else v for k, v in (e.attributes or {}).items()},
            )
            for e in span.events
        ],
        links=[
            f"{format_trace_id(link.context.trace_id)}/{format_span_id(link.context.span_id)}" for link in span.links
        ],
    )


class KafkaSpanExporter(SpanExporter):
    """Queues finished spans in memory for Tracing's publishing task (bounded: drops are counted).

    export() runs where a span ends (the service's event loop), so it only appends."""

    def __init__(self, max_queued: int) -> None:
        self.queue: deque[ReadableSpan] = deque()
        self.max_queued = max_queued
        self.num_dropped = 0
        self.num_exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        room = self.max_queued - len(self.queue)
        self.queue.extend(spans[: max(room, 0)])
        self.num_dropped += max(len(spans) - max(room, 0), 0)
        return SpanExportResult.SUCCESS

    def take(self) -> list[ReadableSpan]:
        spans = list(self.queue)
        self.queue.clear()
        return spans

    def shutdown(self) -> None:
        pass


def otlp_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP endpoint configured by OpenTelemetry's own variables, or None."""
    env = os.environ if env is None else env
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def make_span_producer(settings: BusSettings, client_id: str) -> AIOKafkaProducer:
    """The producer of spans: acks=1 and lingering, not idempotent. A span is telemetry: one lost
    when a partition leader fails costs a line of a trace, not a request (invariant 3 is about
    requests), and a span written twice is kept once (the topic is compacted by span id), so the
    request path's acks=all round trips are not worth paying for it."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=client_id,
        acks=1,
        linger_ms=100,
        request_timeout_ms=settings.producer_request_timeout_ms,
        **settings.kafka_options(),
    )


class Tracing:
    """The tracer of one service instance and its exporters (docs/design.md, "Observability")."""

    def __init__(
        self,
        service: str,
        instance: str,
        settings: BusSettings,
        trace: TraceSettings | None = None,
        *,
        sampler: Sampler | None = None,
        send: Send | None = None,
    ) -> None:
        """`send`: publish spans through the service's own client (the auditor's FastStream broker)
        instead of a span producer of this Tracing's own."""
        self.service = service
        self.instance = instance
        self.settings = settings
        self.trace = trace or TraceSettings()
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        sampler = sampler or ParentBased(TraceIdRatioBased(self.trace.trace_sample))
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        self.tracer: Tracer = self.provider.get_tracer(f"weir.{service}")
        self.exporter = KafkaSpanExporter(self.trace.trace_queue_max)
        if self.trace.trace_kafka:
            self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.otlp = otlp_endpoint()
        if self.otlp is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # The exporter reads its endpoint (and headers, timeout) from OTEL_EXPORTER_OTLP_* itself.
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self._producer: AIOKafkaProducer | None = None
        self._send = send
        self._task: asyncio.Task[None] | None = None
        self._is_stopped = False
        self.num_publish_failures = 0

    @classmethod
    def off(cls, service: str) -> Tracing:
        """A Tracing that records nothing (for handlers built without one, e.g. in unit tests):
        contexts still propagate, every span is non-recording."""
        return cls(service, "", BusSettings(), TraceSettings(trace_kafka=False), sampler=ALWAYS_OFF)

    def start_span(
        self,
        name: str,
        parent: Context | None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        request_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
        links: Iterable[Context] = (),
    ) -> Span:
        """A span under `parent` (None or an empty Context: a new trace), tagged with its request."""
        attrs = dict(attributes or {})
        if request_id is not None:
            attrs[REQUEST_ID] = request_id
        span_links = [Link(sc) for ctx in links if (sc := _span_context(ctx)) is not None]
        return self.tracer.start_span(
            name, context=parent or Context(), kind=kind, attributes=attrs, start_time=start_ns, links=span_links
        )

    async def start(self) -> None:
        """Start publishing queued spans to the traces topic (nothing to do when that is off)."""
        if not self.trace.trace_kafka or self._task is not None:
            return
        if self._send is None:
            self._producer = producer = make_span_producer(self.settings, f"{self.instance or self.service}-spans")
            await producer.start()

            async def send(topic: str, key: bytes, value: bytes) -> Any:
                return await producer.send(topic, value, key=key)  # its future: waited for below

            self._send = send
        self._task = asyncio.create_task(self._publish_every(), name=f"{self.service}-spans")

    async def stop(self) -> None:
        """Publish what is queued, then close the producer and the provider (OTLP flushes too).
        A second call does nothing."""
        if self._is_stopped:
            return
        self._is_stopped = True
        if self._task is not None:  # started: publish what is left
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.publish(), 5.0)
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        self.provider.shutdown()

    async def _publish_every(self) -> None:
        while True:
            await asyncio.sleep(self.trace.trace_export_interval_s)
            try:
                await self.publish()
            except Exception as exc:  # noqa: BLE001 - spans are best effort; the service goes on
                self.num_publish_failures += 1
                log.warning("publishing spans failed (%r); they are dropped", exc)

    async def publish(self) -> int:
        """Publish every queued span to the traces topic and wait for the broker; returns how many."""
        assert self._send is not None, "start() first"
        topic = self.settings.topics.traces
        sends = []
        for span in self.exporter.take():
            try:
                record = span_record(span)
            except ValidationError as exc:
                self.exporter.num_dropped += 1
                log.warning("span %s is no SpanRecord (%s); dropped", span.name, exc)
                continue
            sends.append(self._send(topic, record.key().encode(), encode(record)))
        # All at once: a producer's futures resolve as its batches are acknowledged.
        results = await asyncio.gather(*sends)
        await asyncio.gather(*(r for r in results if isinstance(r, asyncio.Future)))
        self.exporter.num_exported += len(sends)
        return len(sends)


def _span_context(ctx: Context) -> SpanContext | None:
    sc = get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None
