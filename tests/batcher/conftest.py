"""Fixtures of the batcher tests: the real Kafka broker and a fresh topic prefix per test."""

from __future__ import annotations

from uuid import uuid4

import pytest

from schemas.topics import Topics
from tests.conftest import BOOTSTRAP
from weir.kafka.admin import wait_for_broker


@pytest.fixture(scope="session")
async def batcher_bootstrap(kafka_broker: str | None) -> str:
    """Bootstrap servers of the broker that tests/conftest.py made sure of, once it answers."""
    bootstrap = kafka_broker or BOOTSTRAP
    await wait_for_broker(bootstrap, timeout_s=30)
    return bootstrap


@pytest.fixture
def fresh_topics() -> Topics:
    """Topic names under a prefix no other test uses."""
    return Topics(prefix=f"t{uuid4().hex[:8]}")
