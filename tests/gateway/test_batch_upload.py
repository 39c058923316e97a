"""Receiving and checking a batch upload without a broker: the streaming multipart parser (as the
openai client sends an upload), its size limit enforced while reading (413, never the whole body
in memory), the purpose, and the check of every line (batch_format.check_batch_lines)."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from schemas.messages import BatchJob
from schemas.model_repo import load_model_repo
from schemas.registry import RegistryState
from services.batcher.job_core import parse_input
from services.gateway.batch_format import LineRules, check_batch_lines, check_purpose
from services.gateway.batch_upload import receive_upload
from services.gateway.catalog import Catalog
from services.gateway.fleet import Fleet
from services.gateway.guard.auth import Identity
from services.gateway.guard.validation import TokenCounter
from services.gateway.openai_format import ApiError

REPO = load_model_repo(Path(__file__).resolve().parents[2] / "models.toml")
CATALOG = Catalog(RegistryState(REPO), Fleet())  # the registry seeded by models.toml, nothing registered yet
ANN = Identity(principal="ann", tenant="acme", scope="key:ann")
ECHO_ONLY = Identity(principal="ann", tenant="acme", scope="key:ann2", models=frozenset({"echo"}))


def rules(identity: Identity = ANN) -> LineRules:
    return LineRules(CATALOG.resolve, identity, TokenCounter(), None, 16, 600.0, "weir.replies.job.check")


def multipart(files: dict, data: dict) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://x/v1/files", files=files, data=data)
    return request.headers["content-type"], request.read()


async def pieces(body: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


def line(custom_id: str, content: str = "hi", url: str = "/v1/chat/completions", **body: object) -> bytes:
    payload = {"model": "echo", "messages": [{"role": "user", "content": content}], **body}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


@pytest.mark.parametrize("piece_size", [1, 7, 70, 65536])
async def test_an_upload_as_the_openai_client_sends_it_in_any_pieces(piece_size):
    content = line("a") + b"\n" + line("b", "é") + b"\n"
    ctype, body = multipart({"file": ("in.jsonl", content, "application/octet-stream")}, {"purpose": "batch"})
    upload = await receive_upload(ctype, str(len(body)), pieces(body, piece_size))
    try:
        assert upload.fields == {"purpose": "batch"} and upload.filename == "in.jsonl" and upload.size == len(content)
        assert upload.file is not None
        upload.file.seek(0)
        assert upload.file.read() == content
        check_purpose(upload)
    finally:
        upload.close()


@pytest.mark.parametrize(
    ("ctype", "body", "param", "status"),
    [
        ("application/json", b"{}", None, 400),
        (*multipart({"file": ("a.jsonl", b"x")}, {"purpose": "fine-tune"}), "purpose", 400),
        (*multipart({"file": ("a.jsonl", b"x")}, {}), "purpose", 400),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n',
            "file",
            400,
        ),
        (*multipart({"file": ("a.jsonl", b"x")}, {"purpose": "batch", "expires_after": "1"}), "expires_after", 400),
    ],
)
async def test_an_upload_that_is_not_a_batch_file_is_a_400_naming_the_field(ctype, body, param, status):
    with pytest.raises(ApiError) as caught:
        upload = await receive_upload(ctype, None, pieces(body, 1000))
        try:
            check_purpose(upload)
        finally:
            upload.close()
    assert (caught.value.status, caught.value.param) == (status, param)


async def test_a_truncated_multipart_body_is_a_400():
    ctype, body = multipart({"file": ("a.jsonl", b"x" * 100)}, {"purpose": "batch"})
    with pytest.raises(ApiError) as caught:
        await receive_upload(ctype, None, pieces(body[:-10], 30))
    assert caught.value.status == 400


async def test_an_upload_is_spooled_not_held_and_one_over_the_limit_is_a_413_while_streaming():
    limit = 8 << 20
    ctype, head = multipart({"file": ("big.jsonl", b"\x00MARK")}, {"purpose": "batch"})
    before, after = head.split(b"\x00MARK")
    consumed = 0

    async def endless(num_bytes: int) -> AsyncIterator[bytes]:  # a body produced as it is sent, never whole
        nonlocal consumed
        yield before
        block = line("x" * 10) + b"\n"
        block = block * (65536 // len(block))
        sent = 0
        while sent < num_bytes:
            consumed += len(block)
            sent += len(block)
            yield block
        yield after

    tracemalloc.start()
    try:
        upload = await receive_upload(ctype, None, endless(limit - 100_000), limit)
        _size, peak = tracemalloc.get_traced_memory()
        assert upload.size > limit - 200_000 and peak < 3 << 20, peak  # the 1 MiB spool, then disk
        upload.close()
        tracemalloc.reset_peak()
        consumed = 0
        with pytest.raises(ApiError) as caught:
            await receive_upload(ctype, None, endless(10 * limit), limit)
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")
    assert consumed < limit + (1 << 20) and peak < 3 << 20  # stopped at the limit, not after 80 MiB
    with pytest.raises(ApiError) as declared:  # a declared length over the limit: refused before reading
        await receive_upload(ctype, str(10 * limit), endless(0), limit)
    assert declared.value.status == 413


def test_every_line_is_checked_and_the_first_bad_one_named():
    good = [line("a"), line("b", max_tokens=5)]
    summary = check_batch_lines([b"\n".join(good) + b"\n"], rules())
    assert summary.num_requests == 2 and summary.num_tokens > 5
    cases = [
        (line("c", temperature=9), "invalid_value", "temperature"),
        (line("c", model="nope"), "model_not_found", "model"),
        (line("c", model="all-MiniLM-L6-v2"), "unsupported_model", "model"),
        (line("c", max_tokens=10**6), "invalid_value", "max_tokens"),
        (b"{oops", "invalid_json", None),
        (line("a"), "duplicate_custom_id", "custom_id"),
    ]
    for bad, code, param in cases:
        with pytest.raises(ApiError) as caught:
            check_batch_lines([b"\n".join([*good, bad, line("z")])], rules())
        assert (caught.value.status, caught.value.code, caught.value.param) == (400, code, param), caught.value.message
        assert caught.value.message.startswith("line 3: ")


def test_a_key_limited_to_one_model_cannot_smuggle_another_in_a_line():
    other = line("b", model="weir-tiny-py")
    smuggled_in_string = line("a", "x\u2028" + other.decode())  # one line: its text holds the other
    assert check_batch_lines([smuggled_in_string + b"\n"], rules(ECHO_ONLY)).num_requests == 1
    for data in (line("a") + "\u2028".encode() + other, line("a") + "\u0085".encode() + other):
        with pytest.raises(ApiError) as caught:
            check_batch_lines([data + b"\n"], rules(ECHO_ONLY))
        assert (caught.value.code, caught.value.message[:8]) == ("invalid_json", "line 1: ")
    with pytest.raises(ApiError) as caught:
        check_batch_lines([line("a") + b"\r\n" + other + b"\n"], rules(ECHO_ONLY))
    assert (caught.value.status, caught.value.code, caught.value.message[:8]) == (400, "model_not_allowed", "line 2: ")


def test_the_endpoint_of_a_batch_binds_every_line_and_an_empty_file_is_refused():
    data = line("a") + b"\n" + line("b", url="/v1/completions") + b"\n"
    with pytest.raises(ApiError) as caught:
        check_batch_lines([data], rules())  # a line's body is checked as its own url's
    assert caught.value.message.startswith("line 2: ")
    with pytest.raises(ApiError) as caught:
        check_batch_lines([line("a") + b"\n"], rules(), endpoint="/v1/completions")
    assert caught.value.code == "mismatched_url"
    with pytest.raises(ApiError) as caught:
        check_batch_lines([b"\n \r\n"], rules())
    assert caught.value.code == "empty_file"


def test_a_line_of_n_choices_is_n_requests_charged_as_online():
    """The batch quota counts what the online endpoint admits: a request per choice, each charged
    its prompt + max_tokens."""
    summary = check_batch_lines([line("a", max_tokens=10, n=16) + b"\n" + line("b", max_tokens=10) + b"\n"], rules())
    assert (summary.num_lines, summary.num_requests) == (2, 17)
    one = check_batch_lines([line("b", max_tokens=10) + b"\n"], rules()).num_tokens
    assert summary.num_tokens == 17 * one


def test_the_gateway_and_the_batcher_count_the_same_lines():
    odd = ["a\r\nb", "\u2028", "\u2029", "\u0085", "\x0c", "\x0b", "\x1c\x1d\x1e"]
    data = b"".join(line(f"l{i}", f"x{ch}y") + (b"\r\n" if i % 2 else b"\n") for i, ch in enumerate(odd))
    data += b"\n" + line("last", "\u2028")  # a blank line, and no newline at the end
    summary = check_batch_lines([data], rules())
    job = BatchJob(
        job_id="batch_1",
        status="validating",
        endpoint="/v1/chat/completions",
        input_file_id="f",
        created_ms=0,
        expires_ms=86_400_000,
        updated_ms=0,
    )
    parsed = parse_input(data, job, RegistryState(REPO), "r")
    assert parsed.errors == [] and all(ln.error is None for ln in parsed.lines)
    assert summary.num_requests == len(parsed.lines) == len(odd) + 1
    assert [ln.line for ln in parsed.lines][-1] == len(odd) + 2  # the blank line still counts for numbers
    assert len(data.decode().splitlines()) > len(parsed.lines)  # str.splitlines would have seen more


async def test_nothing_after_the_closing_boundary_or_between_parts_piles_up():
    ctype, body = multipart({"file": ("a.jsonl", b"x")}, {"purpose": "batch"})
    epilogue = body + b"e" * (512 << 10)
    tracemalloc.start()
    try:
        upload = await receive_upload(ctype, None, pieces(epilogue, 4096), 1 << 20)
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    upload.close()
    assert upload.fields == {"purpose": "batch"} and peak < 128 << 10, peak
    boundary = ctype.split("boundary=")[1]
    garbage = f"--{boundary}".encode() + b"x" * (1 << 20)  # a boundary line that never ends
    with pytest.raises(ApiError) as caught:
        await receive_upload(ctype, None, pieces(garbage, 4096), 1 << 20)
    assert caught.value.status == 400
