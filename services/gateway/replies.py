"""ReplyRouter: hands each request's reply events to the one waiter of that request, in seq order.

Delivery is at-least-once (docs/design.md, invariant 3): a worker that restarts resends seqs the reader
already has, and a redone request can interleave with its first try. Per request the router
keeps the next expected seq, drops any seq already delivered or buffered, buffers seqs that
arrive early, and ends the request at the first terminal it delivers. No I/O: the reply consumer
calls `on_event`, the request's handler reads its queue.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from schemas.messages import ReplyDelta, ReplyEnd

log = logging.getLogger(__name__)

ReplyItem = ReplyDelta | ReplyEnd


@dataclass
class _Route:
    queue: asyncio.Queue[ReplyItem] = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    early: dict[int, ReplyItem] = field(default_factory=dict)  # seq -> event that arrived ahead of a gap
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
        if event.seq < route.next_seq or event.seq in route.early:
            route.num_dropped += 1
            return False
        if event.seq > route.next_seq:
            route.early[event.seq] = event
            return False
        self._deliver(route, event)
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
        first = min(route.early)
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
        while not route.is_ended and route.next_seq in route.early:
            self._deliver(route, route.early.pop(route.next_seq))

    @staticmethod
    def _deliver(route: _Route, event: ReplyItem) -> None:
        route.queue.put_nowait(event)
        route.next_seq = max(route.next_seq, event.seq + 1)
        if isinstance(event, ReplyEnd):
            route.is_ended = True
            route.early.clear()
