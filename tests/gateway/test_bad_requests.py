"""Malformed HTTP requests get a 4xx in OpenAI's error format, before anything reaches Kafka.

Runs the app through httpx's ASGI transport without its lifespan: no broker is needed, and a
request that got past validation would fail with 503 (not connected), never with a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn

from services.gateway.app import GatewayService, create_app
from services.gateway.config import GatewaySettings
from tests.waiting import until

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
CHAT = "/v1/chat/completions"
GOOD = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(
        model_repo=str(REPO_TOML), max_body_bytes=4096, kafka_bootstrap="127.0.0.1:1", auth_mode="open"
    )
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, code: str | None, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert error["param"] == param


@pytest.mark.parametrize(
    ("content", "status", "code", "param"),
    [
        (b'{"model": ', 400, "invalid_json", None),
        (b"", 400, "invalid_json", None),
        (b'"just a string"', 400, "invalid_body", None),
        (orjson.dumps({"messages": GOOD["messages"]}), 400, "missing_required_parameter", "model"),
        (orjson.dumps({"model": "echo"}), 400, "missing_required_parameter", "messages"),
        (orjson.dumps({**GOOD, "model": 42}), 400, "invalid_value", "model"),
        (orjson.dumps({**GOOD, "messages": "hi"}), 400, "invalid_value", "messages"),
        (orjson.dumps({**GOOD, "temperature": "hot"}), 400, "invalid_value", "temperature"),
        (orjson.dumps({**GOOD, "max_tokens": -5}), 400, "invalid_value", "max_tokens"),
        (orjson.dumps({**GOOD, "max_tokens": 0}), 400, "invalid_value", "max_tokens"),
        (orjson.dumps({**GOOD, "top_p": 0}), 400, "invalid_value", "top_p"),
        (orjson.dumps({**GOOD, "n": 17}), 400, "invalid_value", "n"),
        (orjson.dumps({**GOOD, "stop": [1, 2]}), 400, "invalid_value", "stop"),
        (orjson.dumps({**GOOD, "max_tokens": 100_000}), 400, "invalid_value", "max_tokens"),
        (orjson.dumps({**GOOD, "max_tokens": 4000}), 400, "context_length_exceeded", "max_tokens"),
        (orjson.dumps({**GOOD, "model": "no-such-model"}), 404, "model_not_found", "model"),
    ],
)
async def test_bad_chat_bodies(client: httpx.AsyncClient, content: bytes, status: int, code: str, param: str) -> None:
    response = await client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, status, code, param)
    assert response.headers["x-request-id"].startswith("chatcmpl-")


async def test_bad_completion_bodies(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": "echo", "prompt": [["a"], "b"]})
    assert_openai_error(response, 400, "invalid_value", "prompt")
    assert response.headers["x-request-id"].startswith("cmpl-")
    response = await client.post("/v1/completions", json={"model": "echo", "prompt": []})
    assert_openai_error(response, 400, "invalid_value", "prompt")
    response = await client.post(
        "/v1/completions", json={"model": "echo", "prompt": "x", "echo": True, "logprobs": 1, "stream": True}
    )
    assert_openai_error(response, 400, "unsupported_parameter", "stream")
    response = await client.post("/v1/completions", json={"model": "echo", "prompt": "x", "max_tokens": 0})
    assert_openai_error(response, 400, "invalid_value", "max_tokens")


async def test_oversized_body_is_413(client: httpx.AsyncClient) -> None:
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 10_000}]}
    assert_openai_error(await client.post(CHAT, json=big), 413, "request_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no content-length: the limit applies while reading
        for _ in range(10):
            yield b" " * 1000

    assert_openai_error(await client.post(CHAT, content=chunked()), 413, "request_too_large")


async def test_bad_timeout_header(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=GOOD, headers={"x-weir-timeout-s": "soon"})
    assert_openai_error(response, 400, "invalid_value", "X-Weir-Timeout-S")


async def test_unknown_route_and_method_use_the_same_format(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = await client.get(CHAT)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


async def test_valid_body_without_kafka_is_503_not_4xx(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=GOOD)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


async def test_models_and_health_need_no_kafka(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models == {"object": "list", "data": []}  # it lists what workers report ready: none without Kafka
    assert (await client.get("/healthz")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["reason"] == "producer not started"


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


async def test_every_post_route_answers_400_to_json_nested_too_deep(client: httpx.AsyncClient) -> None:
    # Python's json (POST /v1/batches reads with it) fails past ~1000 levels: a 500 before the limit.
    doc = (await client.get("/openapi.json")).json()
    posts = [path for path, item in doc["paths"].items() if "post" in item]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/batches"} <= set(posts)
    for depth in (65, 2000):
        body = b'{"model": "echo", "messages": ' + deep(depth) + b"}"
        for path in posts:
            url = path.replace("{batch_id}", "batch_x").replace("{file_id}", "file-x")
            response = await client.post(url, content=body, headers={"content-type": "application/json"})
            assert_openai_error(response, 400, "json_too_deep")


async def test_a_multipart_content_type_does_not_get_a_json_body_past_the_limits(client: httpx.AsyncClient) -> None:
    headers = {"content-type": "multipart/form-data; boundary=x"}  # only an upload route takes multipart
    for path in ("/v1/batches", CHAT):
        response = await client.post(path, content=b'{"input_file_id": ' + deep(2000) + b"}", headers=headers)
        assert_openai_error(response, 400, "json_too_deep")


async def test_json_as_deep_as_the_limit_reaches_the_route(client: httpx.AsyncClient) -> None:
    nested = b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "stop": ' + deep(63) + b"}"
    assert_openai_error(await client.post(CHAT, content=nested), 400, "invalid_value", "stop")  # the route's refusal
    in_a_string = orjson.dumps({**GOOD, "messages": [{"role": "user", "content": "[{" * 1000}]})
    assert (await client.post(CHAT, content=in_a_string)).status_code == 503  # valid: brackets in text do not count


async def test_the_body_limit_holds_on_every_json_route(client: httpx.AsyncClient) -> None:
    big = orjson.dumps(
        {"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": "x" * 5000}}
    )
    assert_openai_error(await client.post("/v1/batches", content=big), 413, "request_too_large")


@pytest.mark.parametrize(
    "headers",
    [
        {f"x-h{i}": "v" for i in range(5000)},  # too many
        {f"x-h{i}": "v" for i in range(101)},
        {"x-big": "v" * (1 << 20)},  # too large
        {"x-big": "v" * (33 << 10)},
    ],
)
async def test_too_many_or_too_large_headers_are_431(client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/healthz")):
        response = await client.request(method, path, json=GOOD, headers=headers)
        assert_openai_error(response, 431, "request_header_fields_too_large")


@pytest.mark.parametrize(
    "value",
    [
        "5e-324",
        "0.0009",
        "0",
        "-0",
        "-1",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "Infinity",
        "1e309",
        "601",
        "1e300",
        "0x10",
        "",
        "1" * 40,
        "５".encode(),
        "1_0",
        " 5",
        "5 ",
        "+5",
        "1e1",
        "5,5",
    ],
)
async def test_a_timeout_header_out_of_range_is_400_naming_it(client: httpx.AsyncClient, value: str | bytes) -> None:
    response = await client.post(CHAT, json=GOOD, headers={"x-weir-timeout-s": value})
    assert_openai_error(response, 400, "invalid_value", "X-Weir-Timeout-S")


@pytest.mark.parametrize("value", ["5e-324", "-0.5", "nan", "inf", "301", "1e400"])
async def test_a_resume_grace_header_out_of_range_is_400_naming_it(client: httpx.AsyncClient, value: str) -> None:
    response = await client.post(CHAT, json={**GOOD, "stream": True}, headers={"x-weir-resume-grace-s": value})
    assert_openai_error(response, 400, "invalid_value", "X-Weir-Resume-Grace-S")


async def test_numeric_headers_in_range_are_taken(client: httpx.AsyncClient) -> None:
    headers = {"x-weir-timeout-s": "0.001", "x-weir-resume-grace-s": "0"}
    assert (await client.post(CHAT, json=GOOD, headers=headers)).status_code == 503  # past validation: no Kafka
    headers = {"x-weir-timeout-s": "600", "x-weir-resume-grace-s": "300"}
    assert (await client.post(CHAT, json=GOOD, headers=headers)).status_code == 503
    headers = {"x-weir-timeout-s": "2.5", "x-weir-resume-grace-s": ".5"}
    assert (await client.post(CHAT, json=GOOD, headers=headers)).status_code == 503


@pytest.mark.parametrize("role", ["user", "system", "developer", "assistant"])
async def test_a_message_without_content_is_400(client: httpx.AsyncClient, role: str) -> None:
    # OpenAI allows null content only for an assistant message with tool_calls (test_structured_bodies.py).
    null = {**GOOD, "messages": [{"role": role, "content": None}, {"role": "user", "content": "hi"}]}
    assert_openai_error(await client.post(CHAT, json=null), 400, "invalid_value", "messages.0.content")
    missing = {**GOOD, "messages": [{"role": role}, {"role": "user", "content": "hi"}]}
    assert_openai_error(await client.post(CHAT, json=missing), 400, "missing_required_parameter", "messages.0.content")


async def test_a_body_timeout_finer_than_a_millisecond_is_400(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.post(CHAT, json={**GOOD, "timeout_s": 5e-324}), 400, "invalid_value", "timeout_s")


class Served:
    """The gateway app under uvicorn with the gateway's own server options (GatewayService's
    http_options: the head-limited protocol), on a real socket; no lifespan: no Kafka."""

    def __init__(self) -> None:
        settings = GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1", auth_mode="open")
        service = GatewayService(settings)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(service.app, log_level="warning", lifespan="off", **service.http_options)
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext

    async def __aenter__(self) -> Served:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        await until(
            lambda: self.server.started, timeout_s=30, interval_s=0.02, what="uvicorn started", watch=[self.task]
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await self.task
        self.sock.close()

    async def exchange(self, head: bytes) -> tuple[int, bytes]:
        """Send one raw request head; (status, body) of the answer."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(head)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            status_line = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers["content-length"]))
            return int(status_line.split()[1]), body
        finally:
            writer.close()


