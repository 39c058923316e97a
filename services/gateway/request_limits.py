"""Limits every request meets before a route reads it, so that no shape of request answers 500
or costs the gateway more than its limits allow (docs/design.md, invariant 6).

- `RequestLimits`, an ASGI middleware around every route: 431 for a request with more than
  `max_headers` headers or more than `max_header_bytes` of them (names and values); and for a body
  that is not a multipart upload to an upload route (POST /v1/files): 413 past `max_body_bytes`,
  400 `json_too_deep` when it nests JSON arrays and objects deeper than `max_json_depth`. Such a
  body is read here (it is at most max_body_bytes) and handed to the route as it came, so every
  JSON endpoint, whichever parser it uses, gets the same limits.
- `head_limited_protocol`, the HTTP protocol the gateway's uvicorn runs: uvicorn's httptools
  protocol, which refuses with 431 and closes the connection a request head still incomplete past
  a bound, so the server never buffers an unbounded head (llhttp itself has no such limit).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.gateway.metrics import note_error_code
from services.gateway.openai_format import ApiError, error_body

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # an opening bracket: +1 as int8, a closing one: -1
_HEADERS_TOO_LARGE = "request_header_fields_too_large"


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text `raw` (0: a scalar); brackets inside
    strings do not count. Linear, in C (bytes methods and numpy): cheap even for a hostile body."""
    if raw.count(b"[") + raw.count(b"{") == 0:
        return 0
    # Drop escaped backslashes, then escaped quotes: every `"` left opens or closes a string.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])  # the text between strings
    steps = outside.translate(_STEPS, _NOT_BRACKETS)  # only the brackets, as +1 and -1
    if not steps:
        return 0
    return max(0, int(np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int32).max()))


def check_json_depth(raw: bytes, max_depth: int) -> None:
    """ApiError(400, json_too_deep) when `raw` nests deeper than max_depth."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # the common case: nothing to scan
        return
    depth = json_depth(raw)
    if depth > max_depth:
        raise ApiError(
            400, f"the JSON body nests {depth} levels deep; at most {max_depth} are allowed", code="json_too_deep"
        )


def check_headers(headers: list[tuple[bytes, bytes]], max_headers: int, max_header_bytes: int) -> None:
    """ApiError(431) when there are more than max_headers headers or more than max_header_bytes
    of names and values."""
    if len(headers) > max_headers:
        raise ApiError(
            431, f"the request has {len(headers)} headers; at most {max_headers} are allowed", code=_HEADERS_TOO_LARGE
        )
    size = sum(len(name) + len(value) for name, value in headers)
    if size > max_header_bytes:
        raise ApiError(
            431,
            f"the request's headers hold {size} bytes; at most {max_header_bytes} are allowed",
            code=_HEADERS_TOO_LARGE,
        )


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes:
    return next((value for name, value in headers if name == b"content-type"), b"").lower()


class RequestLimits:
    """The ASGI middleware of the header, body size and JSON depth limits (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_headers: int,
        max_header_bytes: int,
        max_body_bytes: int,
        max_json_depth: int,
        upload_paths: frozenset[str],
    ) -> None:
        self.app = app
        self.upload_paths = upload_paths
        self.max_headers, self.max_header_bytes = max_headers, max_header_bytes
        self.max_body_bytes, self.max_json_depth = max_body_bytes, max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        try:
            check_headers(headers, self.max_headers, self.max_header_bytes)
            if scope["type"] == "http" and not self._is_upload(scope):
                receive = await self._checked_body(headers, receive)
        except ApiError as error:
            note_error_code(scope, error.code)
            if scope["type"] == "http" or "websocket.http.response" in scope.get("extensions", {}):
                return await _send_error(send, error, scope["type"])
            # A server without the denial-response extension: refused before the handshake (HTTP 403).
            return await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
        await self.app(scope, receive, send)

    def _is_upload(self, scope: Scope) -> bool:
        """A multipart body to an upload route: its route limits and checks it (not JSON)."""
        return scope["path"] in self.upload_paths and _content_type(scope["headers"]).startswith(b"multipart/")

    async def _checked_body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> Receive:
        """Read the body (413 past the limit), check its JSON depth, and return a `receive` that
        gives the route the same body, then whatever the client sends next (a disconnect)."""
        length = _content_length(headers)
        if length is not None and length > self.max_body_bytes:
            raise _too_large(self.max_body_bytes, f"request body of {length} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the route see it
                return _replay(b"".join(chunks), receive, first=message)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes, "request body")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        check_json_depth(body, self.max_json_depth)
        return _replay(body, receive)


def _too_large(max_bytes: int, what: str) -> ApiError:
    return ApiError(413, f"{what} exceeds the limit of {max_bytes} bytes", code="request_too_large")


def _replay(body: bytes, receive: Receive, first: Message | None = None) -> Receive:
    """A `receive` that gives `body` whole (or `first`, a disconnect), then the client's own messages."""
    pending: list[Message] = [first] if first is not None else [{"type": "http.request", "body": body}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed


async def _send_error(send: Send, error: ApiError, scope_type: str = "http") -> None:
    """The error as an HTTP response (of a WebSocket handshake too: ASGI's denial response)."""
    prefix = "http" if scope_type == "http" else "websocket.http"
    content = orjson.dumps(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": f"{prefix}.response.start", "status": error.status, "headers": headers})
    await send({"type": f"{prefix}.response.body", "body": content})


LINGER_S = 1.0  # how long a refused connection still reads (and drops) what the client sends


def head_limited_protocol(max_head_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, refusing a request head still incomplete past max_head_bytes
    (uvicorn's `http` option takes the class)."""

    class HeadLimitedHttpTools(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0  # bytes received of the current, still incomplete, request head
            self._in_head = False
            self._began_now = False
            self._is_refused = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._began_now, self._head_bytes = True, True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self._is_refused:  # lingering: dropped, so the client can read the 431 before the close
                return
            self._began_now = False
            super().data_received(data)
            # A chunk in which a head began may end the previous request: not counted, so a bound
            # is never reached by another request's bytes (at most one chunk more is buffered).
            if self._in_head and not self._began_now and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self._refuse_head()

        def _refuse_head(self) -> None:
            # Answer, stop writing, and read on a moment before closing: closing a socket with
            # unread data sends a reset, which can destroy the answer before the client reads it.
            self._is_refused = True
            message = f"the request head exceeds {max_head_bytes} bytes"
            content = orjson.dumps(error_body(message, "invalid_request_error", None, _HEADERS_TOO_LARGE))
            head = (
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(content)
            )
            self.transport.write(head + content)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    return HeadLimitedHttpTools
