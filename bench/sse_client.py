"""A lean HTTP/1.1 client for server-sent events, for the benchmarks' load generators.

The load generator shares this machine's cores with the services it measures. httpx spent
0.16-0.19 ms of CPU per streamed token here (`weir bench pipeline`, concurrency 16), which the
services then did not have; this client reads the same bytes with asyncio streams: one
keep-alive connection per lane, a JSON POST, a chunked (or sized) response split into SSE events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class HttpError(RuntimeError):
    """A response other than 200; the message holds the status line and the body."""

    def __init__(self, message: str, status: int = 0, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status code (0: unreadable status line)
        self.headers = headers or {}  # lower-case names (retry-after, ...)


class SseConnection:
    """One keep-alive connection to host:port; `post_events` streams one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.headers: dict[str, str] = {}  # the last response's headers, lower-case names
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None

    async def post_events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) to `path`; yield the payload of each `data:` line as it arrives."""
        async for _event_id, data in self.events("POST", path, body):
            yield data

    async def events(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> AsyncIterator[tuple[bytes | None, bytes]]:
        """Send one request (a JSON `body`, extra `headers`); yield (the event's `id:` or None,
        the payload of each `data:` line) as they arrive. `self.headers` holds the response's
        headers from the first event on; a status other than 200 raises HttpError."""
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        status = await reader.readuntil(b"\r\n")
        self.headers = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        keep_alive = self.headers.get("connection", "").lower() != "close"
        is_chunked = self.headers.get("transfer-encoding") == "chunked"
        chunks = _chunks(reader) if is_chunked else _sized(reader, self.headers)
        if not status.startswith(b"HTTP/1.1 200"):
            rest = b"".join([c async for c in chunks])
            await self.close()
            code = status.split(b" ", 2)[1] if status.count(b" ") >= 1 else b"0"
            raise HttpError(
                f"{status.decode('latin-1').strip()}: {rest[:500]!r}",
                int(code) if code.isdigit() else 0,
                dict(self.headers),
            )
        pending = b""
        async for chunk in chunks:
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                event_id = None
                for field in event.split(b"\n"):
                    if field.startswith(b"id: "):
                        event_id = field[4:]
                    elif field.startswith(b"data: "):
                        yield event_id, field[6:]
        if not keep_alive:
            await self.close()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The chunks of a Transfer-Encoding: chunked body."""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the final CRLF
                pass
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _sized(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """A body of Content-Length bytes (an error response)."""
    size = int(headers.get("content-length", "0"))
    if size:
        yield await reader.readexactly(size)
