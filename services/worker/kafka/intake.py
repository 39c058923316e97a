"""The requests a model server has taken from its batch topic, and when each batch is done.

A batch's offset may be committed only once every request in it has its terminal event durably
written. Intake keeps that account: the requests in flight (one run answers a request that came
twice, in a redelivered batch), how many requests of each batch record are still open, and the
OffsetTracker that turns done records into committable positions. Pure bookkeeping: no I/O, no
clock; the Kafka consumer (consumers.py) drives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from opentelemetry.trace import INVALID_SPAN, Span

from schemas.messages import EmbedRequest, GenerateRequest
from weir.bus import OffsetTracker

if TYPE_CHECKING:
    from services.worker.hosts.runner import EngineHost
    from services.worker.kafka.coalesce import ReplyLane

RecordKey = tuple[TopicPartition, int]  # a batch record: (partition, offset)
# How a request was routed, not what it asks: the batcher may route a redelivered request anew
# (a mirror paced differently), so a redelivery may differ here and still be the same request.
ROUTING_FIELDS = frozenset({"assignment", "mirrors"})


class ConflictingRequest(Exception):
    """A request reuses the request_id of one in flight here with other content: a forged record,
    or a producer's id collision. It is neither run nor answered (its reply_to may be the running
    request's topic: like a refused reply_to, docs/design.md "Reply topics", it is dead-lettered and
    no reply is written anywhere); the one in flight is unaffected."""


@dataclass
class InFlight:
    """A request the worker has taken, and the batch offsets waiting for its end."""

    request: GenerateRequest | EmbedRequest
    batch_id: str
    offsets: list[RecordKey] = field(default_factory=list)
    host: EngineHost | None = None  # the engine host running it (its last run); None: never submitted
    futures: list[asyncio.Future] = field(default_factory=list)  # every write of the current run
    failure: BaseException | None = None  # the first write of the current run that failed
    num_redos: int = 0
    token_ids: list[int] = field(
        default_factory=list
    )  # the current run's answer, kept for a mirrored request's ShadowLive
    span: Span = INVALID_SPAN  # its process span here (services/worker/kafka/traces.py), ended with its final output
    lane: ReplyLane | None = None  # the current run's reply records, coalesced (services/worker/kafka/coalesce.py)


class Intake:
    """Requests in flight and the batch records they hold open."""

    def __init__(self) -> None:
        self.tracker = OffsetTracker()
        self.in_flight: dict[str, InFlight] = {}
        self.next_offsets: dict[int, int] = {}  # owned partition -> next batch offset read (heartbeats)
        self.num_done = 0
        self._batch_left: dict[RecordKey, int] = {}  # open requests per batch record

    def add_record(self, tp: TopicPartition, offset: int) -> None:
        """A batch record was read (its requests are added with add_batch, or it is skipped)."""
        self.tracker.add(tp, offset)
        self.next_offsets[tp.partition] = offset + 1

    def skip_record(self, tp: TopicPartition, offset: int) -> None:
        """A record with nothing to run (dead-lettered): done at once."""
        self.tracker.done(tp, offset)

    def add_batch(self, key: RecordKey, num_requests: int) -> None:
        """The record at `key` holds `num_requests` requests, each taken next with take()."""
        self._batch_left[key] = num_requests

    def take(self, request: GenerateRequest | EmbedRequest, batch_id: str, key: RecordKey) -> InFlight | None:
        """The new flight of a request of the batch at `key`, to be started; None when the
        request is in flight already (a redelivered batch): its one run then answers both.

        Raises ConflictingRequest when the request in flight under that id asks for something
        else (its content differs beyond ROUTING_FIELDS); this request is then done in its batch."""
        flight = self.in_flight.get(request.request_id)
        if flight is not None:
            if _content(flight.request) != _content(request):
                self._close(key)
                raise ConflictingRequest(request.request_id)
            flight.offsets.append(key)
            return None
        flight = self.in_flight[request.request_id] = InFlight(request, batch_id, [key])
        return flight

    def is_current(self, flight: InFlight) -> bool:
        """Whether `flight` is still the request's flight here (not ended, not revoked and retaken)."""
        return self.in_flight.get(flight.request.request_id) is flight

    def forget(self, flight: InFlight) -> None:
        """The request is done here: its batch records are done once every request of each is."""
        if not self.is_current(flight):
            return
        del self.in_flight[flight.request.request_id]
        self.num_done += 1
        for key in flight.offsets:
            self._close(key)

    def _close(self, key: RecordKey) -> None:
        """One request of the batch record at `key` is done: the record is, once all of them are."""
        left = self._batch_left.get(key)
        if left is None:
            return
        if left <= 1:
            del self._batch_left[key]
            self.tracker.done(*key)
        else:
            self._batch_left[key] = left - 1

    def revoke(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions lost to a rebalance: forget their records (their new owner redoes the rest)."""
        revoked = set(partitions)
        self.tracker.forget(list(revoked))
        for key in [k for k in self._batch_left if k[0] in revoked]:
            del self._batch_left[key]

    def keep_partitions(self, partitions: Iterable[int]) -> None:
        """Partitions assigned now: forget the next offsets of those no longer owned."""
        for partition in set(self.next_offsets) - set(partitions):
            del self.next_offsets[partition]


def _content(request: GenerateRequest | EmbedRequest) -> dict:
    """What a request asks and who gets the answer: all of it but ROUTING_FIELDS."""
    return request.model_dump(exclude=set(ROUTING_FIELDS))
