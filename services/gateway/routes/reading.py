"""Reading a request: its body under the gateway's size limit, and its timeout header."""

from __future__ import annotations

from fastapi import Request

from services.gateway.openai_format import ApiError, header_seconds


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or ApiError(413) as soon as it is known to exceed max_bytes."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > max_bytes:
        raise ApiError(
            413, f"request body of {length} bytes exceeds the limit of {max_bytes} bytes", code="request_too_large"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def header_timeout_s(headers: dict[str, str], max_timeout_s: float) -> float | None:
    """The client's timeout from X-Weir-Timeout-S, or None; ApiError(400) naming the header unless
    it is a number of seconds from 0.001 to the gateway's cap (WEIR_MAX_TIMEOUT_S)."""
    return header_seconds(headers, "X-Weir-Timeout-S", max_timeout_s, may_be_zero=False)
