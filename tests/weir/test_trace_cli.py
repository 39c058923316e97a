"""weir/trace_cli.py: which spans belong to a request, the tree they form, what a bad record does."""

from __future__ import annotations

import orjson
import pytest

from schemas.codec import encode
from schemas.telemetry import SpanRecord
from weir import trace_cli

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def span(span_id: str, parent: str | None, service: str, start: int, request_id: str | None = "r1", **kw) -> SpanRecord:
    return SpanRecord(
        trace_id=kw.pop("trace_id", TRACE),
        span_id=span_id * 16,
        parent_span_id=parent and parent * 16,
        name=f"{service}-{span_id}",
        service=service,
        request_id=request_id,
        start_ns=start * 1_000_000,
        end_ns=(start + 5) * 1_000_000,
        **kw,
    )


def records(*spans: SpanRecord) -> list[tuple[bytes | None, bytes | None]]:
    return [(s.key().encode(), encode(s)) for s in spans]


SPANS = [
    span("a", "f", "gateway", 0),
    span("b", "a", "batcher", 2),
    span("c", "b", "worker", 4),
    span("d", "c", "auditor", 9),
    span("e", None, "batcher", 3, request_id=None, trace_id="1" * 32, links=[f"{TRACE}/{'b' * 16}"]),
]
OTHERS = [span("9", None, "gateway", 1, request_id="r2"), span("8", None, "batcher", 1, request_id=None)]
BAD = [(b"r1/" + b"0" * 16, b"{not json"), (b"r1/x", b'{"trace_id": "zz"}'), (b"-/y", None), (None, b"{}")]


def test_a_request_s_spans_form_its_tree_with_the_linked_batch_span_under_its_link() -> None:
    spans = trace_cli.spans_of("r1", records(*SPANS, *OTHERS) + BAD)  # bad records are skipped
    assert {s.span_id[0] for s in spans} == set("abcde")
    rows = trace_cli.tree(spans)
    assert [(depth, s.span_id[0], linked) for depth, s, linked in rows] == [
        (0, "a", False),
        (1, "b", False),
        (2, "e", True),
        (2, "c", False),
        (3, "d", False),
    ]
    text = trace_cli.render(rows)
    assert text.splitlines()[1].startswith("gateway") and "+0.0 ms" in text and "(linked)" in text
    assert "5.0 ms" in text and "+9.0 ms" in text


def test_weir_trace_exits_1_when_nothing_is_found_and_prints_json_otherwise(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def read_topic(settings, topic, client_id):
        return records(*SPANS) + BAD

    monkeypatch.setattr(trace_cli, "read_topic", read_topic)
    assert trace_cli.main(["nobody"]) == 1
    assert "no spans of request 'nobody'" in capsys.readouterr().err
    assert trace_cli.main(["r1", "--json"]) == 0
    body = orjson.loads(capsys.readouterr().out)
    assert [(row["depth"], row["service"]) for row in body][:2] == [(0, "gateway"), (1, "batcher")]


def test_control_characters_in_a_span_are_printed_escaped_not_sent_to_the_terminal() -> None:
    forged = span("a", None, "gateway", 0).model_copy(update={"name": "forged \x1b[31mRED\x1b]0;pwned\x07"})
    text = trace_cli.render(trace_cli.tree([forged]))
    assert "\x1b" not in text and "\x07" not in text and "forged \\x1b[31mRED\\x1b]0;pwned\\x07" in text
