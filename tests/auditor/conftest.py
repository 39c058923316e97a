"""Fixtures of the auditor tests: a private topic prefix per test on the real Kafka broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from uuid import uuid4

import pytest

from schemas.topics import Topics
from weir.kafka.admin import delete_topics, ensure_topics


@pytest.fixture(scope="session")
def bootstrap(kafka_broker: str) -> str:
    """The broker tests/conftest.py made sure of (WEIR_KAFKA_BOOTSTRAP, default 127.0.0.1:9092)."""
    return kafka_broker


@pytest.fixture
async def audit_topics(bootstrap: str) -> AsyncIterator[Topics]:
    """A fresh prefix whose audit, anchor and dead-letter topics exist, and those of the traffic
    counts and canary guard (registry, model health, traffic), the health alerts and the token usage; deleted after the test."""
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    names = (
        topics.audit,
        topics.audit_anchors,
        topics.dead_letter,
        topics.models,
        topics.model_health,
        topics.traffic,
        topics.health,
        topics.token_usage,
    )
    specs = [spec for spec in topics.core_specs() if spec.name in names]
    await ensure_topics(bootstrap, specs)
    yield topics
    await delete_topics(bootstrap, [spec.name for spec in specs])
