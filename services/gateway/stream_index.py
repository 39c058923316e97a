"""Streams that outlive their gateway (docs/design.md, "Scale-out and failover": "Streams outlive
their gateway").

A resumable stream of one request is registered on weir.streams (a StreamRecord, written with the
request: kafka_bus.GatewayBus.submit). Every gateway follows that topic (StreamIndex), so a client
whose gateway died reconnects to any other with Last-Event-ID: RemoteResumes checks the owner,
reads the dead gateway's reply topic from the record's start_offset with a group-less consumer
(one per resumed stream, at most max_remote_resumes at once), orders and dedupes the events of
that request id with a fresh ReplyRouter, and hands them to the same renderer and output guard
as a local resume (streaming.py), live until the terminal. Nothing here cancels the request: only
an explicit cancel by its client does (then a Cancellation is published as usual).

Not registered (a resume elsewhere is a 404, as for any stream another gateway does not know): a
body with n > 1 (the merged order of its siblings is the order one gateway saw them, which another
cannot rebuild) and a completion with echo (its first chunk is the prompt, which a StreamRecord
never holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, ValidationError

from schemas.codec import DecodeError, decode, decode_reply
from schemas.messages import CancelReason, GenerateRequest, ReplyEnd, StreamRecord, now_ms
from schemas.topics import Topics
from schemas.traffic import Assignment
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import Owner
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.openai_format import ApiError, ChunkWriter, Kind, LogprobsFormat
from services.gateway.replies import ReplyRouter
from services.gateway.resume import ResumableStreams, StreamEntry, stream_not_found
from weir.bus import TopicFollower, make_consumer

log = logging.getLogger(__name__)


class BeyondTheEnd(ValueError):
    """A stream record whose start_offset is past the end of its reply topic."""


class RenderSpec(BaseModel):
    """A StreamRecord's `render`: what ChunkWriter needs to render the stream again, and the
    version it is pinned to (its x-weir-model-version); never prompt text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    model: str  # as the client sees it (the served id)
    pinned: str  # name@version the request went out pinned to
    created_s: int
    include_usage: bool
    logprobs: LogprobsFormat | None = None
    assignment: Assignment | None = None


def durable_record(
    request: GenerateRequest,
    writer: ChunkWriter,
    owner: Owner,
    grace_s: float,
    gateway_id: str,
    reply_topic: str,
    start_offset: int,
) -> StreamRecord | None:
    """The StreamRecord of a streamed request (SSE or WebSocket) asked with a resume grace, or
    None when another gateway could not render it (echo: its first chunk is the prompt) or it is
    not resumable."""
    if grace_s <= 0 or writer.echo is not None:
        return None
    render = RenderSpec(
        kind=writer.kind,
        model=writer.model,
        pinned=request.model,
        created_s=writer.created_s,
        include_usage=writer.include_usage,
        logprobs=writer.logprobs,
        assignment=request.assignment,
    )
    return StreamRecord(
        request_id=request.request_id,
        member_ids=[request.request_id],
        owner_tenant=owner.tenant,
        owner_credential=owner.credential,
        owner_principal=owner.principal,
        gateway_id=gateway_id,
        reply_topic=reply_topic,
        reply_partition=0,
        start_offset=start_offset,
        grace_s=grace_s,
        deadline_ms=request.deadline_ms,
        render=render.model_dump(),
    )


def record_problem(topics: Topics, key: str, record: StreamRecord) -> str | None:
    """Why a record read from weir.streams must not be used, or None. A forged one could point a
    reader at a topic that is not a reply topic, or at events of requests it does not name."""
    if record.request_id != key:
        return f"its key {key[:80]!r} is not its request_id"
    problem = topics.reply_to_problem(record.reply_topic)
    if problem is not None:
        return problem
    if record.reply_partition != 0:
        return f"reply_partition is {record.reply_partition}: a reply topic has one partition, 0 (Topics.reply_spec)"
    if record.member_ids != [record.request_id]:
        return "member_ids must be [request_id]: only a stream of one request is resumed elsewhere"
    try:
        RenderSpec.model_validate(record.render)
    except ValidationError as exc:
        return f"render is not what a gateway writes: {exc.errors()[0]['msg']}"
    return None


