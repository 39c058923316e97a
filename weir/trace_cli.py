"""`weir trace REQUEST_ID [--json]`: one request's span tree, from the traces topic.

docs/design.md, "Observability": every service publishes its spans to the compacted
`<prefix>.traces` (SpanRecord, keyed `<request_id>/<span_id>`), so this runs on any machine that
reaches the cluster. It keeps the request's spans, and the spans of no request that link to them
(a batch's publish span: one batch, many requests), and prints them as a tree: indentation, the
service, the span's name, its duration and its start after the first span's start. A record on
the topic that is no SpanRecord is skipped. Exit 1 when the request has no span there.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterable

import orjson

from schemas.codec import DecodeError, decode
from schemas.telemetry import SpanRecord
from weir.bus import BusSettings, read_topic

NO_REQUEST = b"-/"  # the key prefix of spans of no request


def spans_of(request_id: str, records: Iterable[tuple[bytes | None, bytes | None]]) -> list[SpanRecord]:
    """The request's spans and the spans of no request linked to them, once each (skips what is no SpanRecord)."""
    own = request_id.encode() + b"/"
    mine: dict[str, SpanRecord] = {}
    loose: dict[str, SpanRecord] = {}
    for key, value in records:
        if value is None or key is None or not key.startswith((own, NO_REQUEST)):
            continue
        try:
            span = decode(SpanRecord, value)
        except DecodeError:
            continue  # a malformed or forged record harms nothing (invariant 6)
        if span.request_id == request_id and key.startswith(own):
            mine[span.span_id] = span
        elif span.request_id is None and key.startswith(NO_REQUEST):
            loose[span.span_id] = span
    ids = {f"{s.trace_id}/{s.span_id}" for s in mine.values()}
    linked = [s for s in loose.values() if ids.intersection(s.links)]
    return sorted([*mine.values(), *linked], key=lambda s: s.start_ns)


def tree(spans: list[SpanRecord]) -> list[tuple[int, SpanRecord, bool]]:
    """(depth, span, is_linked) in print order: children after their parent, by start time; a
    linked span under the first span it links to; a span whose parent is not here is a root."""
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[tuple[SpanRecord, bool]]] = {}
    for span in spans:
        parent, is_linked = span.parent_span_id, False
        if parent not in by_id:
            target = next((link.split("/", 1)[1] for link in span.links if link.split("/", 1)[1] in by_id), None)
            parent, is_linked = target, target is not None
        children.setdefault(parent if parent in by_id else None, []).append((span, is_linked))
    out: list[tuple[int, SpanRecord, bool]] = []
    seen: set[str] = set()

    def walk(parent: str | None, depth: int) -> None:
        for span, is_linked in sorted(children.get(parent, []), key=lambda c: c[0].start_ns):
            if span.span_id in seen:
                continue
            seen.add(span.span_id)
            out.append((depth, span, is_linked))
            walk(span.span_id, depth + 1)

    walk(None, 0)
    return out


def _printable(text: str) -> str:
    """`text` with control characters escaped: a span's name comes off a topic, and must not drive
    the reader's terminal (colours, its title)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def render(rows: list[tuple[int, SpanRecord, bool]]) -> str:
    """The tree as text: one line per span."""
    rows = [
        (
            depth,
            span.model_copy(
                update={
                    "name": _printable(span.name),
                    "service": _printable(span.service),
                    "status_message": _printable(span.status_message),
                }
            ),
            linked,
        )
        for depth, span, linked in rows
    ]
    origin = min(span.start_ns for _, span, _ in rows)
    width = max(len("  " * depth + span.name) for depth, span, _ in rows) + 2
    lines = [f"trace {' '.join(sorted({s.trace_id for _, s, _ in rows}))}"]
    for depth, span, is_linked in rows:
        label = "  " * depth + span.name + (" (linked)" if is_linked else "")
        duration_ms = (span.end_ns - span.start_ns) / 1e6
        status = "" if span.status != "error" else f"  ERROR {span.status_message}"
        lines.append(
            f"{span.service:<8} {label:<{width + 9}} {duration_ms:9.1f} ms  +{(span.start_ns - origin) / 1e6:.1f} ms{status}"
        )
    return "\n".join(lines)


async def collect(settings: BusSettings, request_id: str) -> list[SpanRecord]:
    return spans_of(request_id, await read_topic(settings, settings.topics.traces, client_id="weir-trace"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir trace", description="Print one request's span tree from the traces topic."
    )
    parser.add_argument("request_id", help="the request's id (x-request-id)")
    parser.add_argument("--json", action="store_true", help="the spans as JSON, in tree order, each with its depth")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (WEIR_KAFKA_BOOTSTRAP)")
    parser.add_argument("--topic-prefix", default=None, help="topic prefix (WEIR_TOPIC_PREFIX)")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `weir trace`; returns the exit status."""
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in (("kafka_bootstrap", args.bootstrap), ("topic_prefix", args.topic_prefix)) if v}
    settings = BusSettings(**overrides)
    from aiokafka.errors import KafkaError

    try:
        spans = asyncio.run(collect(settings, args.request_id))
    except (KafkaError, OSError, RuntimeError) as exc:
        print(f"weir trace: {exc}", file=sys.stderr)
        return 2
    if not spans:
        print(
            f"weir trace: no spans of request {args.request_id!r} on {settings.topics.traces} (not sampled, "
            "not exported yet: about a second, or past the topic's retention)",
            file=sys.stderr,
        )
        return 1
    rows = tree(spans)
    if args.json:
        body = [
            {"depth": depth, "linked": is_linked, **span.model_dump(mode="json")} for depth, span, is_linked in rows
        ]
        sys.stdout.buffer.write(orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
