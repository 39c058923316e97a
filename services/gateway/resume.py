"""Resumable streams: a client that loses its connection reconnects and gets what it missed.

Every streamed request is registered here while a client reads it. A request asked with a resume
grace (X-Weir-Resume-Grace-S, or the deployment's WEIR_RESUME_GRACE_S) outlives its connection:
when its last reader leaves before the end, it keeps running for the grace period, its events
accumulating in the Exchange's history, and a reader that comes back in time (SSE Last-Event-ID
on GET /v1/streams/{id}, or a WebSocket resume frame) reads the rest from where it stopped; no
token is generated twice. Only when nobody came back does the gateway publish
Cancellation(client_disconnect) (or deadline, if that passed first). A request without a grace
is cancelled as soon as its reader leaves, as before: a disconnect stops the worker at once.

A finished resumable stream stays readable for keep_s (a client that missed only the tail). The
store holds at most max_streams entries; past that the oldest ones without a reader are dropped
(a held request among them is cancelled). This state is per gateway instance; a stream is also
registered on weir.streams (`journal`: its StreamRecord, updated when it ends, a tombstone when it
is forgotten), so a client whose gateway died resumes it through any other (stream_index.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.messages import CancelReason, StreamRecord, now_ms
from services.gateway.guard.auth import Owner
from services.gateway.openai_format import ApiError, ChunkWriter, header_seconds
from services.gateway.siblings import Streamed

RESUME_GRACE_HEADER = "x-weir-resume-grace-s"


def resume_grace_s(headers: dict[str, str], default_s: float, max_s: float) -> float:
    """The request's resume grace: X-Weir-Resume-Grace-S (0, or 0.001 to max_s), else the
    deployment's default; ApiError(400) naming the header when it is not a number in range."""
    grace_s = header_seconds(headers, "X-Weir-Resume-Grace-S", max_s, may_be_zero=True)
    return default_s if grace_s is None else grace_s


def stream_not_found(request_id: str) -> ApiError:
    """The one answer for a stream a reader may not resume, whatever the reason (docs/design.md, "Ownership")."""
    return ApiError(
        404,
        f"no resumable stream {request_id!r} (unknown, not resumable, or expired)",
        param="request_id",
        code="stream_not_found",
    )


@dataclass
class StreamEntry:
    """One registered stream: its Exchange, who may read it, how to render it again."""

    store: ResumableStreams
    exchange: Streamed  # one request, or the siblings of a body with n > 1 (merged in a kept order)
    new_writer: Callable[[], ChunkWriter]  # a fresh writer: a reader renders the stream from its start
    grace_s: float
    owner: Owner  # only the same owner reads it again (docs/design.md, "Ownership")
    record: StreamRecord | None = None  # its durable entry on weir.streams, when it has one
    num_readers: int = 1
    kept_until_s: float | None = None  # set once finished: readable until then
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.exchange.request_id

    @property
    def is_resumable(self) -> bool:
        return self.grace_s > 0

    def leave(self) -> None:
        """One reader is done with the stream (finished, or its connection dropped)."""
        self.store.detach(self)

    def cancel(self, reason: CancelReason) -> None:
        """End the request now for every reader (an explicit cancel); it can no longer be resumed."""
        self.store.forget(self)
        self.exchange.close(reason, status="cancelled")


class ResumableStreams:
    """The streams of one gateway instance that a client may read again."""

    def __init__(
        self,
        keep_s: float,
        max_streams: int,
        clock: Callable[[], float] = time.monotonic,
        journal: Callable[[str, StreamRecord | None], None] | None = None,
    ) -> None:
        self.keep_s = keep_s
        self.max_streams = max_streams
        self.clock = clock
        self.journal = journal  # publishes a durable stream's record update, or (None) its tombstone
        self._entries: OrderedDict[str, StreamEntry] = OrderedDict()
        self.num_resumed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def add(
        self,
        exchange: Streamed,
        new_writer: Callable[[], ChunkWriter],
        grace_s: float,
        owner: Owner,
        record: StreamRecord | None = None,
    ) -> StreamEntry:
        """Register a stream of `owner` that one reader starts reading now; returns its entry.
        `record`: what was written on weir.streams for it (kept up to date from here)."""
        entry = StreamEntry(self, exchange, new_writer, grace_s, owner, record)
        if entry.is_resumable:
            self._prune()
            self._entries[entry.request_id] = entry
        return entry

    def attach(self, request_id: str, owner: Owner) -> StreamEntry:
        """A reader comes back: the entry of `request_id`, now with one more reader.

        Raises ApiError 404 when no resumable stream of `owner` has that id here: unknown, never
        resumable, expired, served by another instance, or another owner's (docs/design.md,
        "Ownership": the answer does not tell that it exists).
        """
        self._prune()
        entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner or (entry.exchange.is_closed and entry.exchange.end is None):
            raise stream_not_found(request_id)
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.num_readers += 1
        self.num_resumed += 1
        return entry

    def detach(self, entry: StreamEntry) -> None:
        """A reader left (finished, or its connection dropped). The last one to leave a stream that
        has not ended either cancels it (no grace) or holds it for the grace period."""
        entry.num_readers -= 1
        if entry.num_readers > 0 or self._close_if_ended(entry):
            return
        exchange = entry.exchange
        if not entry.is_resumable:
            exchange.close("client_disconnect", status="client_gone")
            return
        to_deadline_s = (exchange.request.deadline_ms - now_ms()) / 1000
        delay_s = max(0.0, min(entry.grace_s, to_deadline_s))
        entry.timer = asyncio.get_running_loop().call_later(delay_s, self._give_up, entry)

    def forget(self, entry: StreamEntry) -> None:
        """Drop the entry (after an explicit cancel): it can no longer be resumed."""
        if entry.timer is not None:
            entry.timer.cancel()
        self._entries.pop(entry.request_id, None)
        self._write(entry, None)

    def _write(self, entry: StreamEntry, record: StreamRecord | None) -> None:
        # Keeps weir.streams in step: the record once ended (ended_ms), a tombstone once forgotten.
        if entry.record is None or self.journal is None:
            return
        if record is None:
            entry.record = None  # one tombstone
        self.journal(entry.request_id, record)

    def _give_up(self, entry: StreamEntry) -> None:
        # Nobody came back within the grace: end the request like any abandoned one.
        entry.timer = None
        if entry.num_readers > 0 or self._close_if_ended(entry):
            return
        is_late = now_ms() >= entry.exchange.request.deadline_ms
        entry.exchange.close("deadline" if is_late else "client_disconnect", status="client_gone")
        self._entries.pop(entry.request_id, None)
        self._write(entry, None)

    def _close_if_ended(self, entry: StreamEntry) -> bool:
        # A stream nobody reads that has its terminal (maybe still queued) closes without a cancel
        # and stays readable for keep_s.
        entry.exchange.drain()
        if entry.exchange.end is None:
            return False
        entry.exchange.close(None, status="ended")
        if entry.kept_until_s is None and entry.record is not None:
            self._write(entry, entry.record.model_copy(update={"ended_ms": now_ms()}))
        entry.kept_until_s = self.clock() + self.keep_s
        return True

    def _prune(self) -> None:
        now_s = self.clock()
        for request_id, entry in list(self._entries.items()):
            if entry.kept_until_s is not None and entry.kept_until_s <= now_s:
                del self._entries[request_id]
                self._write(entry, None)
        for entry in list(self._entries.values()):
            if len(self._entries) < self.max_streams:
                return
            if entry.num_readers == 0:  # oldest first (insertion order)
                self.forget(entry)
                entry.exchange.close("client_disconnect", status="evicted")
