"""The gateway and the model registry on the real broker (docs/design.md, "The model registry").

A gateway (open mode, with an admin token) follows the registry topic of a fresh prefix, seeded
by models.toml; a fake worker answers and reports the versions a test gives it. What is checked:
- a record published to the registry topic changes what the gateway resolves within a second,
  and requests then go out pinned to the new version, whose name and digest every response
  (JSON, SSE, WebSocket) carries;
- GET /v1/models lists what the worker reports ready;
- the admin API writes records that an independent RegistryFollower reads back;
- forged records on the topic are skipped and the gateway keeps serving.
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
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr
from websockets.asyncio.client import connect

from schemas.codec import decode_request, encode
from schemas.messages import EmbedRequest, ReplyEnd, Usage, VersionStatus
from schemas.model_repo import ModelConfig
from schemas.registry import ModelRoute, ModelVersionRecord
from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.catalog import Catalog
from services.gateway.config import GatewaySettings
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics
from weir.models.manifest import pack
from weir.registry import publish, read_registry, register

from .fakes import FakeWorker, GatewayServer

pytestmark = pytest.mark.kafka

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
TOKEN = "registry-admin-token-0123"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
READY = VersionStatus(state="ready", engine="echo")


class EmbeddingWorker(FakeWorker):
    """The fake worker, also answering EmbedRequests: one 2-dimensional vector per input."""

    def _on_request(self, value: bytes) -> None:
        request = decode_request(value)
        if not isinstance(request, EmbedRequest):
            return super()._on_request(value)
        end = ReplyEnd(
            request_id=request.request_id,
            seq=0,
            finish_reason="stop",
            model_version=request.model,
            embeddings=[[0.6, 0.8] for _ in request.inputs],
            usage=Usage(prompt_tokens=len(request.inputs)),
        )
        self._tasks.append(asyncio.create_task(self._send(request, end)))


@dataclass
class Gateway:
    settings: GatewaySettings
    app: Any
    server: GatewayServer
    worker: FakeWorker

    @property
    def catalog(self) -> Catalog:
        return self.app.state.catalog


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def echo_version(version: str) -> ModelVersionRecord:
    return ModelVersionRecord(
        manifest=pack(ModelConfig(name="echo", engine="echo", version=version)), registered_by="test"
    )


@pytest.fixture
async def gateway(gateway_bootstrap: str) -> AsyncIterator[Gateway]:
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        auth_mode="open",
        gateway_admin_token=SecretStr(TOKEN),
        reply_grace_s=0.2,
        gap_timeout_s=1.0,
    )
    app = create_app(settings)
    server = GatewayServer(app)
    worker = EmbeddingWorker(gateway_bootstrap, topics)
    try:
        await server.start()
        await worker.start()
        await until(
            lambda: app.state.bus.fleet.serving("echo@1", int(time.time() * 1000)),
            timeout_s=20,
            what="echo@1 served by a live worker",
        )
        yield Gateway(settings, app, server, worker)
    finally:
        await worker.stop()
        await server.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)


async def publish_echo_2_as_default(gateway: Gateway) -> ModelVersionRecord:
    """Register echo@2 and route `echo` to it, as `weir models push` + `promote` would."""
    record = echo_version("2")
    route = ModelRoute(name="echo", default_version="2", previous_version="1", reason="test")
    await publish(gateway.settings, [*register(gateway.catalog.state, record), route])
    return record


async def test_a_registry_record_changes_what_the_gateway_resolves_within_a_second(gateway: Gateway) -> None:
    assert gateway.catalog.resolve("echo").served_id == "echo@1"  # the seed: models.toml
    record = await publish_echo_2_as_default(gateway)
    await until(
        lambda: gateway.catalog.resolve("echo").served_id == "echo@2",
        timeout_s=1.0,
        interval_s=0.01,
        what="the gateway to follow the registry within 1 s",
    )
    tag = f"echo@2:{record.manifest.digest()[:12]}"
    gateway.worker.versions = {"echo@1": READY, "echo@2": READY}
    await until(
        lambda: gateway.app.state.bus.fleet.serving("echo@2", int(time.time() * 1000)),
        timeout_s=10,
        what="echo@2 served by a live worker",
    )
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:
        answer = await client.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "echo@2" and answer.headers["x-weir-model-version"] == tag
        sent = next(r for r in gateway.worker.requests if r.request_id == answer.json()["id"])
        assert sent.model == "echo@2"  # produced pinned to the version it resolved to
        pinned = await client.post("/v1/chat/completions", json={**CHAT, "model": "echo@1"})
        # echo@1 is only a models.toml entry here: no record, and the fake worker reports no digest
        assert pinned.json()["model"] == "echo@1" and pinned.headers["x-weir-model-version"] == "echo@1:unregistered"
        async with client.stream(
            "POST", "/v1/completions", json={"model": "echo", "prompt": "hi", "stream": True}
        ) as sse:
            assert sse.headers["x-weir-model-version"] == tag
            chunks = [
                orjson.loads(line[6:]) for line in [x async for x in sse.aiter_lines()] if line.startswith("data: {")
            ]
        assert chunks and {chunk["model"] for chunk in chunks} == {"echo@2"}
        for ref, status, code in (
            ("echo@9", 404, "model_not_found"),
            ("echo@", 400, "invalid_value"),
            ("@1", 400, "invalid_value"),
            ("ec ho", 400, "invalid_value"),
        ):
            refused = await client.post("/v1/chat/completions", json={**CHAT, "model": ref})
            assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), ref
    async with connect(gateway.server.base_url.replace("http", "ws", 1) + "/v1/stream") as ws:
        await ws.send(orjson.dumps({"type": "chat.completions", "body": CHAT}).decode())
        frames = []
        while not frames or frames[-1].get("type") not in ("done", "error"):
            frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 10)))
    assert frames[0]["weir_model_version"] == tag and frames[0]["model"] == "echo@2"
    assert all("weir_model_version" not in frame for frame in frames[1:])  # the first frame only


async def test_an_embedding_names_its_version(gateway: Gateway) -> None:
    minilm = echo_version("1").manifest.model_copy(update={"name": "all-MiniLM-L6-v2"})  # only its digest matters
    gateway.worker.versions = {
        "echo@1": READY,
        "all-MiniLM-L6-v2@1": VersionStatus(state="ready", digest=minilm.digest()),
    }
    await until(
        lambda: gateway.app.state.bus.fleet.serving("all-MiniLM-L6-v2@1", int(time.time() * 1000)),
        timeout_s=10,
        what="all-MiniLM-L6-v2@1 served by a live worker",
    )
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:
        answer = await client.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": ["a", "b"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "all-MiniLM-L6-v2@1"
    # no registry record of it here: the digest the worker reports for what it loaded
    assert answer.headers["x-weir-model-version"] == f"all-MiniLM-L6-v2@1:{minilm.digest()[:12]}"


async def test_models_lists_what_the_worker_reports_ready(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:
        ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert ids == ["echo", "echo@1"]  # the fake worker reports only echo@1, the seed's default
        await publish_echo_2_as_default(gateway)
        gateway.worker.versions = {"echo@1": VersionStatus(state="draining"), "echo@2": READY}

        async def listed_is(ids: list[str]) -> bool:
            return [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ids

        await until(lambda: listed_is(["echo", "echo@2"]), timeout_s=10, what="/v1/models to list echo and echo@2")


async def test_the_admin_api_writes_records_a_follower_reads(gateway: Gateway) -> None:
    await publish(
        gateway.settings,
        [
            *register(gateway.catalog.state, echo_version("1")),
            ModelRoute(name="echo", default_version="1"),
            echo_version("3"),
        ],
    )
    await until(lambda: "echo@3" in gateway.catalog.state.versions, timeout_s=5, what="echo@3 in the catalog")
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:

        async def call(action: str, version: str) -> dict[str, Any]:
            answer = await client.post(f"/v2/repository/models/echo/{action}", headers=ADMIN, json={"version": version})
            assert answer.status_code == 200, answer.text
            return answer.json()

        refused = await client.post("/v2/repository/models/echo/promote", headers=ADMIN, json={"version": "3"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "version_not_ready"
        assert gateway.catalog.resolve("echo").served_id == "echo@1"  # nothing written
        answer = await client.post(
            "/v2/repository/models/echo/promote", headers=ADMIN, json={"version": "3", "force": True}
        )
        assert answer.status_code == 200, answer.text
        promoted = answer.json()
        assert promoted["applied"] and promoted["records"] == ["route:echo", "version:echo@1"]
        assert gateway.catalog.resolve("echo").served_id == "echo@3"  # the gateway read its own write
        state = await read_registry(gateway.settings)  # an independent follower, from the beginning
        assert state.routes["echo"].default_version == "3" and state.routes["echo"].previous_version == "1"
        assert state.versions["echo@1"].desired == "unloaded"  # the old default drains
        assert "gateway admin API" in state.versions["echo@1"].registered_by
        assert (await call("load", "1"))["records"] == ["version:echo@1"]
        assert (await read_registry(gateway.settings)).versions["echo@1"].desired == "loaded"
        await call("unload", "1")
        assert (await read_registry(gateway.settings)).versions["echo@1"].desired == "unloaded"
        conflict = await client.post("/v2/repository/models/echo/unload", headers=ADMIN, json={"version": "3"})
        assert conflict.status_code == 409 and "default version" in conflict.json()["error"]["message"]
        index = (await client.post("/v2/repository/index", headers=ADMIN)).json()
        assert {(e["version"], e["desired"], e["default"]) for e in index if e["name"] == "echo"} == {
            ("1", "unloaded", False),
            ("3", "loaded", True),
        }
        ready = (await client.post("/v2/repository/index", headers=ADMIN, json={"ready": True})).json()
        assert [(e["name"], e["version"], e["workers"]) for e in ready] == [("echo", "1", {"fake-worker-1": "ready"})]
        await call("load", "1")
        assert (await call("promote", "1"))["applied"]  # the fake worker has echo@1 ready: no force needed
        assert gateway.catalog.resolve("echo").served_id == "echo@1"


async def reported(gateway: Gateway, versions: dict[str, VersionStatus]) -> None:
    """Let the fake worker report `versions` and wait until the gateway's fleet has read it."""
    gateway.worker.versions = versions
    fleet = gateway.app.state.bus.fleet
    wanted = {served_id: status.state for served_id, status in versions.items()}

    def seen() -> dict[str, str]:
        by_version = fleet.version_states(int(time.time() * 1000))
        worker = gateway.worker.worker_id
        return {served_id: by[worker].state for served_id, by in by_version.items() if worker in by}

    await until(lambda: seen() == wanted, timeout_s=10, what="the catalog's versions")