def expires_ms(record: StreamRecord, keep_s: float, reply_grace_s: float) -> int:
    """When nobody can resume it any more: keep_s after its end, or after its deadline (and the
    wait for a late terminal) when no end was recorded (its gateway died before it)."""
    ended_ms = record.ended_ms if record.ended_ms is not None else record.deadline_ms + int(reply_grace_s * 1000)
    return ended_ms + int(keep_s * 1000)


class StreamIndex:
    """Every gateway's resumable streams, from weir.streams read whole: at most `max_streams`
    entries (the oldest go first), each until it expires (expires_ms)."""

    def __init__(self, settings: GatewaySettings, client_id: str, clock: Callable[[], int] = now_ms) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.clock = clock
        self.num_ignored = 0
        self._records: OrderedDict[str, StreamRecord] = OrderedDict()
        self._follower = TopicFollower(settings, self.topics.streams, client_id, self.on_record)

    def __len__(self) -> int:
        return len(self._records)

    async def start(self) -> None:
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()

    def on_record(self, key: bytes | None, value: bytes | None, message: ConsumerRecord | None = None) -> None:
        """Apply one record of weir.streams; a bad one is ignored with a log line (docs/design.md, invariant 6)."""
        where = f"{message.topic}[{message.partition}]@{message.offset}" if message is not None else "a record"
        if not isinstance(key, bytes):
            return self._ignore(where, "it has no key")
        request_id = key.decode("utf-8", "replace")
        if value is None:  # tombstone: forgotten
            self._records.pop(request_id, None)
            return
        try:
            record = decode(StreamRecord, value)
        except DecodeError as exc:
            return self._ignore(where, str(exc))
        problem = record_problem(self.topics, request_id, record)
        if problem is not None:
            return self._ignore(where, problem)
        self._records.pop(request_id, None)
        self._records[request_id] = record  # newest last
        self._prune()

    def lookup(self, request_id: str) -> StreamRecord | None:
        """The live record of `request_id`, or None (unknown, forgotten or expired)."""
        record = self._records.get(request_id)
        if record is not None and self._is_expired(record):
            del self._records[request_id]
            return None
        return record

    def _is_expired(self, record: StreamRecord) -> bool:
        return expires_ms(record, self.settings.resume_keep_s, self.settings.reply_grace_s) <= self.clock()

    def _prune(self) -> None:
        while self._records:
            oldest = next(iter(self._records.values()))
            if len(self._records) <= self.settings.max_indexed_streams and not self._is_expired(oldest):
                return
            self._records.popitem(last=False)

    def _ignore(self, where: str, reason: str) -> None:
        self.num_ignored += 1
        log.warning("ignoring stream record %s: %s", where, reason)


def owner_of(record: StreamRecord) -> Owner:
    return Owner(record.owner_tenant, record.owner_credential, record.owner_principal)


@dataclass(frozen=True)
class StreamFacts:
    """What the edge reads of a resumed stream's request (its id, pinned version, times and
    assignment), where its gateway is gone and its GenerateRequest with it."""

    request_id: str
    model: str
    created_ms: int
    deadline_ms: int
    assignment: Assignment | None


class RemoteExchange(Exchange):
    """A request another gateway published, read from that gateway's reply topic: the same
    ordering, gap skipping and deadline as an Exchange, with a router of its own."""

    def __init__(self, bus: GatewayBus, facts: StreamFacts, router: ReplyRouter) -> None:
        super().__init__(bus, facts, router.register(facts.request_id))  # type: ignore[arg-type]  # reads only StreamFacts' fields
        self.router = router


class ReplyReader:
    """Reads one reply topic partition from an offset and routes the events of `member_ids` to
    `router`, until the terminal is delivered or it is stopped."""

    def __init__(self, settings: GatewaySettings, record: StreamRecord, router: ReplyRouter, client_id: str) -> None:
        self.settings = settings
        self.record = record
        self.router = router
        self.client_id = client_id
        self.members = frozenset(record.member_ids)
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        r = self.record
        self._consumer = make_consumer(self.settings, client_id=self.client_id, group_id=None)
        await self._consumer.start()
        tp = TopicPartition(r.reply_topic, r.reply_partition)
        self._consumer.assign([tp])
        # A start past the topic's end (a forged record; nothing a gateway writes) would wait for
        # events that never come, holding a resume slot and the client until the deadline.
        end = (await self._consumer.end_offsets([tp]))[tp]
        if r.start_offset > end:
            raise BeyondTheEnd(
                f"start_offset {r.start_offset} of {r.request_id} is past the end of {r.reply_topic} ({end})"
            )
        self._consumer.seek(tp, r.start_offset)
        self._task = asyncio.create_task(self._read(), name=f"resume-{r.request_id}")

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                fetched = await self._consumer.getmany(timeout_ms=500)
            except KafkaError as exc:  # a failed fetch must not end the stream: its deadline does
                log.warning(
                    "reading %s for %s: %r; fetching again in 1 s", self.record.reply_topic, self.record.request_id, exc
                )
                await asyncio.sleep(1.0)
                continue
            for records in fetched.values():
                for message in records:
                    if self.on_value(message.value):
                        return

    def on_value(self, value: bytes | None) -> bool:
        """Route one record's event when it is one of this stream's; True once its terminal is delivered.
        Not dead-lettered: the gateway that owns the topic already did that for a bad record."""
        try:
            event = decode_reply(value)
        except DecodeError:
            return False
        if event.request_id not in self.members:
            return False  # another request's: this reader may render only the ones its record names
        return self.router.on_event(event) and isinstance(event, ReplyEnd)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


