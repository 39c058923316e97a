"""The batcher's Kafka edge: records in, planner calls, records out, offsets committed.

Every request record taken from the requests topic is entered in the OffsetTracker and marked
done only once its effect is durable: its Batch (or terminal ReplyEnd, or DeadLetter) has been
acknowledged by the broker (acks=all, idempotent producer). A request the planner still holds is
not done, so its partition's committed position stays below it: a batcher killed at any moment
leaves it to be redone by whichever batcher owns the partition next.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from opentelemetry.trace import Span, SpanKind, StatusCode

from schemas.codec import DecodeError, decode, decode_request, encode, reply_address
from schemas.messages import (
    Batch,
    Cancellation,
    EmbedRequest,
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    ReplyEnd,
    WorkerHeartbeat,
)
from schemas.producers import ProducerBindingError, bind_to_producer
from schemas.topics import Topics
from services.batcher.metrics import BatcherMetrics
from services.batcher.mirroring import DEFAULT_MIRROR_MAX_QUEUED, assign_version, forged_traffic_fields, with_mirrors
from services.batcher.planner import Admission, Planner, Request, Reservation
from services.batcher.routing import Router
from weir.bus import CommitPacer, OffsetTracker, send_dead_letter
from weir.metrics import ServiceMetrics
from weir.reply_topics import TopicWriter
from weir.tracing import Tracing, child_context, extract, inject, inject_many, messaging, request_attributes

log = logging.getLogger(__name__)

SERVICE = "batcher"
_REPLY_WAIT_S = 0.5  # how long a round waits for its own terminal replies before it moves on


class BatchPublishError(RuntimeError):
    """A Batch could not be produced: the batcher stops, and a restart redoes its requests."""


@dataclass
class _Effect:
    """A produce in flight and the request records it completes once acknowledged."""

    future: asyncio.Future[Any]
    records: list[ConsumerRecord]
    kind: Literal["batch", "reply"]
    topic: str
    reservation: Reservation | None = None  # a routed batch's room, counted until its worker reads it
    waited: bool = False  # a reply settle() waited for once already: collected when done, not waited for


def _tp(record: ConsumerRecord) -> TopicPartition:
    return TopicPartition(record.topic, record.partition)


def _end_publish(span: Span, future: asyncio.Future[Any]) -> None:
    """End a batch's publish span when the broker answered: its offset, or the failure."""
    if future.cancelled() or future.exception() is not None:
        span.set_status(StatusCode.ERROR, repr(None if future.cancelled() else future.exception())[:1024])
    else:
        span.set_attributes(
            {
                "messaging.kafka.offset": future.result().offset,
                "messaging.destination.partition.id": str(future.result().partition),
            }
        )
    span.end()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Take a forgotten produce's outcome, so asyncio does not warn that nobody did."""
    if not future.cancelled():
        future.exception()


