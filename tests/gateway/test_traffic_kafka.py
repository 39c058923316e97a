"""Traffic policies at the gateway, on the real broker (docs/design.md, "Traffic policies").

A gateway (API keys; an admin token) follows the registry topic of a fresh prefix where echo@1
(the default), echo@2 and echo@3 are registered; a fake worker reports all three ready and
answers. What is checked:
- a route record published to the registry changes the versions new requests get within a
  second, both ways, and the admin API's route endpoint writes one a follower reads back;
- assignment is sticky per user over HTTP (JSON, SSE, WebSocket): the produced request carries
  `user`, `assignment` and the version, and the response says the same in x-weir-assignment;
- `name@version` is pinned when the key may use that version, 403 when it may not; a canary the
  key may not use leaves its requests on the default.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import orjson
import pytest
from pydantic import SecretStr
from websockets.asyncio.client import connect

from schemas.messages import GenerateRequest, VersionStatus
from schemas.model_repo import ModelConfig
from schemas.registry import ModelRoute, ModelVersionRecord
from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.catalog import Catalog
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import new_api_key
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics
from weir.models.manifest import pack
from weir.registry import publish, read_registry, set_route

from .fakes import GatewayServer
from .test_registry_kafka import EmbeddingWorker

pytestmark = pytest.mark.kafka

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
TOKEN = "traffic-admin-token-0123"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
READY = VersionStatus(state="ready", engine="echo")


def chat(user: str | None = None, model: str = "echo", **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
    return body if user is None else {**body, "user": user}


@dataclass
class Gateway:
    settings: GatewaySettings
    app: Any
    server: GatewayServer
    worker: EmbeddingWorker
    wide: dict[str, str]  # a key of ann allowed `echo` (every version) and the embedding model
    narrow: dict[str, str]  # a key of bob allowed only echo@1

    @property
    def catalog(self) -> Catalog:
        return self.app.state.catalog

    def sent(self, request_id: str) -> GenerateRequest:
        """The request the gateway produced, as the worker read it from the requests topic."""
        return next(r for r in self.worker.requests if r.request_id == request_id)

    async def set_policy(self, canary: dict[str, float]) -> float:
        """Publish echo's canaries (weir.registry.set_route) as `weir models route` would; returns
        the seconds until this gateway assigns by them."""
        records = set_route(self.catalog.state, "echo", by="test", canary=canary)
        published = time.monotonic()
        await publish(self.settings, records)
        await until(
            lambda: self.catalog.state.routes.get("echo") == records[0],
            timeout_s=10,
            interval_s=0.005,
            what="the gateway assigning by the new canaries",
        )
        return time.monotonic() - published


def echo_version(version: str) -> ModelVersionRecord:
    return ModelVersionRecord(manifest=pack(ModelConfig(name="echo", engine="echo", version=version)))


@pytest.fixture
async def gateway(gateway_bootstrap: str) -> AsyncIterator[Gateway]:
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        gateway_admin_token=SecretStr(TOKEN),
        reply_grace_s=0.2,
        gap_timeout_s=1.0,
    )
    # registered (as workers seed models.toml), so set_route may name each; echo@1 the default
    await publish(settings, [*map(echo_version, "123"), ModelRoute(name="echo", default_version="1")])
    app = create_app(settings)
    server = GatewayServer(app)
    worker = EmbeddingWorker(gateway_bootstrap, topics)
    worker.versions = {
        "echo@1": READY,
        "echo@2": READY,
        "echo@3": READY,
        "all-MiniLM-L6-v2@1": VersionStatus(state="ready"),
    }
    wide_key, wide = new_api_key("ann", "acme", models=["echo", "all-MiniLM-L6-v2"])
    narrow_key, narrow = new_api_key("bob", "acme", models=["echo@1"])
    try:
        await server.start()
        for record in (wide, narrow):
            app.state.guard.auth.keys.observe(record)
        await worker.start()
        now_ms = lambda: int(time.time() * 1000)  # noqa: E731
        await until(
            lambda: all(app.state.bus.fleet.serving(f"echo@{v}", now_ms()) for v in "123"),
            timeout_s=20,
            what="echo@1, @2 and @3 served by live workers",
        )
        await until(lambda: "echo@3" in app.state.catalog.state.versions, timeout_s=10, what="echo@3 in the catalog")
        yield Gateway(
            settings,
            app,
            server,
            worker,
            {"authorization": f"Bearer {wide_key}"},
            {"authorization": f"Bearer {narrow_key}"},
        )
    finally:
        await worker.stop()
        await server.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


async def test_a_policy_change_applies_to_new_requests_within_a_second(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.server.base_url, headers=gateway.wide, timeout=30) as client:
        before = await client.post("/v1/chat/completions", json=chat("carol"))
        assert (before.json()["model"], before.headers["x-weir-assignment"]) == ("echo@1", "default")
        assert await gateway.set_policy({"2": 100}) < 1.0, "the gateway did not follow the route within 1 s"
        answer = await client.post("/v1/chat/completions", json=chat("carol"))
        assert answer.status_code == 200, answer.text
        digest = gateway.catalog.state.versions["echo@2"].manifest.digest()
        assert answer.json()["model"] == "echo@2" and answer.headers["x-weir-assignment"] == "canary"
        assert answer.headers["x-weir-model-version"] == f"echo@2:{digest[:12]}"
        sent = gateway.sent(answer.json()["id"])
        assert (sent.model, sent.assignment, sent.user) == ("echo@2", "canary", "carol")
        assert await gateway.set_policy({}) < 1.0
        after = await client.post("/v1/chat/completions", json=chat("carol"))
        assert (after.json()["model"], after.headers["x-weir-assignment"]) == ("echo@1", "default")
        assert gateway.sent(after.json()["id"]).assignment == "default"


async def test_assignment_is_sticky_per_user_and_every_response_says_it(gateway: Gateway) -> None:
    await gateway.set_policy({"2": 50})
    seen: dict[str, set[tuple[str, str]]] = {}
    async with httpx.AsyncClient(base_url=gateway.server.base_url, headers=gateway.wide, timeout=30) as client:
        for i in range(16):
            user = f"user-{i}"
            answer = await client.post("/v1/chat/completions", json=chat(user))
            assert answer.status_code == 200, answer.text
            sent = gateway.sent(answer.json()["id"])
            assert (sent.model, sent.assignment, sent.user) == (
                answer.json()["model"],
                answer.headers["x-weir-assignment"],
                user,
            )
            body = {"model": "echo", "prompt": "hi", "max_tokens": 8, "stream": True, "user": user}
            async with client.stream("POST", "/v1/completions", json=body) as sse:
                models = {
                    orjson.loads(line[6:])["model"] async for line in sse.aiter_lines() if line.startswith("data: {")
                }
                streamed = (models.pop(), sse.headers["x-weir-assignment"])
            assert not models
            seen[user] = {(sent.model, sent.assignment), streamed}
        by_principal = set()
        for _ in range(4):  # no user: ann's principal sticks
            answer = await client.post("/v1/chat/completions", json=chat())
            by_principal.add((answer.json()["model"], answer.headers["x-weir-assignment"]))
    assert all(len(pairs) == 1 for pairs in seen.values()), seen  # one user, one version
    assert {pair for pairs in seen.values() for pair in pairs} == {("echo@1", "default"), ("echo@2", "canary")}
    assert len(by_principal) == 1, by_principal
    for user in ("user-0", "user-1", "user-2"):  # the WebSocket's first frame says it too
        url = gateway.server.base_url.replace("http", "ws", 1) + "/v1/stream"
        async with connect(url, additional_headers=gateway.wide) as ws:
            await ws.send(orjson.dumps({"type": "chat.completions", "body": chat(user, stream=True)}).decode())
            first = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
        assert {(first["model"], first["weir_assignment"])} == seen[user], first
        assert first["weir_model_version"].startswith(first["model"] + ":")


async def test_a_key_pins_the_versions_it_may_use_and_keeps_out_of_canaries_it_may_not(gateway: Gateway) -> None:
    await gateway.set_policy({"2": 100})
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:

        async def ask(auth: dict[str, str], model: str) -> httpx.Response:
            return await client.post("/v1/chat/completions", headers=auth, json=chat("dave", model=model))

        for auth, model, expected in (
            (gateway.wide, "echo@3", ("echo@3", "pinned")),
            (gateway.wide, "echo@1", ("echo@1", "pinned")),  # the default, named
            (gateway.wide, "echo", ("echo@2", "canary")),
            (gateway.narrow, "echo@1", ("echo@1", "pinned")),
            (gateway.narrow, "echo", ("echo@1", "default")),
        ):
            answer = await ask(auth, model)
            assert answer.status_code == 200, (model, answer.text)
            assert (answer.json()["model"], answer.headers["x-weir-assignment"]) == expected, model
            assert (gateway.sent(answer.json()["id"]).model, gateway.sent(answer.json()["id"]).assignment) == expected
        refused = await ask(gateway.narrow, "echo@2")
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "model_not_allowed")
        embedded = await client.post(
            "/v1/embeddings", headers=gateway.wide, json={"model": "all-MiniLM-L6-v2", "input": "hi", "user": "dave"}
        )
        assert embedded.status_code == 200, embedded.text
        assert embedded.headers["x-weir-assignment"] == "default"


async def test_the_admin_route_endpoint_writes_a_policy_a_follower_reads(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:

        async def route(body: dict[str, Any], auth: dict[str, str] = ADMIN) -> httpx.Response:
            return await client.post("/v2/repository/models/echo/route", headers=auth, json=body)

        answer = await route({"canary": {"2": 10}, "mirror": {"3": 100}})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "name": "echo",
            "default": "1",
            "canary": {"2": 10},
            "mirror": {"3": 100},
            "records": ["route:echo"],
            "applied": True,
        }
        state = await read_registry(gateway.settings)  # an independent follower, from the beginning
        assert (state.routes["echo"].canary, state.routes["echo"].mirror) == ({"2": 10}, {"3": 100})
        assert "gateway admin API" in state.routes["echo"].reason
        assert gateway.catalog.state.routes["echo"] == state.routes["echo"]  # the gateway read its own write
        moved = await route({"default": "2", "canary": {}})  # mirror omitted: it stays
        assert moved.status_code == 200, moved.text
        state = await read_registry(gateway.settings)
        route_record = state.routes["echo"]
        assert (route_record.default_version, route_record.previous_version) == ("2", "1")
        assert (route_record.canary, route_record.mirror) == ({}, {"3": 100})
        conflict = await route({"canary": {"9": 5}})
        assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "registry_conflict")
        assert (await route({"canary": {"1": 5}}, gateway.wide)).status_code == 403  # a key, not the admin token
        assert (await read_registry(gateway.settings)).routes["echo"] == route_record  # nothing else was written