def head(*headers: bytes) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nhost: gw\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


async def test_the_server_refuses_heads_too_large_to_buffer_over_a_real_socket() -> None:
    async with Served() as served:
        assert (await served.exchange(head()))[0] == 200
        huge = head(b"x-big: " + b"v" * (1 << 20))  # refused by the server before the head is whole
        # ~60 KiB, likely read in one chunk (which the server does not count): then the middleware's
        many = head(*[b"x-h%d: v" % i for i in range(5000)])
        some = head(*[b"x-h%d: v" % i for i in range(200)])  # a small head, refused by the middleware
        for raw, refused_by in (
            (huge, "the request head exceeds"),
            (many, "the request h"),
            (some, "the request has 201 headers"),
        ):
            status, body = await served.exchange(raw)
            error = orjson.loads(body)["error"]
            assert (status, error["code"]) == (431, "request_header_fields_too_large")
            assert error["message"].startswith(refused_by)
        assert (await served.exchange(head(b"x-ok: " + b"v" * 20_000)))[0] == 200  # under the limits
        upgrade = (
            b"GET /v1/stream HTTP/1.1\r\nhost: gw\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
        )
        status, body = await served.exchange(upgrade + b"".join(b"x-h%d: v\r\n" % i for i in range(110)) + b"\r\n")
        assert (status, orjson.loads(body)["error"]["code"]) == (431, "request_header_fields_too_large")


