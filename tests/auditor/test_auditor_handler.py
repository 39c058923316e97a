"""The auditor's FastStream handler without a broker: FastStream's TestKafkaBroker feeds it.

Unit tests of one handler (decode, append, dead-letter, acknowledge); the same paths, and the
per-partition commit after a refused record (which FastStream's in-memory consumer cannot do),
run against the real broker in test_auditor_kafka.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import orjson
from faststream import TestApp
from faststream.kafka import TestKafkaBroker

from schemas.codec import encode
from schemas.messages import DeadLetter
from schemas.topics import Topics
from services.auditor.app import create_app, every
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger
from tests.auditor.factories import make_event, make_flag


def settings_for(tmp_path: Path) -> AuditorSettings:
    # No canary guard nor health alerts: they follow the registry (and the health topic) over a real
    # broker (test_traffic_kafka.py, test_health_kafka.py).
    return AuditorSettings(
        topic_prefix="unit",
        audit_db=tmp_path / "audit.sqlite",
        audit_retry_backoff_s=0.01,
        canary_guard=False,
        health_alerts=False,
    )


async def test_events_and_flags_are_stored_once_and_the_rest_dead_lettered(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    topics = Topics("unit")
    app = create_app(settings)
    letters: list[DeadLetter] = []

    @app.broker.subscriber(topics.dead_letter)
    async def on_dead_letter(letter: DeadLetter) -> None:  # FastStream decodes it into the wire type
        letters.append(letter)

    event, flag = make_event(1), make_flag(1)
    async with TestKafkaBroker(app.broker) as broker, TestApp(app):
        await broker.publish_batch(encode(event), encode(flag), b'{"event_id": ', encode(event), topic=topics.audit)
        await broker.publish(orjson.dumps({**orjson.loads(encode(event)), "max_tokens": "8"}), topic=topics.audit)
    with Ledger(settings.audit_db, readonly=True) as ledger:
        assert [r["event_id"] for r in ledger.records()] == [event.event_id]  # the repeat is stored once
        assert [f["flag_id"] for f in ledger.review_flags.rows()] == [flag.flag_id]
        assert ledger.verify().is_ok
    assert [letter.reason.split(":")[0] for letter in letters] == ["not JSON", "invalid audit record"]
    assert letters[0].value == '{"event_id": ' and letters[0].service == "auditor"
    assert letters[1].reason.endswith('max_tokens: expected an integer, got "8"')


async def test_a_timer_logs_a_failed_tick_and_ticks_again(caplog) -> None:
    """The auditor's timers (services/auditor/app.py: every): a tick that fails is logged, the next
    one runs; `at_once` ticks before the first interval."""
    ticks: list[int] = []
    third = asyncio.Event()

    async def tick() -> None:
        ticks.append(len(ticks))
        if len(ticks) == 1:
            raise RuntimeError("broker away")
        if len(ticks) == 3:
            third.set()

    async def run(timer: asyncio.Task[None], until: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(until.wait(), 10)
        finally:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer

    await run(asyncio.create_task(every(0.01, tick, "publishing rate cards")), third)
    failed = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert failed == ["publishing rate cards failed (RuntimeError('broker away')); retrying at the next tick"]
    first = asyncio.Event()

    async def once() -> None:
        first.set()

    await run(asyncio.create_task(every(3600, once, "checkpoint", at_once=True)), first)  # not an hour later
