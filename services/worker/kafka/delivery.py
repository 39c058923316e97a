"""Writing a request's events while the broker may be away.

Every event of a run (its deltas, its terminal, its AuditEvent) is one produce. When any of them
fails, the run is broken: its reader would see a gap, or never its terminal. The worker then stops
that run in the engine and runs the request again from the start a little later, with the same
seed (docs/design.md, invariant 3): readers drop the seqs they already have. RedoPolicy (pure) says
when, or that it is no use. Writer fails sends at once while the broker is known to be away,
rather than let each one wait out aiokafka's request timeout (for metadata, or for room in a full
batch) on the loop that publishes every other request's tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError

from weir.reply_topics import TopicWriter, failed_future


def is_outage(exc: BaseException) -> bool:
    """True for a failure a later try can fix (no broker, no leader, a timeout); False for one
    about the record or its topic (an invalid name, too large, not authorised: TopicRefused)."""
    return isinstance(exc, KafkaTimeoutError) or bool(getattr(exc, "retriable", False))


@dataclass(frozen=True)
class RedoPolicy:
    """When a request whose run could not be written runs again."""

    first_delay_s: float = 0.5
    max_delay_s: float = 5.0
    # After its deadline a request is run once more only to write its `timeout` terminal (the
    # engine refuses it); the gateway has told its own client by then. Past this, give up.
    grace_after_deadline_s: float = 60.0

    def next_try_s(self, failure: BaseException, num_redos: int, deadline_ms: int, now_ms: int) -> float | None:
        """Seconds until the request runs again, or None when redoing cannot help: the failure is
        not an outage (the reply topic itself is refused), or the deadline is past the grace."""
        if not is_outage(failure) or now_ms > deadline_ms + self.grace_after_deadline_s * 1000:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2**num_redos)


def failure_of(future: asyncio.Future) -> BaseException | None:
    """The exception of a future that is done and failed (retrieved, so asyncio does not warn of
    it); None while it is pending or when it succeeded."""
    if not future.done():
        return None
    if future.cancelled():
        return asyncio.CancelledError("the write was cancelled")
    return future.exception()


async def first_failure(futures: list[asyncio.Future]) -> BaseException | None:
    """Wait for every future; the first failure among them in order, or None when all succeeded.
    Every failure is retrieved."""
    pending = [f for f in futures if not f.done()]
    if pending:
        await asyncio.wait(pending)
    first = None
    for future in futures:
        exc = failure_of(future)
        first = first or exc
    return first


class Writer:
    """The worker's producer, failing fast while the broker is away.

    After a send fails for an outage, sends within the next `probe_interval_s` fail at once
    without being tried; the first one after it tries for real. Any write that succeeds ends
    the outage.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        probe_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        auto_create: bool = True,
    ) -> None:
        self.producer = producer
        # A reply topic that refuses writes fails only its own sends; `auto_create`: whether a
        # reply topic that does not exist is created (BusSettings.reply_topic_auto_create).
        self.topics = TopicWriter(producer, auto_create=auto_create)
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._skip_until: float | None = None  # while in the future, sends are failed untried

    @property
    def is_down(self) -> bool:
        """True since a send failed for an outage, until one succeeds."""
        return self._skip_until is not None

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future:
        """Produce one record (with trace `headers`); returns the future of its durable write (failed if it cannot be)."""
        if self._skip_until is not None and self._clock() < self._skip_until:
            return failed_future(KafkaConnectionError("not tried: the broker did not take a write in the last second"))
        try:
            future = await self.topics.send(topic, value, key, headers=headers)
        except KafkaError as exc:
            self._on_result(exc)
            return failed_future(exc)
        future.add_done_callback(self._on_done)
        return future

    def _on_done(self, future: asyncio.Future) -> None:
        if not future.cancelled():
            self._on_result(future.exception())

    def _on_result(self, exc: BaseException | None) -> None:
        if exc is None:
            self._skip_until = None
        elif is_outage(exc):
            self._skip_until = self._clock() + self.probe_interval_s
