"""GET /openapi.json documents every endpoint, and the gateway behaves as documented.

The property test runs schemathesis against a live gateway (uvicorn on its own thread and event
loop, a fake worker answering on the real broker): generated bodies and headers, a bounded number
of examples per operation, checking that nothing is a server error and that every status, content
type, header and body conforms to the document.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import jwt
import orjson
import pytest

from schemas.messages import GenerateRequest, ReplyDelta, ReplyEnd, Usage
from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from tests.waiting import until
from weir.kafka.admin import ensure_topics, wait_for_broker

from .fakes import FakeWorker, GatewayServer

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
SECRET = b"openapi-test-secret-0123456789abcdef"
JWKS = {"keys": [{"kty": "oct", "k": "b3BlbmFwaS10ZXN0LXNlY3JldC0wMTIzNDU2Nzg5YWJjZGVm", "kid": "t", "alg": "HS256"}]}
FUZZED = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/{model_id}",
    "/v1/streams/{request_id}",
    "/healthz",
    "/readyz",
    "/metrics",
}


def settings(**extra: Any) -> GatewaySettings:
    return GatewaySettings(model_repo=str(REPO_TOML), kafka_bootstrap="127.0.0.1:1", **extra)


def document(**extra: Any) -> dict[str, Any]:
    return create_app(settings(**extra)).openapi()


def test_every_http_route_is_documented_with_auth_and_errors() -> None:
    app = create_app(settings(jwt_keys=orjson.dumps(JWKS).decode()))
    doc = app.openapi()
    routes = {
        (m.lower(), re.sub(r":\w+}", "}", r.path))  # {model_id:path} is documented as {model_id}
        for r in app.routes
        if hasattr(r, "methods") and r.include_in_schema
        for m in r.methods
        if m != "HEAD"
    }
    documented = {(method, path) for path, item in doc["paths"].items() for method in item}
    assert routes <= documented
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "API key (weir_<key_id>_<secret>) or JWT",
    }
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionBody"
    }
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "403", "404", "413", "429", "503", "504"):
        assert chat["responses"][status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    assert "retry-after" in chat["responses"]["429"]["headers"]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert set(doc["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "431"}
    assert set(doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404", "431"}
    error = doc["components"]["schemas"]["ErrorObject"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_open_mode_documents_no_credentials() -> None:
    chat = document(auth_mode="open")["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{}] and "401" not in chat["responses"] and "403" not in chat["responses"]


class EchoWorker(FakeWorker):
    """Answers every request the normal way (no "hang"/"slow" prompts a generator could hit)."""

    async def _answer(self, request: GenerateRequest) -> None:
        rid = request.request_id
        for seq, text in enumerate(("Hello", ", ", "world")):
            await self._send(request, ReplyDelta(request_id=rid, seq=seq, text=text))
        usage = Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
        await self._send(
            request, ReplyEnd(request_id=rid, seq=3, finish_reason="stop", model_version="echo@1", usage=usage)
        )


class ThreadedGateway:
    """A gateway and an EchoWorker on an event loop of their own thread, so sync clients can call it."""

    def __init__(self, bootstrap: str) -> None:
        self.topics = Topics(prefix=f"t{uuid4().hex[:8]}")
        self.settings = GatewaySettings(
            kafka_bootstrap=bootstrap,
            topic_prefix=self.topics.prefix,
            model_repo=str(REPO_TOML),
            jwt_keys=orjson.dumps(JWKS).decode(),
            reply_grace_s=2.0,
        )
        self.bootstrap = bootstrap
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedGateway:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(90)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        await ensure_topics(self.bootstrap, self.topics.core_specs())
        self.server = GatewayServer(create_app(self.settings))
        self.worker = EchoWorker(self.bootstrap, self.topics)
        await self.server.start()
        await self.worker.start()
        bus = self.server.server.config.app.state.bus
        await until(lambda: bus.readiness()[0], timeout_s=30, what="the gateway ready")

    async def _stop(self) -> None:
        await self.worker.stop()
        await self.server.stop()


@pytest.fixture(scope="module")
def live_gateway() -> Iterator[ThreadedGateway]:
    bootstrap = os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    try:
        asyncio.run(wait_for_broker(bootstrap, timeout_s=10))
    except TimeoutError as exc:
        pytest.skip(f"no Kafka broker: {exc}")
    with ThreadedGateway(bootstrap) as gateway:
        yield gateway


@pytest.mark.kafka
@pytest.mark.filterwarnings("ignore:Do not use the `random` module")  # from inside schemathesis' strategies
def test_the_gateway_conforms_to_its_openapi_document(live_gateway: ThreadedGateway) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import settings as hypothesis_settings
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    base_url = live_gateway.server.base_url
    raw = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(raw)
    token = jwt.encode(
        {"sub": "fuzzer", "tenant": "qa", "exp": int(time.time()) + 3600},
        SECRET,
        algorithm="HS256",
        headers={"kid": "t"},
    )
    auth = {"authorization": f"Bearer {token}"}
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        response_headers_conformance,
    ]
    seen: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path not in FUZZED:
            continue
        is_post = operation.method.upper() == "POST"

        @hypothesis_settings(
            max_examples=40 if is_post else 3,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def call(case: Any) -> None:
            response = case.call(base_url=base_url, headers=auth, timeout=30)
            # call() runs (and ends) within the iteration that defines it: no late binding of `operation`
            seen.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(response.status_code)  # noqa: B023
            case.validate_response(response, checks=checks)

        call()
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /v1/models/{model_id}",
        "GET /metrics",
    } <= set(seen)
    assert 200 in seen["POST /v1/chat/completions"] and 400 in seen["POST /v1/chat/completions"]
