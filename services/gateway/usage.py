"""The gateway's view of token usage: `<prefix>.usage.tokens` followed into a UsageBook (weir/usage.py).

The gateway keeps no count of its own (docs/design.md, "Observability": the auditor is the only
bookkeeper); GET /v1/usage (routes/usage.py) answers from this view. It starts in the background,
so a large topic does not hold up the gateway's start: until it has read the topic to its end
once, `is_ready` is False and the route answers 503. A record that is not a usage record, or
forged under another key, is skipped and counted (invariant 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import ConsumerRecord

from weir.bus import BusSettings, TopicFollower
from weir.usage import UsageBook

log = logging.getLogger(__name__)

RETRY_S = 5.0


class UsageView:
    """The latest totals and rate cards, kept current by a TopicFollower."""

    def __init__(self, settings: BusSettings, client_id: str) -> None:
        self.book = UsageBook()
        self.is_ready = False
        self._follower = TopicFollower(settings, settings.topics.token_usage, client_id, self._on_record)
        self._task: asyncio.Task[None] | None = None

    def _on_record(self, key: bytes | None, value: bytes | None, record: ConsumerRecord) -> None:
        reason = self.book.apply(key, value)
        if reason is not None:
            log.warning("usage record %s[%d]@%d skipped: %s", record.topic, record.partition, record.offset, reason)

    async def start(self) -> None:
        """Begin reading the topic in the background (the lifespan does not wait for its end)."""
        self._task = asyncio.create_task(self._catch_up(), name="usage-view")

    async def _catch_up(self) -> None:
        while True:
            try:
                await self._follower.start()
                self.is_ready = True
                return
            except Exception as exc:  # noqa: BLE001 - no topic or broker yet: tried again
                log.warning("cannot read the usage topic yet (%r); trying again in %.0f s", exc, RETRY_S)
                await self._follower.stop()
                await asyncio.sleep(RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._follower.stop()
        self.is_ready = False
