"""The auditor started again on a ledger that holds recent tokens (issue 35: every second start of
`weir up` warned `publishing rate cards failed`): its timers start once its broker has, so the
rate cards of what the ledger served in the window go out at once, on the real broker."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.codec import decode
from schemas.messages import now_ms
from schemas.telemetry import RateCard
from schemas.topics import Topics
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger

from .factories import make_event

pytestmark = pytest.mark.kafka


async def rate_cards(bootstrap: str, topic: str) -> list[RateCard]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        values = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                values += [r.value for r in records if r.key and r.key.startswith(b"rate:")]
        return [decode(RateCard, v) for v in values]
    finally:
        await consumer.stop()


@pytest.mark.timeout(120)
async def test_a_restarted_auditor_publishes_its_rate_cards_at_once_without_a_failure(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "audit.sqlite"
    with Ledger(db) as ledger:  # what a first start served, a minute ago
        ledger.append(make_event(1, finished_ms=now_ms() - 60_000, prompt_tokens=10, completion_tokens=30), 0, 0)
    # The next card only after an hour: a card now is the one published at start.
    settings = AuditorSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=audit_topics.prefix,
        audit_db=db,
        usage_rate_every_s=3600,
        comparison_embedding_model="",
    )
    caplog.set_level(logging.WARNING, logger="services.auditor.app")
    async with create_app(settings):
        deadline = time.monotonic() + 60
        while not (cards := await rate_cards(bootstrap, audit_topics.token_usage)):
            assert time.monotonic() < deadline, f"no rate card within 60 s: {caplog.text}"
            await asyncio.sleep(0.5)
    assert [c.model_version for c in cards] == ["weir-tiny@1"] and cards[0].tokens_per_hour > 0
    assert "publishing rate cards failed" not in caplog.text