async def test_requests_for_a_version_coming_up_are_admitted_and_a_lost_one_says_why(gateway: Gateway) -> None:
    """A version a live worker brings up (a rollback target loading again, a reload after a
    failed golden check) is admitted, and the batcher would hold it; one failed everywhere, or
    unloaded, is refused at once with the reason and no Retry-After; no worker of the name at
    all is the breaker (503, try again later)."""
    await publish(gateway.settings, [echo_version("2"), echo_version("3").model_copy(update={"desired": "unloaded"})])
    await until(lambda: "echo@3" in gateway.catalog.state.versions, timeout_s=5, what="echo@3 in the catalog")
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:

        async def ask(version: str) -> httpx.Response:
            return await client.post("/v1/chat/completions", json={**CHAT, "model": f"echo@{version}"})

        for state in ("loading", "unhealthy"):
            await reported(gateway, {"echo@1": READY, "echo@2": VersionStatus(state=state)})
            assert (await ask("2")).status_code == 200, state  # the fake worker answers what reaches it
        await reported(gateway, {"echo@1": READY})  # echo@2 wanted loaded, the worker holds `echo`
        assert (await ask("2")).status_code == 200
        await reported(gateway, {"echo@1": READY, "echo@2": VersionStatus(state="failed", reason="model.bin changed")})
        failed = await ask("2")
        assert error_of(failed) == (503, "model_unavailable") and "retry-after" not in failed.headers
        assert "failed on fake-worker-1: model.bin changed" in failed.json()["error"]["message"]
        unloaded = await ask("3")
        assert error_of(unloaded) == (503, "model_unavailable") and "retry-after" not in unloaded.headers
        assert "is unloaded" in unloaded.json()["error"]["message"]
        await reported(gateway, {})  # live, but no version of `echo`: the fleet of `echo` is down
        down = await ask("2")
        assert error_of(down) == (503, "model_unavailable") and down.headers["retry-after"] == "5"


async def test_forged_registry_records_are_skipped_and_the_gateway_keeps_serving(gateway: Gateway) -> None:
    forged_key = echo_version("8")  # a valid record, under another version's key
    producer = AIOKafkaProducer(bootstrap_servers=gateway.settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        topic = gateway.settings.topics.models
        await producer.send_and_wait(topic, b"\x00not a record", key=b"version:echo@9")
        await producer.send_and_wait(topic, b'{"kind": "route", "name": "echo"}', key=b"route:echo")
        await producer.send_and_wait(topic, encode(forged_key), key=b"version:echo@7")
    finally:
        await producer.stop()
    await publish(gateway.settings, [echo_version("5")])  # a good record after them is still read
    await until(lambda: "echo@5" in gateway.catalog.state.versions, timeout_s=5, what="echo@5 in the catalog")
    assert gateway.catalog.num_skipped == 3
    assert not {"echo@7", "echo@8", "echo@9"} & set(gateway.catalog.state.versions)
    assert gateway.catalog.resolve("echo").served_id == "echo@1"  # the forged route changed nothing
    async with httpx.AsyncClient(base_url=gateway.server.base_url, timeout=30) as client:
        answer = await client.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200 and answer.json()["model"] == "echo@1"
