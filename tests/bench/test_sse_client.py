"""The benchmarks' lean SSE client against a hand-written HTTP/1.1 server (chunks split anywhere)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from bench.sse_client import HttpError, SseConnection


async def serve(responses: list[list[bytes]]):
    """A server that answers each request on a connection with the next response's raw pieces."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for pieces in responses:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            seen.append(head + await reader.readexactly(length))
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def chunked(body: bytes, cuts: list[int]) -> list[bytes]:
    """`body` as chunked transfer encoding, cut into chunks at `cuts`, each chunk written in two pieces."""
    edges = [0, *cuts, len(body)]
    pieces = []
    for start, end in itertools.pairwise(edges):
        frame = f"{end - start:x}\r\n".encode() + body[start:end] + b"\r\n"
        pieces += [frame[:3], frame[3:]]
    return pieces + [b"0\r\n\r\n"]


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = b'data: {"a": 1}\n\ndata: {"b": "x\\ny"}\n\n: comment\n\ndata: [DONE]\n\n'


async def test_events_split_across_chunks_and_two_requests_on_one_connection() -> None:
    server, port, seen = await serve([[HEAD, *chunked(BODY, [3, 17, 18, 40])], [HEAD, *chunked(BODY, [])]])
    async with server:
        connection = SseConnection("127.0.0.1", port)
        first = [data async for data in connection.post_events("/v1/completions", b'{"x": 1}')]
        second = [data async for data in connection.post_events("/v1/completions", b'{"x": 2}')]
        await connection.close()
    assert first == second == [b'{"a": 1}', b'{"b": "x\\ny"}', b"[DONE]"]
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n") and seen[0].endswith(b'{"x": 1}')
    assert seen[1].endswith(b'{"x": 2}')  # the same keep-alive connection carried both


async def test_an_error_status_raises_with_the_body() -> None:
    error = b'{"error": {"message": "bad", "type": "invalid_request_error"}}'
    head = f"HTTP/1.1 400 Bad Request\r\ncontent-length: {len(error)}\r\n\r\n".encode()
    server, port, _ = await serve([[head, error]])
    async with server:
        connection = SseConnection("127.0.0.1", port)
        with pytest.raises(HttpError, match=r"400 Bad Request.*invalid_request_error"):
            [data async for data in connection.post_events("/v1/completions", b"{}")]


async def test_events_carry_their_ids_and_a_get_sends_its_headers() -> None:
    head = HEAD.replace(b"\r\n\r\n", b"\r\nx-request-id: r-1\r\n\r\n")
    body = b'id: 3\ndata: {"a": 1}\n\ndata: {"b": 2}\n\nid: 7\ndata: [DONE]\n\n'
    server, port, seen = await serve([[head, *chunked(body, [5, 30])]])
    async with server:
        connection = SseConnection("127.0.0.1", port)
        events = [e async for e in connection.events("GET", "/v1/streams/r-1", headers={"Last-Event-ID": "2"})]
        await connection.close()
    assert events == [(b"3", b'{"a": 1}'), (None, b'{"b": 2}'), (b"7", b"[DONE]")]
    assert connection.headers["x-request-id"] == "r-1"
    assert seen[0].startswith(b"GET /v1/streams/r-1 HTTP/1.1\r\n") and b"Last-Event-ID: 2\r\n" in seen[0]


async def test_an_error_status_carries_its_code_and_headers() -> None:
    head = b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: 2\r\n\r\n"
    server, port, _ = await serve([[head, b"{}"]])
    async with server:
        connection = SseConnection("127.0.0.1", port)
        with pytest.raises(HttpError) as caught:
            [e async for e in connection.events("POST", "/v1/chat/completions", b"{}")]
    assert caught.value.status == 429 and caught.value.headers["retry-after"] == "3"
