"""Fixtures of the gateway's Kafka tests: the broker, a fresh prefix, a fake worker, the gateway."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

import httpx
import pytest

from schemas.topics import Topics
from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from weir.kafka.admin import delete_prefixed_topics, ensure_topics, wait_for_broker

from .fakes import FakeWorker, GatewayServer

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"


@dataclass
class Stack:
    """A gateway on a real broker, with a fake worker answering its requests."""

    bootstrap: str
    topics: Topics
    settings: GatewaySettings
    server: GatewayServer
    worker: FakeWorker
    gateway_id: str
    ready_before_worker: httpx.Response

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def reply_topic(self) -> str:
        return self.topics.replies(self.gateway_id)


@pytest.fixture(scope="module")
async def gateway_bootstrap() -> str:
    """Bootstrap servers of the running broker (WEIR_KAFKA_BOOTSTRAP, default 127.0.0.1:9092)."""
    bootstrap = os.environ.get("WEIR_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    try:
        await wait_for_broker(bootstrap, timeout_s=10)
    except TimeoutError as exc:
        pytest.skip(f"no Kafka broker: {exc}; start one with `weir kafka up`")
    return bootstrap


@pytest.fixture(scope="module")
async def stack(gateway_bootstrap: str) -> AsyncIterator[Stack]:
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(gateway_bootstrap, topics.core_specs())
    settings = GatewaySettings(
        kafka_bootstrap=gateway_bootstrap,
        topic_prefix=topics.prefix,
        model_repo=str(REPO_TOML),
        reply_grace_s=0.2,
        gap_timeout_s=1.0,
        auth_mode="open",
        lag_interval_s=1.0,
    )
    server = GatewayServer(create_app(settings))
    await server.start()
    worker = FakeWorker(gateway_bootstrap, topics)
    try:
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            gateway_id = (await client.get("/healthz")).json()["gateway_id"]
            ready_before = await client.get("/readyz")
            await worker.start()
            yield Stack(gateway_bootstrap, topics, settings, server, worker, gateway_id, ready_before)
    finally:
        await worker.stop()
        await server.stop()
        await delete_prefixed_topics(gateway_bootstrap, topics.prefix)
