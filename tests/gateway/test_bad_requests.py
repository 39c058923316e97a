"""Malformed HTTP requests get a 4xx in OpenAI's error format, before anything reaches Kafka.

Runs the app through httpx's ASGI transport without its lifespan: no broker is needed, and a
request that got past validation would fail with 503 (not connected), never with a 4xx.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewaySettings

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
        (b"{\"model\": ", 400, "invalid_json", None),
        (b"", 400, "invalid_json", None),
        (b"\"just a string\"", 400, "invalid_body", None),
        (orjson.dumps({"messages": GOOD["messages"]}), 400, "missing_required_parameter", "model"),
        (orjson.dumps({"model": "echo"}), 400, "missing_required_parameter", "messages"),
        (orjson.dumps({**GOOD, "model": 42}), 400, "invalid_value", "model"),
        (orjson.dumps({**GOOD, "messages": "hi"}), 400, "invalid_value", "messages"),
        (orjson.dumps({**GOOD, "temperature": "hot"}), 400, "invalid_value", "temperature"),
        (orjson.dumps({**GOOD, "max_tokens": -5}), 400, "invalid_value", "max_tokens"),
        (orjson.dumps({**GOOD, "max_tokens": 0}), 400, "invalid_value", "max_tokens"),
        (orjson.dumps({**GOOD, "top_p": 0}), 400, "invalid_value", "top_p"),
        (orjson.dumps({**GOOD, "n": 2}), 400, "unsupported_parameter", "n"),
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
    response = await client.post("/v1/completions", json={"model": "echo", "prompt": ["a", "b"]})
    assert_openai_error(response, 400, "invalid_value", "prompt")
    assert response.headers["x-request-id"].startswith("cmpl-")
    response = await client.post("/v1/completions", json={"model": "echo", "prompt": "x", "echo": True})
    assert_openai_error(response, 400, "unsupported_parameter", "echo")


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
    assert models["object"] == "list" and {m["id"] for m in models["data"]} >= {"echo", "weir-tiny-py"}
    assert (await client.get("/healthz")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["reason"] == "producer not started"
