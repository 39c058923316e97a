"""Adaptive coalescing of one run's reply records (docs/design.md, "Coalesced reply deltas").

A request's reply events go out one record each while the producer keeps up: when no record of
the run is in flight (produced, not yet acknowledged), an event is handed to the producer at once,
so nothing waits at low load. While one is in flight, the events that follow are held, and
consecutive deltas among them join into one (schemas/reply_stream.py: merge); when the record in
flight is acknowledged (or fails), what was held goes out, in order, the end last. So a request
sends at most one record per produce round trip, and its records stay in order: the end never
overtakes a delta. How positions were grouped does not matter to a reader, which keeps positions
by index (a regenerated run may group them otherwise).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine

from schemas.messages import ReplyDelta, ReplyEnd
from schemas.reply_stream import can_merge, merge

ReplyItem = ReplyDelta | ReplyEnd


class ReplyLane:
    """One run's reply records on their way to the producer.

    `send` hands a record to the producer and returns the future of its durable write; `note` is
    told of each such future (the publisher's failure bookkeeping); `is_broken` says the run had a
    failed write (then nothing more of it is sent); `spawn` runs a coroutine as a task.
    """

    def __init__(
        self,
        send: Callable[[ReplyItem], Awaitable[asyncio.Future]],
        note: Callable[[asyncio.Future], None],
        is_broken: Callable[[], bool],
        spawn: Callable[[Coroutine], object],
    ) -> None:
        self._send = send
        self._note = note
        self._is_broken = is_broken
        self._spawn = spawn
        self._last: asyncio.Future | None = None  # the durable write of the last record handed out
        self._held: list[ReplyItem] = []
        self._waiting = False  # held records wait for `_last` (or are being handed out)
        self._idle = asyncio.Event()
        self._idle.set()
        self.num_events = 0  # events offered
        self.num_records = 0  # records handed to the producer

    async def offer(self, event: ReplyItem) -> None:
        """Send `event` now when no record of the run is in flight; else hold it (joined to a held
        delta it continues) until the one in flight is done."""
        if self._is_broken():
            return
        self.num_events += 1
        if not self._waiting and (self._last is None or self._last.done()):
            await self._write(event)
            return
        held = self._held[-1] if self._held else None
        if isinstance(event, ReplyDelta) and isinstance(held, ReplyDelta) and can_merge(held, event):
            self._held[-1] = merge(held, event)
        else:
            self._held.append(event)
        if not self._waiting:
            self._wait_for_last()

    async def drained(self) -> None:
        """Return once every event offered so far was handed to the producer (or dropped, the run
        being broken)."""
        await self._idle.wait()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _wait_for_last(self) -> None:
        assert self._last is not None
        self._waiting = True
        self._idle.clear()
        self._last.add_done_callback(lambda _done: self._spawn(self._flush()))

    async def _flush(self) -> None:
        held, self._held = self._held, []
        for event in held:
            if self._is_broken():
                break
            await self._write(event)
        if self._held and not self._is_broken():
            self._wait_for_last()  # offered while the held ones were handed out: the next round
            return
        self._held.clear()
        self._waiting = False
        self._idle.set()

    async def _write(self, event: ReplyItem) -> None:
        future = await self._send(event)
        self._last = future
        self.num_records += 1
        self._note(future)
