"""A body with n (or best_of) > 1 at the gateway: its sibling requests read as one stream.

docs/design.md, "n and best_of are sibling requests": the gateway publishes one GenerateRequest
per choice (schemas/openai_bodies.py: sibling_requests), each an Exchange of its own (its own deadline,
reply route, admission and Cancellation). A SiblingGroup stands where one Exchange does for the
edge (streaming.py, resume.StreamEntry): the client sees one request, whose events are the
siblings' merged as they arrive, each tagged with its choice index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from schemas.messages import CancelReason, GenerateRequest, ReplyEnd
from services.gateway.kafka_bus import Exchange
from services.gateway.openai_format import terminal_error
from services.gateway.replies import ReplyItem

Tagged = tuple[int, ReplyItem]  # (choice index, event of that sibling)


class SiblingGroup:
    """The Exchanges of one body's sibling requests, read as one stream.

    `request` is the parent's (the id, model and deadline the client sees; it has no record of its
    own). Each sibling's events come in its seq order; the merged order is kept in `history`, so a
    cancelled read loses nothing. The group ends when every sibling finished, or at the first one
    that failed: the request fails as a whole, and the others are cancelled at once
    (Cancellation(client_disconnect), as when the client leaves).
    """

    def __init__(self, request: GenerateRequest, exchanges: list[Exchange], num_choices: int) -> None:
        self.request = request
        self.exchanges = exchanges
        self.num_choices = num_choices  # the n kept of the siblings (best_of: fewer than there are)
        self.history: list[Tagged] = []
        self._next = [0] * len(exchanges)  # per sibling: the index of its next event
        self._reads: dict[int, asyncio.Future[ReplyItem]] = {}  # outlive a cancelled reader
        self._reading = asyncio.Lock()
        self._ended: set[int] = set()  # siblings whose terminal is in `history`
        self._is_failed = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def size(self) -> int:
        return len(self.exchanges)

    @property
    def is_closed(self) -> bool:
        return all(exchange.is_closed for exchange in self.exchanges)

    @property
    def end(self) -> ReplyEnd | None:
        """A failed sibling's terminal, else the last sibling's once every one has ended; None before."""
        ends = [exchange.end for exchange in self.exchanges]
        failed = [end for end in ends if end is not None and terminal_error(end) is not None]
        if failed:
            return failed[0]
        return ends[-1] if all(end is not None for end in ends) else None

    @property
    def is_done(self) -> bool:
        """Every event the group gives is in `history`."""
        return self._is_failed or len(self._ended) == self.size

    async def tagged(self) -> AsyncIterator[tuple[int, int, ReplyItem]]:
        """(position in the merged stream, choice index, event) from the start, until the group is done."""
        index = 0
        while not (self.is_done and index >= len(self.history)):
            choice, event = await self.event_at(index)
            yield index, choice, event
            index += 1

    async def event_at(self, index: int) -> Tagged:
        """The index-th event of the merged stream, waiting for it; past the end, the last one."""
        while index >= len(self.history):
            if self.is_done:
                return self.history[-1]
            async with self._reading:
                if index >= len(self.history) and not self.is_done:
                    await self._read_some()
        return self.history[index]

    async def _read_some(self) -> None:
        # One wait for the first sibling with news; what arrived together goes in sibling order.
        for i, exchange in enumerate(self.exchanges):
            if i not in self._reads and i not in self._ended:
                self._reads[i] = asyncio.ensure_future(exchange.event_at(self._next[i]))
        await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
        for i in sorted(i for i, read in self._reads.items() if read.done()):
            event = self._reads.pop(i).result()
            self._next[i] += 1
            self.history.append((i, event))
            if isinstance(event, ReplyEnd):
                self._ended.add(i)
                if terminal_error(event) is not None:
                    self._fail()
                    return

    def _fail(self) -> None:
        self._is_failed = True
        self._stop_reads()
        for exchange in self.exchanges:
            if exchange.end is None:
                exchange.close("client_disconnect", status="sibling_failed")

    def _stop_reads(self) -> None:
        for read in self._reads.values():
            read.cancel()
        self._reads.clear()

    def drain(self) -> None:
        """Move what each sibling has queued into its history without waiting (nobody reads the group)."""
        self._stop_reads()  # a cancelled wait of an Exchange loses nothing (kafka_bus.Exchange.event_at)
        for exchange in self.exchanges:
            exchange.drain()

    def close(self, abandon_reason: CancelReason | None, status: int | str) -> None:
        """Close every sibling: those that have not ended publish a Cancellation when a reason is
        given, or when another failed (a group ended by a failure nobody read yet)."""
        self._stop_reads()
        end = self.end
        if abandon_reason is None and end is not None and terminal_error(end) is not None:
            abandon_reason = "client_disconnect"
        for exchange in self.exchanges:
            exchange.close(abandon_reason, status)


Streamed = Exchange | SiblingGroup  # what a client reads: one request, or the siblings of a body with n > 1
