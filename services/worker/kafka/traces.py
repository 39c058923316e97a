"""The worker's spans of one request (docs/design.md, "Observability").

A request's run here is one consumer span, `<batch topic> process`, under the context its batch
record carried for it (`weir-traceparents`; none: a new trace), linked to the batch's publish
span. It ends with the run's final output, with three children made from the engine's own
timings: `queue wait` (read from the batch until the engine took it), `prefill` (until the first
token: includes the engine's wait for a slot, which it does not time apart) and `decode` (until
the end), and a `first_token` event. Its context goes in the headers of the reply records that
need it (the first delta and the end: per-token headers would cost every token; measured on the
2-core test machine, a traceparent header took aiokafka's send from ~30 to ~33-40 us of client CPU
per delta-sized record) and of the audit record, so the gateway and the auditor continue the trace.
"""

from __future__ import annotations

from aiokafka import ConsumerRecord
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from schemas.messages import EmbedRequest, GenerateRequest, ReplyDelta, ReplyEnd
from services.worker.engine import EngineOutput
from weir.tracing import Tracing, child_context, inject, messaging, request_attributes

_MS = 1_000_000  # ns per ms


def process_span(
    tracing: Tracing,
    record: ConsumerRecord,
    request: GenerateRequest | EmbedRequest,
    batch_id: str,
    parent: Context | None,
    batch: Context | None,
    group: str,
) -> Span:
    """The request's run here, from now (its batch was read) to its final output."""
    attrs = {
        **messaging("process", record.topic, offset=record.offset, partition=record.partition, group=group),
        **request_attributes(request),
        "weir.batch_id": batch_id,
    }
    return tracing.start_span(
        f"{record.topic} process",
        parent,
        kind=SpanKind.CONSUMER,
        request_id=request.request_id,
        attributes=attrs,
        links=[batch] if batch is not None else [],
    )


def reply_headers(span: Span, event: ReplyDelta | ReplyEnd) -> list[tuple[str, bytes]] | None:
    """The trace headers of a reply record: on its first event (seq 0) and its end only."""
    if event.seq == 0 or isinstance(event, ReplyEnd):
        return inject(child_context(span))
    return None


def end_run(tracing: Tracing, span: Span, out: EngineOutput, model_version: str) -> None:
    """End the run's span at its final output, with its phases as children and its token usage."""
    if not span.is_recording():
        span.end()
        return
    start_ns = getattr(span, "start_time", None) or 0
    ctx = child_context(span)
    rid = out.request_id
    marks = [
        start_ns,
        *(max(ms * _MS, start_ns) for ms in (out.received_ms, out.first_token_ms, out.finished_ms) if ms is not None),
    ]
    names = ["queue wait", "prefill", "decode"] if out.first_token_ms is not None else ["queue wait", "run"]
    for name, begin, end in zip(names, marks, marks[1:], strict=False):  # a mark may be missing: fewer spans
        tracing.start_span(name, ctx, request_id=rid, start_ns=begin).end(end_time=max(end, begin))
    if out.first_token_ms is not None:
        span.add_event("first_token", timestamp=max(out.first_token_ms * _MS, start_ns))
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": out.prompt_tokens,
            "gen_ai.usage.output_tokens": out.completion_tokens,
            "gen_ai.response.model": model_version,
            "gen_ai.response.finish_reasons": [out.finish_reason or "error"],
        }
    )
    if out.error is not None:
        span.set_attribute("error.type", out.error.code)
    span.end()
