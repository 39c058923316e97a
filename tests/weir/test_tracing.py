"""weir/tracing.py: context in Kafka headers, sampling, SpanRecords, and OTLP export to a local server."""

from __future__ import annotations

import http.server
import threading

import orjson
import pytest
from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import SpanKind, get_current_span

from weir.bus import BusSettings
from weir.tracing import (
    TRACEPARENTS_HEADER,
    KafkaSpanExporter,
    TraceSettings,
    Tracing,
    child_context,
    extract,
    extract_many,
    inject,
    inject_many,
    messaging,
    span_record,
    traceparent,
)

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def tracing(sample: float = 1.0, service: str = "gateway") -> Tracing:
    return Tracing(service, f"{service}-1", BusSettings(), TraceSettings(trace_sample=sample))


def span_ids(ctx: Context) -> tuple[int, int, bool]:
    sc = get_current_span(ctx).get_span_context()
    return sc.trace_id, sc.span_id, sc.trace_flags.sampled


def test_inject_then_extract_gives_back_the_span_context() -> None:
    t = tracing()
    span = t.start_span("x", None)
    headers = inject(child_context(span))
    assert [key for key, _ in headers] == ["traceparent"]
    sc = span.get_span_context()
    assert span_ids(extract(headers)) == (sc.trace_id, sc.span_id, True)
    assert traceparent(child_context(span)) == headers[0][1].decode()


@pytest.mark.parametrize(
    "value",
    [
        b"garbage",
        b"00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        b"ff-" + PARENT[3:].encode(),
        b"\xff\xfe",
        PARENT.encode() + b"x" * 10_000,
        None,
    ],
)
def test_a_malformed_traceparent_starts_a_new_trace(value: bytes | None) -> None:
    ctx = extract([("traceparent", value), ("other", b"\x00")])
    assert not get_current_span(ctx).get_span_context().is_valid
    span = tracing().start_span("x", ctx)
    assert span.get_span_context().trace_id != 0x0AF7651916CD43DD8448EB211C80319C
    assert span.get_span_context().is_valid and span.is_recording()


def test_the_parents_sampled_flag_decides_over_the_ratio() -> None:
    never, always = tracing(0.0), tracing(1.0)
    assert never.start_span("x", extract([("traceparent", PARENT.encode())])).is_recording()
    assert not always.start_span("x", extract([("traceparent", UNSAMPLED.encode())])).is_recording()
    assert not never.start_span("root", None).is_recording()
    unsampled = never.start_span("root", None)
    flags = int(inject(child_context(unsampled))[0][1].decode().rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # the decision travels on: not sampled


def test_a_child_continues_the_trace_of_its_header() -> None:
    t = tracing()
    child = t.start_span("y", extract([("traceparent", PARENT.encode())]), kind=SpanKind.CONSUMER, request_id="r1")
    child.end()
    (finished,) = t.exporter.take()
    record = span_record(finished)
    assert (record.trace_id, record.parent_span_id) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    assert (record.request_id, record.kind, record.service, record.instance) == (
        "r1",
        "consumer",
        "gateway",
        "gateway-1",
    )
    assert record.key() == f"r1/{record.span_id}"


def test_a_batch_carries_each_requests_context() -> None:
    t = tracing()
    spans = {rid: t.start_span(rid, None) for rid in ("a", "b")}
    ((key, value),) = inject_many({rid: child_context(span) for rid, span in spans.items()})
    assert key == TRACEPARENTS_HEADER
    back = extract_many([(key, value)])
    assert {rid: span_ids(ctx)[1] for rid, ctx in back.items()} == {
        rid: s.get_span_context().span_id for rid, s in spans.items()
    }
    forged = orjson.dumps({"a": "nonsense", "b": PARENT, "c": 3})
    assert list(extract_many([(TRACEPARENTS_HEADER, forged)])) == ["b"]
    for bad in (b"[1]", b"{", b"\xff", b"null"):
        assert extract_many([(TRACEPARENTS_HEADER, bad)]) == {}


def test_a_full_queue_drops_and_counts() -> None:
    exporter = KafkaSpanExporter(max_queued=2)
    t = tracing()
    spans = [t.start_span(str(i), None) for i in range(3)]
    for span in spans:
        span.end()
    exporter.export(list(t.exporter.take()))
    assert (len(exporter.queue), exporter.num_dropped) == (2, 1)


def test_span_records_hold_messaging_attributes_and_events() -> None:
    t = tracing()
    span = t.start_span(
        "weir.requests publish",
        None,
        kind=SpanKind.PRODUCER,
        attributes=messaging("send", "weir.requests", offset=7, partition=1, group="g"),
    )
    span.add_event("first_token", {"gen_ai.usage.output_tokens": 1})
    span.end()
    record = span_record(t.exporter.take()[0])
    assert record.attributes["messaging.system"] == "kafka"
    assert record.attributes["messaging.kafka.offset"] == 7
    assert record.attributes["messaging.consumer.group.name"] == "g"
    assert [e.name for e in record.events] == ["first_token"]
    assert record.parent_span_id is None and record.end_ns >= record.start_ns


def test_spans_go_over_otlp_when_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            received.append(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{server.server_port}/v1/traces")
        t = tracing(service="worker")
        assert t.otlp is not None
        t.start_span("prefill", None, request_id="r9", attributes={"gen_ai.request.model": "echo@1"}).end()
        t.provider.shutdown()  # flushes the BatchSpanProcessor
    finally:
        server.shutdown()
    request = ExportTraceServiceRequest.FromString(b"".join(received))
    (resource_spans,) = request.resource_spans
    names = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert names["service.name"] == "worker"
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == "prefill"
    assert {a.key: a.value.string_value for a in span.attributes}["weir.request_id"] == "r9"


def test_tracing_off_records_nothing_but_passes_the_context_on() -> None:
    off = Tracing.off("batcher")
    span = off.start_span("x", extract([("traceparent", PARENT.encode())]))
    assert not span.is_recording()
    assert span_ids(child_context(span))[0] == 0x0AF7651916CD43DD8448EB211C80319C