class RemoteEntry(StreamEntry):
    """A resumed stream of another gateway: one reader. Leaving closes its reply reader and
    cancels nothing (the client may resume again, here or elsewhere); an explicit cancel
    publishes the Cancellation."""

    remotes: RemoteResumes | None = None
    reader: ReplyReader | None = None

    def leave(self) -> None:
        self.exchange.close(None, status="resumed_elsewhere")
        self._release()

    def cancel(self, reason: CancelReason) -> None:
        self.exchange.close(reason, status="cancelled")
        self._release()

    def _release(self) -> None:
        if self.remotes is not None:
            remotes, self.remotes = self.remotes, None
            remotes.release(self)


class RemoteResumes:
    """The resumes of other gateways' streams this gateway serves, at most max_remote_resumes at once."""

    def __init__(self, settings: GatewaySettings, bus: GatewayBus, index: StreamIndex, local: ResumableStreams) -> None:
        self.settings = settings
        self.bus = bus
        self.index = index
        self.local = local
        self._open: dict[int, RemoteEntry] = {}  # by id(): an entry (a dataclass) is not hashable
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        await self.index.start()

    async def stop(self) -> None:
        for entry in list(self._open.values()):
            entry.leave()
        if self._closing:
            await asyncio.wait(self._closing, timeout=5.0)
        await self.index.stop()

    async def attach(self, request_id: str, owner: Owner) -> RemoteEntry:
        """A reader of a stream this gateway does not hold: its entry, read from Kafka.

        Raises 404 stream_not_found as resume.ResumableStreams.attach does (unknown, expired or
        another owner's: the answer does not tell which), 429 past max_remote_resumes."""
        record = self.index.lookup(request_id)
        if record is None or owner_of(record) != owner:
            raise stream_not_found(request_id)
        if self.num_open >= self.settings.max_remote_resumes:
            raise ApiError(
                429,
                f"this gateway already serves {self.num_open} resumed streams of other gateways; retry shortly",
                code="too_many_resumes",
            )
        render = RenderSpec.model_validate(record.render)
        router = ReplyRouter()
        facts = StreamFacts(request_id, render.pinned, record.created_ms, record.deadline_ms, render.assignment)
        exchange = RemoteExchange(self.bus, facts, router)
        reader = ReplyReader(self.settings, record, router, f"{self.bus.gateway_id}-resume")
        try:
            await reader.start()
        except BeyondTheEnd as exc:
            log.warning("ignoring the stream record of %s: %s", request_id, exc)
            exchange.close(None, status=404)
            await reader.stop()
            raise stream_not_found(request_id) from None
        except KafkaError as exc:
            exchange.close(None, status=503)
            await reader.stop()
            raise ApiError(503, f"the stream's replies cannot be read now: {exc!r}", code="unavailable") from None

        def new_writer() -> ChunkWriter:
            return ChunkWriter(
                render.kind, request_id, render.model, render.created_s, render.include_usage, render.logprobs
            )

        entry = RemoteEntry(self.local, exchange, new_writer, record.grace_s, owner, record)
        entry.remotes, entry.reader = self, reader
        self._open[id(entry)] = entry
        return entry

    def release(self, entry: RemoteEntry) -> None:
        """An entry is done: stop its reader (in the background: called from sync code)."""
        self._open.pop(id(entry), None)
        if entry.reader is not None:
            task = asyncio.get_running_loop().create_task(entry.reader.stop())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