def test_a_websocket_request_frame_meets_the_body_limits() -> None:
    from starlette.testclient import TestClient

    settings = GatewaySettings(
        model_repo=str(REPO_TOML), max_body_bytes=4096, kafka_bootstrap="127.0.0.1:1", auth_mode="open"
    )
    client = TestClient(create_app(settings))  # no lifespan: refused before anything is published
    with client.websocket_connect("/v1/stream") as ws:
        too_deep = orjson.loads(b'{"model": "echo", "messages": ' + deep(200) + b"}")
        ws.send_text(orjson.dumps({"type": "chat.completions", "body": too_deep}).decode())
        assert ws.receive_json()["error"]["code"] == "json_too_deep"
        too_large = {**GOOD, "messages": [{"role": "user", "content": "x" * 5000}]}
        ws.send_text(orjson.dumps({"type": "chat.completions", "body": too_large}).decode())
        assert ws.receive_json()["error"]["code"] == "request_too_large"
        ws.send_text(orjson.dumps({"type": "chat.completions", "body": GOOD, "resume_grace_s": "5e-324"}).decode())
        error = ws.receive_json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "X-Weir-Resume-Grace-S")
        # Deeper than orjson re-encodes (254 levels) or decodes (1024): refused before parsing, and
        # the socket stays usable (it crashed the handler, with no close frame)
        for depth in (260, 1100):
            body = b'{"type": "chat.completions", "body": {"model": "echo", "x": ' + deep(depth) + b"}}"
            ws.send_text(body.decode())
            assert ws.receive_json()["error"]["code"] == "json_too_deep"
        ws.send_text(b'{"type": "nope"}'.decode())
        assert ws.receive_json()["error"]["code"] == "invalid_frame"
