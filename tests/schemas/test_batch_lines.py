"""The one splitter and parser of batch lines (schemas/batch_lines.py) that the gateway and the
batcher share: JSON Lines rules (`\\n` only), every line's envelope and body."""

from __future__ import annotations

import orjson
import pytest

from schemas.batch_lines import Envelope, LineError, iter_lines, parse_envelope, parse_line_body

SEPARATORS = ["\u2028", "\u2029", "\u0085", "\x0c", "\x0b", "\x1c", "\r"]


def line(custom_id: str, content: str = "hi", **body: object) -> bytes:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": content}], **body},
        }
    )


def test_lines_end_at_newline_only_with_an_optional_carriage_return():
    data = line("a") + b"\r\n" + line("b") + b"\n\n  \n" + line("c")
    assert list(iter_lines([data])) == [(1, line("a")), (2, line("b")), (5, line("c"))]


@pytest.mark.parametrize("separator", SEPARATORS)
def test_no_other_separator_ends_a_line(separator):
    text = line("a", f"x{separator}y") + b"\n" + line("b") + separator.encode() + line("c") + b"\n"
    rows = list(iter_lines([text]))
    assert [n for n, _raw in rows] == [1, 2]
    assert rows[1][1] == line("b") + separator.encode() + line("c")
    assert str.splitlines(text.decode()) != [raw.decode() for _n, raw in rows]  # what the old runner did differs


def test_pieces_may_split_lines_and_characters_anywhere():
    data = b"".join(line(str(i), "é\u2028ü") + b"\r\n" for i in range(50))
    whole = list(iter_lines([data]))
    for size in (1, 2, 3, 7, 64, 1000):
        assert list(iter_lines(data[i : i + size] for i in range(0, len(data), size))) == whole
    assert len(whole) == 50


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{oops", "invalid_json", None),
        (b"\xff\xfe{}", "invalid_file", None),
        (b"[1]", "invalid_request", None),
        (b'{"method": "POST", "url": "/v1/completions", "body": {}}', "missing_custom_id", "custom_id"),
        (b'{"custom_id": "a", "url": "/v1/completions", "body": {}}', "duplicate_custom_id", "custom_id"),
        (b'{"custom_id": "z", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_method", "method"),
        (b'{"custom_id": "z", "url": "/v1/responses", "body": {}}', "invalid_url", "url"),
        (b'{"custom_id": "z", "url": "/v1/completions", "body": []}', "invalid_request", "body"),
        (b'{"custom_id": "z", "url": "/v1/completions", "body": {}, "extra": 1}', "unknown_parameter", "extra"),
    ],
)
def test_bad_envelopes_are_refused_with_their_line_and_reason(raw, code, param):
    with pytest.raises(LineError) as caught:
        parse_envelope(7, raw, {"a"})
    assert (caught.value.line, caught.value.code, caught.value.param) == (7, code, param)
    assert str(caught.value).startswith("line 7: ")


def test_an_envelope_names_its_request_and_the_batch_endpoint_is_enforced():
    seen: set[str] = set()
    envelope = parse_envelope(1, line("a"), seen)
    assert (envelope.custom_id, envelope.url, envelope.body["model"]) == ("a", "/v1/chat/completions", "echo")
    assert seen == {"a"}
    with pytest.raises(LineError) as caught:
        parse_envelope(2, line("b"), seen, endpoint="/v1/completions")
    assert caught.value.code == "mismatched_url"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"temperature": 9}, "invalid_value", "temperature"),
        ({"stream": True}, "invalid_value", "stream"),
        ({"timeout_s": 5}, "unsupported_parameter", "timeout_s"),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
        ({"tools": [{"type": "function"}]}, "missing_required_parameter", "tools.0.function"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "unsupported_schema",
            "response_format.json_schema.schema",
        ),
        ({"messages": []}, "invalid_value", "messages"),
    ],
)
def test_a_body_is_refused_as_its_endpoint_refuses_it(body, code, param):
    envelope = Envelope(
        3, "a", "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": "x"}], **body}
    )
    with pytest.raises(LineError) as caught:
        parse_line_body(envelope)
    assert (caught.value.line, caught.value.code, caught.value.param) == (3, code, param)


def test_a_completions_line_may_wrap_its_one_prompt_in_a_list():
    parsed = parse_line_body(Envelope(1, "a", "/v1/completions", {"model": "echo", "prompt": ["x"]}))
    assert parsed.prompts == ["x"]