class BatcherHandlers:
    """Turns request and control records into planner calls and planner results into records.

    One instance per batcher process, driven by the loop in app.py: on_requests and on_cancels
    for each fetch, on_tick after them, then settle, which awaits the round's produces and
    commits what is durable.
    """

    def __init__(
        self,
        topics: Topics,
        planner: Planner,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        batcher_id: str,
        router: Router | None = None,
        commit_interval_ms: int = 0,
        reply_auto_create: bool = True,
        mirror_max_queued: int = DEFAULT_MIRROR_MAX_QUEUED,
        tracing: Tracing | None = None,
        metrics: BatcherMetrics | None = None,
    ) -> None:
        self.topics = topics
        # Batches, time held, expiries (metrics.py); a private provider when the caller exports none.
        self.metrics = metrics or BatcherMetrics(ServiceMetrics("batcher"))
        self.planner = planner
        self.router = router
        self._unrouted_models: set[str] = set()  # logged once: no heartbeat names them
        self._blocked_models: set[str] = set()  # held for lack of room, logged on change
        self.num_unresolved = 0  # requests rejected since start: their model did not resolve
        self.num_unservable: dict[
            str, int
        ] = {}  # per served_id: requests rejected since start, version failed everywhere
        self.batcher_id = batcher_id
        self._producer = producer
        # Reply topics are named by clients and may refuse writes (BusSettings.reply_topic_auto_create).
        self._replies = TopicWriter(producer, auto_create=reply_auto_create)
        self._consumer = consumer
        self._tracker = OffsetTracker()
        self._commits = CommitPacer(commit_interval_ms)
        self._held_records: dict[str, ConsumerRecord] = {}  # request_id -> its record, while held
        # Mirror copies held (docs/design.md, "Traffic policies"): copy id -> its live request's
        # record. A copy has no record of its own and holds no offset back: it is best effort, so a
        # batcher that stops loses the copies it held (the live record, if not yet committed, is
        # read again and copied again by the partition's next owner).
        self._copies: dict[str, ConsumerRecord] = {}
        self.mirror_max_queued = mirror_max_queued
        self.num_mirrors_dropped = 0  # mirror copies shed under load since start
        self._effects: list[_Effect] = []
        self._assigned: set[TopicPartition] = set()
        self._generation = 0  # bumped on each revocation: records fetched before it are stale
        self.tracing = tracing or Tracing.off(SERVICE)
        self._spans: dict[str, Span] = {}  # request_id -> its process span, while held

    # --- requests ---------------------------------------------------------------------------

    async def on_requests(self, fetched: dict[TopicPartition, list[ConsumerRecord]], now_ms: int) -> None:
        """Admit one fetch of request records; stops early if a rebalance revokes partitions."""
        generation = self._generation
        for tp, records in fetched.items():
            for record in records:
                if self._generation != generation or tp not in self._assigned:
                    break  # stale: the partition's next owner (maybe us again) reads it anew
                await self.on_request(record, now_ms)

    async def on_request(self, record: ConsumerRecord, now_ms: int) -> None:
        """Admit one request record: hold it, or end it at once (reject, time out, dead-letter)."""
        self._tracker.add(_tp(record), record.offset)
        try:
            req = decode_request(record.value)  # a GenerateRequest or an EmbedRequest, by kind
        except DecodeError as exc:
            await send_dead_letter(self._producer, self.topics, record, str(exc), SERVICE)
            address = reply_address(record.value, self.topics)
            if address is None or self.topics.request_source_problem(record.topic, address[1]) is not None:
                self._tracker.done(_tp(record), record.offset)
            else:  # it says who waits for it: end it there too (invariant 3), with the reason
                error = ErrorInfo(code="invalid_request", message=str(exc))
                await self._end_at(*address, record, "rejected", error)
            return
        if (problem := self.topics.reply_to_problem(req.reply_to)) is not None:
            # No reply: the topic it names is not one a reply may go to (docs/design.md, "Reply topics").
            await send_dead_letter(self._producer, self.topics, record, f"{problem}; no reply was written", SERVICE)
            self._tracker.done(_tp(record), record.offset)
            return
        try:  # an outside producer's request is its own (docs/design.md, "The Kafka trust boundary")
            req = bind_to_producer(self.topics, record.topic, req)
        except ProducerBindingError as exc:
            await send_dead_letter(self._producer, self.topics, record, f"{exc}; no reply was written", SERVICE)
            self._tracker.done(_tp(record), record.offset)
            return
        from_producer = self.topics.producer_of(record.topic) is not None
        if (forged := forged_traffic_fields(req, self.topics.shadow_replies, from_producer)) is not None:
            await send_dead_letter(self._producer, self.topics, record, forged, SERVICE)
            await self._end(req, record, "rejected", ErrorInfo(code="invalid_request", message=forged))
            return
        # Outside producers' bare names are assigned here, like the gateway's (docs/design.md, "Traffic policies").
        req = assign_version(req, self.planner.models)
        req, copies = with_mirrors(req, self.planner.models, self.topics.shadow_replies)
        span = self._process_span(record, req)
        verdict = self.planner.add(req, now_ms, size_bytes=len(record.value or b""))
        if verdict in (Admission.HELD, Admission.EXPIRED):
            self.metrics.on_admitted(req)
        if verdict is Admission.HELD:
            self._spans[req.request_id] = span
            self._held_records[req.request_id] = record
            await self._add_copies(copies, record, now_ms)
        else:  # ended here, at once
            span.set_attribute("weir.admission", verdict.name.lower())
            span.end()
        if verdict is Admission.DUPLICATE:
            # The first copy is held (its offset still pending) or already produced.
            self._tracker.done(_tp(record), record.offset)
        elif verdict is Admission.UNKNOWN_MODEL:  # unknown name, unregistered or retired version, malformed ref
            _, why = self.planner.resolve(req.model)  # no await since add(): the same registry state
            self.num_unresolved += 1
            error = ErrorInfo(code="model_not_found", message=why or f"model {req.model!r} is not served here")
            await self._end(req, record, "rejected", error)
        elif verdict is Admission.EXPIRED:
            self.metrics.on_expired(req)
            error = ErrorInfo(code="deadline_exceeded", message=f"deadline_ms={req.deadline_ms} passed before batching")
            await self._end(req, record, "timeout", error)
        elif verdict is Admission.CANCELLED:
            await self._end(req, record, "cancelled", None)

    def _process_span(self, record: ConsumerRecord, req: GenerateRequest | EmbedRequest) -> Span:
        """The request's span here, from its record's arrival until it is batched or ended, under
        the context its record's headers carry (docs/design.md, "Observability")."""
        attrs = {
            **messaging(
                "process",
                record.topic,
                offset=record.offset,
                partition=record.partition,
                group=self.topics.batcher_group,
            ),
            **request_attributes(req),
        }
        return self.tracing.start_span(
            f"{record.topic} process",
            extract(record.headers),
            kind=SpanKind.CONSUMER,
            request_id=req.request_id,
            attributes=attrs,
        )

    def _batch_span(self, batch: Batch, topic: str, partition: int | None) -> tuple[Span, list[tuple[str, bytes]]]:
        """The batch's publish span, linked to its requests' spans (one batch, many traces), and the
        headers of its record: the batch span's traceparent and each request's (weir-traceparents)."""
        spans = {
            r.request_id: span for r in batch.requests if (span := self._spans.pop(r.request_id, None)) is not None
        }
        contexts = {rid: child_context(span) for rid, span in spans.items()}
        attrs = {
            **messaging("send", topic, partition=partition),
            "gen_ai.request.model": batch.model,
            "weir.batch_id": batch.batch_id,
            "messaging.batch.message_count": len(batch.requests),
        }
        batch_span = self.tracing.start_span(
            f"{topic} publish", None, kind=SpanKind.PRODUCER, attributes=attrs, links=contexts.values()
        )
        for span in spans.values():
            span.set_attributes({"weir.batch_id": batch.batch_id, "weir.batch_topic": topic})
            span.end()
        return batch_span, inject(child_context(batch_span)) + inject_many(contexts)

    def _end_span(self, request_id: str, reason: str) -> None:
        if (span := self._spans.pop(request_id, None)) is not None:
            span.set_attribute("weir.outcome", reason)
            span.end()

    async def _add_copies(self, copies: list[Request], record: ConsumerRecord, now_ms: int) -> None:
        """Hold the mirror copies of a live request in their versions' lanes (the bulk lane), or
        drop them when more than mirror_max_queued copies wait already (the batcher is loaded)."""
        for copy in copies:
            if len(self._copies) >= self.mirror_max_queued:
                await self._drop_copy(copy, f"the batcher holds {len(self._copies)} mirror copies (its bound)")
                continue
            verdict = self.planner.add(copy, now_ms, size_bytes=len(encode(copy)))
            if verdict is Admission.HELD:
                self._copies[copy.request_id] = record
            elif verdict is Admission.EXPIRED:
                self.metrics.on_expired(copy)
                error = ErrorInfo(
                    code="deadline_exceeded", message=f"deadline_ms={copy.deadline_ms} passed before batching"
                )
                await self._end(copy, None, "timeout", error)
            elif verdict is not Admission.DUPLICATE:  # its version stopped resolving, or it was cancelled
                await self._end(
                    copy, None, "rejected", ErrorInfo(code="mirror_rejected", message=f"admission: {verdict}")
                )

    async def _shed_copies(self, why: str) -> None:
        """Drop every held mirror copy: live requests wait for room (docs/design.md, "Traffic policies")."""
        for copy_id in list(self._copies):
            del self._copies[copy_id]
            if (copy := self.planner.drop(copy_id)) is not None:
                await self._drop_copy(copy, why)

    async def _drop_copy(self, copy: Request, why: str) -> None:
        """End a mirror copy shed under load, on its (shadow) reply topic so the comparison knows; counted."""
        self.num_mirrors_dropped += 1
        await self._end(copy, None, "rejected", ErrorInfo(code="mirror_dropped", message=f"dropped under load: {why}"))

    def _take_record(self, request_id: str) -> ConsumerRecord | None:
        """The record a held request's end completes: its own, or None for a mirror copy."""
        if self._copies.pop(request_id, None) is not None:
            return None
        return self._held_records.pop(request_id)

    # --- control ----------------------------------------------------------------------------

    async def on_cancels(self, fetched: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Apply cancellations from the control topic."""
        for records in fetched.values():
            for record in records:
                await self.on_cancel(record)

    async def on_cancel(self, record: ConsumerRecord) -> None:
        """Drop the request if held and end it as cancelled; otherwise remember the cancel.

        Every batcher replica reads all of the control topic, so a malformed control record is
        logged, not dead-lettered (the replicas would each dead-letter it).
        """
        try:
            cancel = decode(Cancellation, record.value)
        except DecodeError as exc:
            log.warning("ignoring control record %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc)
            return
        req = self.planner.cancel(cancel.request_id)
        if req is not None:
            await self._end(req, self._take_record(req.request_id), "cancelled", None)

    # --- heartbeats --------------------------------------------------------------------------

    def on_heartbeats(self, fetched: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Update the live-worker table from worker heartbeats (the compacted workers topic)."""
        if self.router is None:
            return
        for records in fetched.values():
            for record in records:
                if record.value is None:
                    continue  # a tombstone: compaction's deletion marker
                try:
                    self.router.on_heartbeat(decode(WorkerHeartbeat, record.value))
                except DecodeError as exc:  # every batcher reads it whole: log, do not dead-letter
                    log.warning("ignoring heartbeat record %s@%d: %s", record.topic, record.offset, exc)

    # --- planning ---------------------------------------------------------------------------

    async def on_tick(self, now_ms: int) -> None:
        """Reject the requests of versions no worker can serve, drop the mirror copies when live
        requests wait for room, publish the batches due at now_ms and time out the requests that
        expired while held."""
        await self._reject_unservable(now_ms)
        # Mirror copies go first while live requests wait for room (as the last poll found), and
        # before this poll may batch any of them (docs/design.md, "Traffic policies").
        if self._copies and self.planner.is_live_blocked():
            await self._shed_copies("interactive requests wait for worker room")
        result = self.planner.poll(now_ms, self.router)
        blocked = set(self.planner.blocked_models())
        for model in blocked - self._blocked_models:
            live = self.router.live_workers(model, now_ms) if self.router is not None else []
            log.info("holding model %s: no live worker has room (live: %s)", model, live)
        for model in self._blocked_models - blocked:
            log.info("model %s: a worker has room again", model)
        self._blocked_models = blocked
        for planned in result.batches:
            self.metrics.on_batch(planned, now_ms)
            records = [rec for r in planned.requests if (rec := self._take_record(r.request_id)) is not None]
            batch = Batch(
                batch_id=uuid.uuid4().hex, model=planned.model, requests=planned.requests, batcher_id=self.batcher_id
            )
            topic = self.topics.batches(planned.model)
            partition = planned.slot.partition
            if partition is None and self.router is not None and planned.model not in self._unrouted_models:
                self._unrouted_models.add(planned.model)
                log.warning("no worker heartbeat names model %s: its batches go keyed, unrouted", planned.model)
            elif partition is not None:
                self._unrouted_models.discard(planned.model)
            batch_span, headers = self._batch_span(batch, topic, partition)
            future = await self._send(topic, encode(batch), batch.batch_id, partition, headers=headers)
            future.add_done_callback(functools.partial(_end_publish, batch_span))
            self._effects.append(_Effect(future, records, "batch", topic, planned.reservation))
        for req in result.expired:
            self.metrics.on_expired(req)
            error = ErrorInfo(code="deadline_exceeded", message=f"deadline_ms={req.deadline_ms} passed while waiting")
            await self._end(req, self._take_record(req.request_id), "timeout", error)

    async def _reject_unservable(self, now_ms: int) -> None:
        """End at once, as rejected, the held requests of each version that every live worker
        reporting it failed or refused (routing.Router.version_problem): none would be served
        before its deadline, and the client learns why (e.g. a file that did not verify)."""
        if self.router is None:
            return
        for served_id in self.planner.held_models():
            problem = self.router.version_problem(served_id, now_ms)
            if problem is None:
                continue
            dropped = self.planner.drop_model(served_id)
            log.warning("rejecting %d held requests of %s: %s", len(dropped), served_id, problem)
            self.num_unservable[served_id] = self.num_unservable.get(served_id, 0) + len(dropped)
            for req in dropped:
                error = ErrorInfo(code="model_unavailable", message=problem)
                await self._end(req, self._take_record(req.request_id), "rejected", error)

    async def _end(
        self,
        req: GenerateRequest | EmbedRequest,
        record: ConsumerRecord | None,
        reason: FinishReason,
        error: ErrorInfo | None,
    ) -> None:
        """Produce the request's one terminal event; its record (None: a mirror copy's, which has
        none) is done once that is durable."""
        await self._end_at(req.request_id, req.reply_to, record, reason, error)

    async def _end_at(
        self,
        request_id: str,
        reply_to: str,
        record: ConsumerRecord | None,
        reason: FinishReason,
        error: ErrorInfo | None,
    ) -> None:
        self._end_span(request_id, reason)
        end = ReplyEnd(request_id=request_id, seq=0, finish_reason=reason, error=error)
        future = await self._send(reply_to, encode(end), request_id, via=self._replies)
        self._effects.append(_Effect(future, [] if record is None else [record], "reply", reply_to))

    async def _send(
        self,
        topic: str,
        value: bytes,
        key: str,
        partition: int | None = None,
        via: TopicWriter | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        """Produce through the producer, or `via` a TopicWriter (reply topics: one that refuses
        writes fails its own sends, never waits the loop out)."""
        try:
            if via is not None:
                return await via.send(topic, value, key.encode(), partition)
            return await self._producer.send(topic, value, key=key.encode(), partition=partition, headers=headers)
        except KafkaError as exc:  # e.g. no metadata for the topic: reported when settled
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    # --- offsets ----------------------------------------------------------------------------

    async def settle(self) -> None:
        """Await the round's produces, mark their records done, commit what is durable (at most
        once per commit interval; the next round after it, idle or not, commits the rest).

        A reply that cannot be produced dead-letters its request record (nobody could read the
        reply). A reply still waiting for its topic (TopicWriter looks a new one up) is left to a
        later round, so a reply topic that is slow to appear, or refuses writes, holds up no
        other request. A batch that cannot be produced raises BatchPublishError after the commit:
        its requests stay uncommitted and are redone after restart.
        """
        effects = await self._due_effects()
        outcomes = await asyncio.gather(*(e.future for e in effects), return_exceptions=True)
        failure: BaseException | None = None
        for effect, outcome in zip(effects, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if effect.kind == "batch":
                    failure = failure or outcome
                    log.error("could not produce a batch to %s: %r", effect.topic, outcome)
                    continue
                for record in effect.records:
                    reason = f"could not produce the terminal reply to reply_to={effect.topic!r}: {outcome!r}"
                    await send_dead_letter(self._producer, self.topics, record, reason, SERVICE)
            elif effect.reservation is not None:
                effect.reservation.offset = outcome.offset  # the worker's read position will pass it
            for record in effect.records:
                self._tracker.done(_tp(record), record.offset)
        if failure is not None or self._commits.is_due():
            await self.commit()
        if failure is not None:
            raise BatchPublishError(f"producing a batch failed ({failure!r}); is the broker reachable?")

    async def _due_effects(self) -> list[_Effect]:
        """The round's effects to settle now; the replies that are not done yet stay in _effects.

        A reply waits for its topic while TopicWriter looks a new one up (up to its lookup
        timeout), and a write to a topic deleted meanwhile hangs until the producer's request
        timeout: settling them here would hold every other request's batch behind them. A reply
        is waited for once, briefly (a healthy one is acknowledged in milliseconds), and then
        only collected when done, in a later round.
        """
        effects, self._effects = self._effects, []
        fresh = [
            e.future for e in effects if e.kind == "reply" and not e.waited and not self._replies.is_looking_up(e.topic)
        ]
        if pending := [f for f in fresh if not f.done()]:
            await asyncio.wait(pending, timeout=_REPLY_WAIT_S)
        due: list[_Effect] = []
        for effect in effects:
            if effect.kind == "reply" and not effect.future.done():
                effect.waited = True
                self._effects.append(effect)
            else:
                due.append(effect)
        return due

    async def commit(self) -> None:
        """Commit the positions below which every record's effect is durable."""
        positions = self._tracker.committable()
        if not positions:
            return
        try:
            await self._consumer.commit(positions)
        except KafkaError as exc:  # e.g. a rebalance took the partitions: their next owner redoes them
            log.warning("commit of %s failed: %r", positions, exc)

    @property
    def num_mirrors_held(self) -> int:
        """Mirror copies waiting in lanes."""
        return len(self._copies)

    @property
    def num_in_flight(self) -> int:
        """Request records taken whose effects are not durable yet (held ones included)."""
        return self._tracker.num_in_flight()

    # --- rebalances ---------------------------------------------------------------------------

    async def on_assigned(self, partitions: set[TopicPartition]) -> None:
        """Partitions this batcher now owns; the consumer reads them from their committed positions."""
        self._assigned |= partitions

    async def on_revoked(self, partitions: set[TopicPartition]) -> None:
        """Commit what is durable, then forget the partitions and release their held requests:
        their records will be read again, from the committed position, by their next owner."""
        self._generation += 1
        await self.commit()
        self._assigned -= partitions
        self._tracker.forget(partitions)
        # Replies left to a later round (settle) of these records: their next owner redoes them.
        for effect in [e for e in self._effects if any(_tp(r) in partitions for r in e.records)]:
            self._effects.remove(effect)
            effect.future.add_done_callback(_retrieve)
        for request_id, record in list(self._held_records.items()):
            if _tp(record) in partitions:
                self.planner.release(request_id)
                del self._held_records[request_id]
                self._end_span(request_id, "revoked")
        for copy_id, record in list(self._copies.items()):  # their live record is read again, and copied again
            if _tp(record) in partitions:
                self.planner.release(copy_id)
                del self._copies[copy_id]


class RebalanceListener(ConsumerRebalanceListener):
    """Forwards the requests consumer's rebalances to BatcherHandlers."""

    def __init__(self, handlers: BatcherHandlers) -> None:
        self._handlers = handlers

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        log.info("partitions revoked: %s", sorted(revoked))
        await self._handlers.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("partitions assigned: %s", sorted(assigned))
        await self._handlers.on_assigned(set(assigned))
