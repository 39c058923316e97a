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


class SseConnection:
    """One keep-alive connection to host:port; `post_events` streams one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None

    async def post_events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) to `path`; yield the payload of each `data:` line as it arrives."""
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        status = await reader.readuntil(b"\r\n")
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        keep_alive = headers.get("connection", "").lower() != "close"
        chunks = _chunks(reader) if headers.get("transfer-encoding") == "chunked" else _sized(reader, headers)
        if not status.startswith(b"HTTP/1.1 200"):
            rest = b"".join([c async for c in chunks])
            await self.close()
            raise HttpError(f"{status.decode('latin-1').strip()}: {rest[:500]!r}")
        pending = b""
        async for chunk in chunks:
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for field in event.split(b"\n"):
                    if field.startswith(b"data: "):
                        yield field[6:]
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
