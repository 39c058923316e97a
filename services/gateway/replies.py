"""ReplyRouter: hands each request's reply events to the one waiter of that request, in position order.

Delivery is at-least-once (docs/design.md, invariant 3): a worker that restarts resends positions
the reader already has, and a redone request can interleave with its first try, its deltas grouping
positions otherwise (coalesced deltas: docs/wire-contract.md, "Reading replies"). Per request the
router keeps the positions delivered (`next_seq`: all before it), cuts from a delta the positions it
has (schemas/reply_stream.py: cut) and drops one it has whole, buffers deltas that start past it,
and ends the request at the first terminal it delivers. So each position is delivered once, and
the events a request's reader gets are a function of the records in topic order. No I/O: the
reply consumer calls `on_event`, the request's handler reads its queue.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from schemas.messages import ReplyDelta, ReplyEnd
from schemas.reply_stream import cut

log = logging.getLogger(__name__)

ReplyItem = ReplyDelta | ReplyEnd


@dataclass
class _Route:
    queue: asyncio.Queue[ReplyItem] = field(default_factory=asyncio.Queue)
    next_seq: int = 0  # the positions delivered: all before it
    # (seq, 0 for a delta or 1 for a terminal) -> an event that starts past a gap
    early: dict[tuple[int, int], ReplyItem] = field(default_factory=dict)
    is_ended: bool = False
    num_dropped: int = 0


class ReplyRouter:
    """Per-request queues of deduplicated, ordered reply events."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}

    def register(self, request_id: str) -> asyncio.Queue[ReplyItem]:
        """Open the route of a request before it is published; returns the queue its events go to."""
        if request_id in self._routes:
            raise ValueError(f"request {request_id!r} is already registered")
        route = _Route()
        self._routes[request_id] = route
        return route.queue

    def unregister(self, request_id: str) -> None:
        """Close the route; later events of that request are ignored."""
        self._routes.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._routes

    def __len__(self) -> int:
        return len(self._routes)

    def on_event(self, event: ReplyItem) -> bool:
        """Route one decoded reply event; returns True when it was delivered (now or from a buffer).

        Called by the reply consumer for every event on this instance's reply topic.
        """
        route = self._routes.get(event.request_id)
        if route is None or route.is_ended:
            return False  # not ours any more (finished, or abandoned by its client)
        if isinstance(event, ReplyEnd) and event.seq <= route.next_seq:
            # A terminal never repeats a delta's slot: one at or behind the expected seq comes from a
            # hop that did not see the deltas (a batcher's timeout/rejection); the first one ends it.
            self._deliver(route, event)
            return True
        if event.seq > route.next_seq:
            slot = (event.seq, 1 if isinstance(event, ReplyEnd) else 0)
            buffered = route.early.get(slot)
            if buffered is not None and _reach(buffered) >= _reach(event):
                route.num_dropped += 1  # a repeat of what waits (or less of it)
                return False
            route.early[slot] = event
            return False
        part = cut(event, route.next_seq) if isinstance(event, ReplyDelta) else None
        if part is None:
            route.num_dropped += 1  # every position of it was delivered
            return False
        self._deliver(route, part)
        self._drain(route)
        return True

    def has_gap(self, request_id: str) -> bool:
        """True when events wait behind a missing seq."""
        route = self._routes.get(request_id)
        return bool(route and route.early and not route.is_ended)

    def skip_gap(self, request_id: str) -> int:
        """Give up on the missing seqs: deliver what is buffered in order; returns how many were skipped.

        Called by a request's handler when a gap has stayed open too long: a reader prefers a
        visible hole (the SSE id lines jump) to a request that never ends.
        """
        route = self._routes.get(request_id)
        if route is None or not route.early or route.is_ended:
            return 0
        first = min(route.early)[0]
        skipped = first - route.next_seq
        log.warning("request %s: seqs %d..%d never arrived; skipping", request_id, route.next_seq, first - 1)
        route.next_seq = first
        self._drain(route)
        return skipped

    def next_seq(self, request_id: str) -> int:
        """The seq the request expects next (0 when unknown)."""
        route = self._routes.get(request_id)
        return route.next_seq if route else 0

    def num_dropped(self, request_id: str) -> int:
        """How many repeats of this request were dropped so far."""
        route = self._routes.get(request_id)
        return route.num_dropped if route else 0

    def _drain(self, route: _Route) -> None:
        while not route.is_ended and route.early:
            first = min(route.early)
            if first[0] > route.next_seq:
                return
            event = route.early.pop(first)
            if isinstance(event, ReplyEnd):
                self._deliver(route, event)
                return
            part = cut(event, route.next_seq)
            if part is None:
                route.num_dropped += 1
                continue
            self._deliver(route, part)

    @staticmethod
    def _deliver(route: _Route, event: ReplyItem) -> None:
        route.queue.put_nowait(event)
        route.next_seq = max(route.next_seq, _reach(event))
        if isinstance(event, ReplyEnd):
            route.is_ended = True
            route.early.clear()


def _reach(event: ReplyItem) -> int:
    """The positions a reader holds once it has `event`: a delta's end, a terminal's seq."""
    return event.end if isinstance(event, ReplyDelta) else event.seq
