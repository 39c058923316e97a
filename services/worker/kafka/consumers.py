"""The worker's Kafka edge: batches in, token deltas, terminal events and audit events out.

A batch's offset is committed only when every request in it has its terminal event durably
written (acks=all). A worker killed at any moment therefore leaves its unfinished batches
uncommitted; the consumer group hands them to another worker (or this one, restarted), which
regenerates them with the same seeds. Readers drop the repeated deltas by sequence number. A run
whose events cannot be written (the broker is away) is stopped and run again here once writes
may succeed (publisher.py, delivery.py), the same way.

The parts: intake.py keeps the account of requests and batch offsets, dispatch.py sends each to an
engine host or ends it (refusals.py: what never reaches the model), events.py builds the wire events
of an engine output, publisher.py writes and settles each run; this module consumes batches and
cancellations and builds the parts in that order, each handed what it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, InvalidSessionTimeoutError, KafkaError
from opentelemetry.context import Context

from schemas.codec import DecodeError, decode
from schemas.messages import Batch, Cancellation, EmbedRequest, GenerateRequest, now_ms
from schemas.model_repo import ModelConfig
from schemas.topics import Topics
from services.worker.engine import EngineOutput
from services.worker.hosts.runner import EngineHost
from services.worker.kafka.delivery import RedoPolicy, Writer
from services.worker.kafka.dispatch import Dispatch
from services.worker.kafka.fingerprints import FingerprintBatcher
from services.worker.kafka.intake import ConflictingRequest, InFlight, Intake, RecordKey
from services.worker.kafka.membership import FenceWatch, Membership, stop_consumer
from services.worker.kafka.publisher import Publisher
from services.worker.kafka.serving_metrics import Recorder
from services.worker.kafka.traces import process_span
from weir.bus import BusSettings, CommitPacer, make_consumer, partitions_of, send_dead_letter
from weir.tracing import Tracing, extract, extract_many

log = logging.getLogger(__name__)

_CANCEL_MEMORY_MS = 15 * 60 * 1000


class ModelServer:
    """Serves one model version: consumes its batch topic (Topics.batches(name@version)) in the
    version's group, runs engine instances (docs/design.md, "The model registry").

    Wiring: Intake keeps the account of taken requests and batch offsets, Dispatch ends what
    must not reach the model and gives the rest to the least busy engine host, and Publisher
    writes each run's events and settles it (a run it could not write goes through Dispatch again).
    """

    def __init__(
        self,
        config: ModelConfig,
        runners: list[EngineHost],
        settings: BusSettings,
        producer: AIOKafkaProducer,
        worker_id: str,
        audit_key: bytes,
        fingerprints: FingerprintBatcher | None = None,
        redo_policy: RedoPolicy | None = None,
        tracing: Tracing | None = None,
        recorder: Recorder | None = None,
        membership: Membership | None = None,
        outputs: asyncio.Queue[list[EngineOutput]] | None = None,
        on_assignment: Callable[[], None] | None = None,
    ) -> None:
        """`runners` are the version's engine hosts, open; `outputs` the queue they put their outputs
        on (given to them when they were opened; None: a new one, fed by on_outputs)."""
        self.config = config
        self.served_id = config.served_id
        self.membership = membership or Membership()
        self.tracing = tracing or Tracing.off("worker")
        self.runners = runners
        self.settings = settings
        self.topics: Topics = settings.topics
        self.producer = producer
        self.worker_id = worker_id
        self.on_assignment = on_assignment  # called when Kafka assigns partitions
        # The parts, each built before what uses it: the account, where requests run, the writes.
        self.intake = Intake()
        self.dispatch = Dispatch(config, runners)
        self.publisher = Publisher(
            config,
            Writer(producer, auto_create=settings.reply_topic_auto_create),
            self.topics.audit,
            self.intake,
            self.dispatch,
            worker_id=worker_id,
            audit_key=audit_key,
            fingerprints=fingerprints,
            redo_policy=redo_policy,
            shadow_live_topic=self.topics.shadow_live,
            tracing=self.tracing,
            recorder=recorder,
            dead_letter_topic=self.topics.dead_letter,
        )
        self._commits = CommitPacer(settings.commit_interval_ms)
        self._outputs: asyncio.Queue[list[EngineOutput]] = outputs if outputs is not None else asyncio.Queue()
        self.num_invalid_reply_to = 0  # requests dead-lettered for their reply_to, since start
        self.consumer: AIOKafkaConsumer | None = None
        self.last_read_ms = now_ms()  # when a batch record was last read (draining waits for quiet)
        self.is_taking = True  # False: take no new batches (an unhealthy version finishes what runs)
        self.num_forged = 0  # batches dead-lettered for naming another version than their topic's

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        """Engine outputs, on the loop (the hosts were opened with the queue's put_nowait, or this)."""
        self._outputs.put_nowait(outputs)

    # -- consuming ----------------------------------------------------------------------------

    async def consume(self) -> None:
        """Take batches while engines have room; pause the partitions while they do not."""
        member = self.membership
        self.consumer = make_consumer(
            self.settings,
            client_id=self.worker_id,
            group_id=self.topics.worker_group(self.served_id),
            max_poll_records=8,
            session_timeout_ms=member.session_timeout_ms,
            heartbeat_interval_ms=member.heartbeat_interval_ms,
            group_instance_id=member.instance,
        )
        self.consumer.subscribe([self.topics.batches(self.served_id)], listener=_Revoked(self))
        try:
            await self.consumer.start()
        except BaseException:  # cancelled while joining (a version unloaded, the worker stopping)
            await self.consumer.stop()
            raise
        fence = FenceWatch(self.consumer, member) if member.instance is not None else None
        try:
            while True:
                if fence is not None and (notice := fence.notice()) is not None:
                    log.warning("%s", notice)
                room = self.config.max_num_seqs * len(self.runners) - len(self.intake.in_flight)
                assigned = self.consumer.assignment()
                if room <= 0 or not self.is_taking:
                    self.consumer.pause(*assigned)
                else:
                    self.consumer.resume(*assigned)
                try:
                    records = await self.consumer.getmany(timeout_ms=100)
                except InvalidSessionTimeoutError as exc:
                    raise RuntimeError(
                        f"the broker refuses WEIR_WORKER_SESSION_TIMEOUT_MS={member.session_timeout_ms} "
                        "(its group.min.session.timeout.ms is higher; Kafka's default is 6000): lower the broker's "
                        "or raise the worker's"
                    ) from exc
                for tp, batch in records.items():
                    for record in batch:
                        await self.on_batch_record(tp, record)
                if self._commits.is_due():
                    await self.commit()
        finally:
            with contextlib.suppress(
                TimeoutError, KafkaError
            ):  # what is durable now: a clean stop leaves nothing to redo
                await asyncio.wait_for(self.commit(), 3.0)
            # A stop (SIGTERM, a version unloaded) leaves the group: the other workers take
            # the partitions now rather than after the session (docs/worker.md, "Failover").
            await stop_consumer(self.consumer)

    def owned_partitions(self) -> tuple[list[int], dict[int, int]]:
        """The batch-topic partitions this server owns now, and the next offset it reads in each:
        what heartbeats advertise, so the batcher routes batches here and knows what was read."""
        owned = sorted(tp.partition for tp in self.consumer.assignment()) if self.consumer is not None else []
        next_offsets = self.intake.next_offsets
        return owned, {p: next_offsets[p] for p in owned if p in next_offsets}

    async def on_batch_record(self, tp: TopicPartition, record) -> None:
        self.intake.add_record(tp, record.offset)
        self.last_read_ms = now_ms()
        try:
            batch = decode(Batch, record.value)
        except DecodeError as exc:
            await send_dead_letter(self.producer, self.topics, record, str(exc), self.worker_id)
            self.intake.skip_record(tp, record.offset)
            return
        if batch.model != self.served_id:  # forged, or misrouted: never served by another version (invariant 10)
            self.num_forged += 1
            reason = (
                f"batch {batch.batch_id!r} names model {batch.model!r} on the batch topic of {self.served_id}; not run"
            )
            await send_dead_letter(self.producer, self.topics, record, reason, self.worker_id)
            self.intake.skip_record(tp, record.offset)
            return
        key: RecordKey = (tp, record.offset)
        runnable = []
        for request in batch.requests:
            problem = self.topics.reply_to_problem(request.reply_to)
            if problem is None:
                runnable.append(request)
                continue
            # Never run, never answered: no reply may go where it says (docs/design.md, "Reply topics").
            self.num_invalid_reply_to += 1
            reason = f"request {request.request_id!r} of batch {batch.batch_id!r}: {problem}; it was not run, no reply was written"
            await send_dead_letter(self.producer, self.topics, record, reason, self.worker_id)
        if not runnable:
            self.intake.skip_record(tp, record.offset)
            return
        self.intake.add_batch(key, len(runnable))
        parents, batch_ctx = extract_many(record.headers), extract(record.headers)  # malformed: new traces
        for request in runnable:
            await self.on_request(request, batch.batch_id, key, record, parents.get(request.request_id), batch_ctx)

    async def on_request(
        self,
        request: GenerateRequest | EmbedRequest,
        batch_id: str,
        key: RecordKey,
        record: ConsumerRecord | None = None,
        parent: Context | None = None,
        batch_ctx: Context | None = None,
    ) -> None:
        """Take one request of a batch record; its span continues `parent`, the context its batch
        carried for it (None: a new trace), linked to the batch's span (`batch_ctx`)."""
        try:
            flight = self.intake.take(request, batch_id, key)
        except ConflictingRequest:  # never answered: its reply_to may be the running request's topic
            await self.on_conflict(request, batch_id, record)
            return
        if flight is not None:  # None: the same request twice (a redelivered batch), one run answers both
            if record is not None:
                group = self.topics.worker_group(self.served_id)
                flight.span = process_span(self.tracing, record, request, batch_id, parent, batch_ctx, group)
            await self.start(flight)

    async def on_conflict(
        self, request: GenerateRequest | EmbedRequest, batch_id: str, record: ConsumerRecord | None
    ) -> None:
        """Make a request that reuses a live request_id with other content visible: dead-lettered
        (send_dead_letter logs it at WARNING), not run; the running request is untouched."""
        reason = (
            f"request {request.request_id!r} of batch {batch_id!r}: duplicate request_id with different content "
            "(another request runs under that id); it was not run, no reply was written"
        )
        if record is None:
            log.warning("%s", reason)
            return
        await send_dead_letter(self.producer, self.topics, record, reason, self.worker_id)

    async def start(self, flight: InFlight) -> None:
        """Run a request taken from a batch: on an engine, or ended here when it is refused."""
        refused = self.dispatch.run(flight, now_ms())
        if refused is not None:  # it never reaches the engine
            await self.publisher.send_output(flight, refused)

    def on_cancel(self, cancel: Cancellation) -> None:
        self.dispatch.recent_cancels[cancel.request_id] = now_ms()
        flight = self.intake.in_flight.get(cancel.request_id)
        if flight is not None and flight.host is not None:
            log.info("cancel request_id=%s reason=%s: aborting it", cancel.request_id, cancel.reason)
            flight.host.cancel(cancel.request_id)

    def forget_old_cancels(self) -> None:
        cutoff = now_ms() - _CANCEL_MEMORY_MS
        recent = self.dispatch.recent_cancels
        for rid in [r for r, t in recent.items() if t < cutoff]:
            del recent[rid]

    # -- producing ----------------------------------------------------------------------------

    async def publish(self) -> None:
        """Turn engine outputs into reply and audit events, in order, and settle offsets."""
        while True:
            outputs = await self._outputs.get()
            for runner in self.runners:
                if runner.failure is not None:
                    raise RuntimeError(f"engine of {self.served_id} failed: {runner.failure!r}")
            for out in outputs:
                flight = self.intake.in_flight.get(out.request_id)
                if flight is None:
                    continue  # warmup, or a request this worker no longer owns
                await self.publisher.send_output(flight, out)

    async def commit(self) -> None:
        positions = self.intake.tracker.committable()
        if not positions or self.consumer is None:
            return
        try:
            await self.consumer.commit(positions)
        except (CommitFailedError, KafkaError) as exc:
            log.warning("commit failed (%r); the batches will be redone by their new owner", exc)


class _Revoked(ConsumerRebalanceListener):
    """On losing partitions: commit what is durable, then forget them (their new owner redoes the rest)."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server

    async def on_partitions_revoked(self, revoked) -> None:
        await self.server.commit()
        self.server.intake.revoke(revoked)

    async def on_partitions_assigned(self, assigned) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))
        self.server.intake.keep_partitions(tp.partition for tp in assigned)
        if self.server.on_assignment is not None:
            self.server.on_assignment()  # tell the batchers at once, not at the next heartbeat


async def open_cancellations(settings: BusSettings, worker_id: str) -> AIOKafkaConsumer:
    """A consumer of every partition of the control topic, positioned at the recent history.

    Called before the worker says it is ready, so no cancel published after that can be missed:
    the end offsets are read before the lookback is searched, and a partition with nothing recent
    starts at that end offset (not at a lazily resolved "latest", which would skip whatever was
    produced in between).
    """
    topics = settings.topics
    consumer = make_consumer(settings, client_id=worker_id, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        # Every partition: a Cancellation lands on the partition of its request_id's hash.
        parts = [TopicPartition(topics.control, p) for p in sorted(await partitions_of(consumer, topics.control))]
        consumer.assign(parts)
        ends = await consumer.end_offsets(parts)
        since = await consumer.offsets_for_times({tp: now_ms() - _CANCEL_MEMORY_MS for tp in parts})
        for tp in parts:
            found = since.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
    except BaseException:
        await consumer.stop()
        raise
    return consumer


async def consume_cancellations(
    consumer: AIOKafkaConsumer,
    settings: BusSettings,
    on_cancel: Callable[[Cancellation], None],
    producer,
    worker_id: str,
) -> None:
    """Hand each cancel of the control topic (from open_cancellations) to `on_cancel` (the version
    manager's: every model server hears it)."""
    topics = settings.topics
    try:
        async for record in consumer:
            try:
                cancel = decode(Cancellation, record.value)
            except DecodeError as exc:
                await send_dead_letter(producer, topics, record, str(exc), worker_id)
                continue
            on_cancel(cancel)
    finally:
        await consumer.stop()
