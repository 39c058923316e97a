"""The lines of a batch input file: one splitter and one parser, shared by the gateway (which
checks every line of an upload and of a new batch) and the batcher's job runner (which runs them),
so both see the same lines (docs/design.md, "Batch files").

A file is JSON Lines: lines end at `\\n` only; an `\\r` before it is dropped. Nothing else ends a
line: U+2028, U+2029, U+0085, form feed or a lone `\\r` are characters of the line they are in
(inside a JSON string they are text; outside one the line is not JSON). A line that is empty or
only JSON whitespace is skipped, but still counts for the numbers (1-based) errors name.

Each line is `{"custom_id", "method": "POST", "url", "body"}`; its body is checked by the same
code as the endpoint it names over HTTP (schemas/openai_bodies.py), plus what a batch line may
not ask for (`stream`, `timeout_s`). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from schemas.openai_bodies import BodyError, ChatCompletionBody, CompletionBody, parse_body
from schemas.openai_translate import EmbeddingBody, parse_embedding_body

# The endpoints a batch line may name, and the kind of body each takes (OpenAI's Batch API also
# takes /v1/embeddings; its lines run as EmbedRequests, answered with the embedding list)
ENDPOINT_KINDS: dict[str, str] = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
LineBody = ChatCompletionBody | CompletionBody | EmbeddingBody
MAX_BATCH_LINES = 50_000  # OpenAI's limit of requests per batch
_JSON_WHITESPACE = b" \t\r"


class LineError(ValueError):
    """A line Weir refuses: its number, OpenAI's code, a message and the field at fault."""

    def __init__(self, line: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Envelope:
    """A line that names its request: custom_id, url and the raw body object."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def iter_lines(pieces: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of every non-blank line of a file given as consecutive byte pieces (the
    whole file, or blocks read from disk or Kafka): split at b"\\n" only, one b"\\r" before it
    dropped. Holds one line at a time, plus one piece."""
    number = 0
    rest = b""
    for piece in pieces:
        if not piece:
            continue
        data = rest + piece
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            number += 1
            line = data[start:end]
            if line.strip(_JSON_WHITESPACE):
                yield number, line.removesuffix(b"\r")
            start = end + 1
        rest = data[start:]
    if rest.strip(_JSON_WHITESPACE):
        yield number + 1, rest.removesuffix(b"\r")


def parse_envelope(number: int, raw: bytes, seen: set[str], endpoint: str | None = None) -> Envelope:
    """The envelope of line `number`; LineError when it is not UTF-8 JSON, not an object, has no
    custom_id or one `seen` before (then added to `seen`), a method other than POST, a url that
    is not a batch endpoint (or not `endpoint`, when given), or a body that is not an object."""
    try:
        raw.decode("utf-8")
        row = orjson.loads(raw)
    except UnicodeDecodeError:
        raise LineError(number, "invalid_file", "the line is not UTF-8") from None
    except orjson.JSONDecodeError as exc:
        raise LineError(number, "invalid_json", f"the line is not JSON: {exc.msg} at character {exc.pos + 1}") from None
    if not isinstance(row, dict):
        raise LineError(number, "invalid_request", "a line must be a JSON object")
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(number, "missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise LineError(number, "duplicate_custom_id", f"custom_id {custom_id!r} repeats an earlier line", "custom_id")
    seen.add(custom_id)
    unknown = sorted(set(row) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(number, "unknown_parameter", f"unrecognized field {unknown[0]!r} in a batch line", unknown[0])
    if row.get("method", "POST") != "POST":
        raise LineError(number, "invalid_method", "method must be POST", "method")
    url = row.get("url")
    if url not in ENDPOINT_KINDS:
        raise LineError(number, "invalid_url", f"url {url!r} is not one of {sorted(ENDPOINT_KINDS)}", "url")
    if endpoint is not None and url != endpoint:
        raise LineError(number, "mismatched_url", f"url {url!r} differs from the batch's endpoint {endpoint!r}", "url")
    if not isinstance(row.get("body"), dict):
        raise LineError(number, "invalid_request", "body must be a JSON object", "body")
    return Envelope(number, custom_id, url, row["body"])


def parse_line_body(envelope: Envelope) -> LineBody:
    """The body of a line, checked as its endpoint checks one over HTTP; LineError naming the
    parameter otherwise, and for `stream` and `timeout_s` (the completion window is every line's
    deadline). Whether the model exists and the caller may use it is the caller's to check."""
    body = envelope.body
    if ENDPOINT_KINDS[envelope.url] == "embeddings":
        try:
            embedding = parse_embedding_body(orjson.dumps(body))
        except BodyError as exc:
            raise LineError(envelope.line, exc.code, exc.message, exc.param) from None
        if embedding.timeout_s is not None:
            raise LineError(
                envelope.line,
                "unsupported_parameter",
                "timeout_s is not supported in a batch: the batch's completion window is every line's deadline",
                "timeout_s",
            )
        return embedding
    try:
        parsed = parse_body(ENDPOINT_KINDS[envelope.url], orjson.dumps(body))  # type: ignore[arg-type]  # embeddings left above: a generation kind
    except BodyError as exc:
        raise LineError(envelope.line, exc.code, exc.message, exc.param) from None
    if parsed.stream:
        raise LineError(envelope.line, "invalid_value", "stream is not supported in a batch", "stream")
    if parsed.timeout_s is not None:
        raise LineError(
            envelope.line,
            "unsupported_parameter",
            "timeout_s is not supported in a batch: the batch's completion window is every line's deadline",
            "timeout_s",
        )
    return parsed
