"""Kafka edge of the auditor: decode audit records, append them to the ledger, dead-letter the rest.

The audit topic carries AuditEvents (from workers) and ReviewFlags (from gateways' input guards),
told apart by `kind` (schemas.codec.decode_audit_record); both go into the ledger, each into its
own hash chains. Records are taken a fetched batch at a time and each batch is one group commit
(AuditBatches): the SQLite commit first, then the offsets (docs/design.md, invariant 3). A record
that is no audit record is dead-lettered, durably, before its offset is committed. A ledger write
that fails is read again after a pause, never skipped.

FastStream as FastStream: the subscriber's decoder turns each fetched batch into typed AuditItems
(the handler never parses bytes), dead letters go out through the broker's own publisher, and
acknowledgement is FastStream's: `msg.ack()` commits a batch that is stored whole. Only when the
ledger refuses a record does the handler commit by itself, partition by partition, because
FastStream's `nack()` rewinds every partition of the batch and one refused record would then hold
back every other chain (docs/design.md, "FastStream and raw aiokafka").

Each checkpoint the ledger writes is published to the anchor topic (AnchorPublisher;
services/auditor/anchors.py) right after the batch that made it, and again by the app's timer
until one publish succeeds (docs/design.md, "The audit chain").
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from opentelemetry.trace import Span, SpanKind

from schemas.codec import DecodeError, decode_audit_record, encode
from schemas.messages import SCHEMA_VERSION, AuditAnchor, AuditEvent, ReviewFlag
from schemas.registry import ModelComparison
from schemas.topics import Topics
from services.auditor.anchors import anchor_key
from services.auditor.config import AuditorSettings
from services.auditor.health import HealthMetrics
from services.auditor.ledger import BatchOutcome, Ledger, UsageKey, unstorable_reason
from weir.bus import consumer_settings, dead_letter_of
from weir.tracing import Tracing, extract, messaging

log = logging.getLogger(__name__)

SERVICE = "auditor"


def decode_audit_value(value: bytes | None) -> AuditEvent | ReviewFlag:
    """One audit-topic record's value to an AuditEvent or ReviewFlag (by `kind`), or DecodeError
    with why."""
    record = decode_audit_record(value or b"")
    if record.schema_version > SCHEMA_VERSION:
        raise DecodeError(f"schema_version {record.schema_version} is newer than this auditor's {SCHEMA_VERSION}")
    if (reason := unstorable_reason(record)) is not None:
        raise DecodeError(f"invalid {type(record).__name__}: {reason}")
    return record


class LedgerWriter:
    """A Ledger on one dedicated thread, so SQLite's fsync never blocks the event loop."""

    def __init__(self, settings: AuditorSettings) -> None:
        self.target = settings.ledger_target()
        self._key = settings.checkpoint_key()  # made at the first start; a bad key file is a configuration error
        self._every_records = settings.audit_checkpoint_every_records
        self._every_s = settings.audit_checkpoint_every_s
        self._executor: ThreadPoolExecutor | None = None
        self._ledger: Ledger | None = None

    @property
    def name(self) -> str:
        """The ledger's file, or database (without credentials), for log lines."""
        return str(self.target).split("@")[-1]

    async def open(self) -> None:
        """Open (creating if needed) the ledger; called once at startup."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._ledger = await self._run(
            lambda: Ledger(
                self.target,
                checkpoint_every_records=self._every_records,
                checkpoint_every_s=self._every_s,
                checkpoint_key=self._key,
            )
        )

    async def checkpoint_due(self) -> int:
        """Ledger.checkpoint_due on the ledger thread (called on a timer)."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return int(await self._run(self._ledger.checkpoint_due))

    async def traffic_rows(self) -> list[tuple[str, str | None, str, int]]:
        """Ledger.traffic_rows on the ledger thread: the counts the traffic counter starts from."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        rows: list[tuple[str, str | None, str, int]] = await self._run(self._ledger.traffic_rows)
        return rows

    async def drift_rows(self, first: int, last: int) -> list[tuple[str, str, int, str, float]]:
        """Ledger.drift_rows on the ledger thread: the values the health monitor starts from."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        rows: list[tuple[str, str, int, str, float]] = await self._run(self._ledger.drift_rows, first, last)
        return rows

    async def comparable_events(self, limit: int) -> list[AuditEvent]:
        """Ledger.comparable_events on the ledger thread: what the determinism comparison starts from."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        events: list[AuditEvent] = await self._run(self._ledger.comparable_events, limit)
        return events

    async def usage_of(self, key: UsageKey) -> tuple[int, int, int, int]:
        """Ledger.usage_of on the ledger thread: one key's token totals (services/auditor/usage.py)."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return tuple(await self._run(self._ledger.usage_of, key))

    async def usage_keys_since(self, since_ms: int) -> list[UsageKey]:
        """Ledger.usage_keys_since on the ledger thread."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return list(await self._run(self._ledger.usage_keys_since, since_ms))

    async def tokens_served_since(self, since_ms: int) -> dict[str, int]:
        """Ledger.tokens_served_since on the ledger thread: what the rate cards are measured from."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return dict(await self._run(self._ledger.tokens_served_since, since_ms))

    async def latest_anchors(self) -> list[AuditAnchor]:
        """Ledger.latest_anchors on the ledger thread: the newest checkpoint of every chain."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        anchors: list[AuditAnchor] = await self._run(self._ledger.latest_anchors)
        return anchors

    async def append_batch(self, items: list[tuple[AuditEvent | ReviewFlag, int, int]]) -> BatchOutcome:
        """Ledger.append_batch on the ledger thread: one group commit of a consumed batch."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        outcome: BatchOutcome = await self._run(self._ledger.append_batch, items)
        return outcome

    async def add_comparison(self, comparison: ModelComparison) -> bool:
        """Ledger.add_comparison on the ledger thread: one shadow comparison's measures."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return bool(await self._run(self._ledger.add_comparison, comparison))

    async def close(self) -> None:
        """Close the file and stop the thread; called once at shutdown."""
        if self._ledger is not None:
            await self._run(self._ledger.close)
            self._ledger = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def _run(self, func: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, func, *args)


class DeadLetters:
    """Where records that are no audit record go: the dead-letter topic, with why (docs/design.md,
    invariant 6), published through the auditor's KafkaBroker (idempotent, acks=all)."""

    def __init__(self, topics: Topics, broker: KafkaBroker) -> None:
        self.topics = topics
        self.broker = broker

    async def send(self, record: ConsumerRecord, reason: str) -> None:
        """Publish the record's DeadLetter and wait until it is durable."""
        letter = dead_letter_of(record, reason, SERVICE)
        log.warning("dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
        key = letter.key.encode() if letter.key else None
        await self.broker.publish(encode(letter), topic=self.topics.dead_letter, key=key)


class AnchorPublisher:
    """Publishes the ledger's newest checkpoints to the anchor topic, each chain's once, through
    the auditor's KafkaBroker (idempotent, acks=all). A publish that fails is tried again at the
    next call: the newest checkpoint of a chain vouches for all before it."""

    def __init__(self, topics: Topics, broker: KafkaBroker, writer: LedgerWriter) -> None:
        self.topic = topics.audit_anchors
        self.broker = broker
        self.writer = writer
        self.published: dict[tuple[str, int], int] = {}  # (log, chain_id) -> newest checkpoint num published

    async def publish_new(self) -> int:
        """Publish every chain's newest checkpoint that is not published yet; returns how many."""
        sent = 0
        for anchor in await self.writer.latest_anchors():
            chain = (anchor.log, anchor.chain_id)
            if self.published.get(chain, 0) >= anchor.num:
                continue
            await self.broker.publish(encode(anchor), topic=self.topic, key=anchor_key(anchor))
            self.published[chain] = anchor.num
            sent += 1
        return sent


@dataclass(frozen=True)
class AuditItem:
    """One record of the audit topic, decoded: its AuditEvent or ReviewFlag, or why it is none."""

    record: ConsumerRecord
    message: AuditEvent | ReviewFlag | None
    reason: str | None = None


async def decode_items(msg: KafkaMessage) -> list[AuditItem]:
    """The subscriber's decoder: a fetched batch as typed AuditItems, one per record."""
    items = []
    for record in msg.raw_message:
        try:
            items.append(AuditItem(record, decode_audit_value(record.value)))
        except DecodeError as bad:
            items.append(AuditItem(record, None, str(bad)))
    return items


async def parse_records(records: tuple[ConsumerRecord, ...], parse_batch: Callable[..., Awaitable[Any]]) -> Any:
    """FastStream's batch parser, fed records whose header values are UTF-8 text: it decodes them
    strictly, so one binary or null header value would fail the whole batch before the handler,
    which reads only the records' values, sees it."""

    def is_text(value: bytes | None) -> bool:
        if value is None:
            return False
        try:
            value.decode()
        except UnicodeDecodeError:
            return False
        return True

    def readable(record: ConsumerRecord) -> ConsumerRecord:
        if all(is_text(value) for _, value in record.headers):
            return record
        headers = tuple((key, (value or b"").decode(errors="replace").encode()) for key, value in record.headers)
        return replace(record, headers=headers)

    return await parse_batch(tuple(readable(record) for record in records))


class AuditBatches:
    """The audit topic's handler: each consumed batch is one group commit into the ledger.

    A batch is what the consumer has fetched, at most audit_batch_max_records: under load batches
    grow by themselves, when idle a batch is one record. Ledger.append_batch writes it with one
    transaction, and so one fsync, per chain; then one offset commit covers it. Offsets (docs/design.md,
    invariant 3) are committed by hand, each partition only up to its first record the ledger
    refused: the consumer seeks back to it, and it is read again after audit_retry_backoff_s, never
    skipped. Records that are no audit record are dead-lettered, durably, before their offsets are
    committed. Anything else that fails rewinds the whole batch.
    """

    def __init__(
        self,
        settings: AuditorSettings,
        writer: LedgerWriter,
        dead_letters: DeadLetters,
        health: HealthMetrics | None = None,
        anchors: AnchorPublisher | None = None,
        on_new_event: Callable[[AuditEvent], None] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.tracing = tracing or Tracing.off(SERVICE)
        self.on_new_event = on_new_event  # traffic counts and the canary guard (services/auditor/traffic.py)
        self.writer = writer
        self.dead_letters = dead_letters
        self.health = health
        self.anchors = anchors

    async def handle(self, items: list[AuditItem], msg: KafkaMessage) -> None:
        """Store one fetched batch, then acknowledge it (whole, or up to each refused record)."""
        try:
            refused_at = await self._ingest(items)
            if not refused_at:
                await msg.ack()  # FastStream's ack: commit every position, past this batch
                return
            ends: dict[TopicPartition, int] = {}
            for item in items:
                record = item.record
                tp = TopicPartition(record.topic, record.partition)
                ends[tp] = refused_at.get(record.partition, max(ends.get(tp, 0), record.offset + 1))
            for tp, offset in ends.items():
                if tp.partition in refused_at:
                    msg.consumer.seek(tp, offset)
            await msg.consumer.commit(ends)  # type: ignore[call-arg]  # per partition: see the module doc
        except Exception as exc:  # per-batch failure is data: read it again
            log.exception(
                "audit batch of %d records failed (%r); reading it again in %.1f s",
                len(items),
                exc,
                self.settings.audit_retry_backoff_s,
            )
            _rewind(msg.consumer, [item.record for item in items])
        # A pause before the retry: no hot loop on a full disk or a broker that is away.
        await asyncio.sleep(self.settings.audit_retry_backoff_s)

    async def _ingest(self, items: list[AuditItem]) -> dict[int, int]:
        """Store and dead-letter the batch; returns {partition: offset of its first record not stored}."""
        stored = [
            (item.message, item.record.partition, item.record.offset) for item in items if item.message is not None
        ]
        spans = [self._append_span(item) for item in items if item.message is not None]
        try:
            outcome = await self.writer.append_batch(stored)
        finally:
            for span in spans:
                span.end()
        refused_at = {}
        for partition, (index, exc) in outcome.failed.items():
            refused_at[partition] = stored[index][2]
            log.error(
                "ledger write of %s failed (%r); redelivering in %.1f s",
                _name(stored[index][0]),
                exc,
                self.settings.audit_retry_backoff_s,
                exc_info=not isinstance(exc, (sqlite3.Error, ValueError)),
            )
        for item in items:
            record = item.record
            if item.reason is not None and record.offset < refused_at.get(record.partition, record.offset + 1):
                await self.dead_letters.send(record, item.reason)  # later ones come again
        for index, is_new in outcome.is_new.items():
            self._observe(stored[index][0], is_new)
        if outcome.num_checkpoints and self.anchors is not None:
            try:
                await self.anchors.publish_new()
            except Exception as exc:  # noqa: BLE001 - the records are stored; the app's timer publishes again
                log.warning("publishing the new checkpoints' anchors failed (%r); the timer tries again", exc)
        return refused_at

    def _append_span(self, item: AuditItem) -> Span:
        """The ledger append of one record (its batch's group commit), under the context its
        record's headers carry: the worker's run of the request (docs/design.md, "Observability")."""
        record, message = item.record, item.message
        attrs = messaging(
            "process",
            record.topic,
            offset=record.offset,
            partition=record.partition,
            group=self.settings.topics.auditor_group,
        )
        request_id = None
        if isinstance(message, AuditEvent):
            request_id = message.request_id
            attrs.update(
                {
                    "gen_ai.response.model": message.model_version,
                    "gen_ai.usage.input_tokens": message.prompt_tokens,
                    "gen_ai.usage.output_tokens": message.completion_tokens,
                }
            )
        return self.tracing.start_span(
            "audit append", extract(record.headers), kind=SpanKind.CONSUMER, request_id=request_id, attributes=attrs
        )

    def _observe(self, message: AuditEvent | ReviewFlag, is_new: bool) -> None:
        if not is_new:
            log.info("%s is already in the ledger (redelivery); skipped", _name(message))
            return
        if self.on_new_event is not None and isinstance(message, AuditEvent):
            self.on_new_event(message)
        if self.health is not None:
            if isinstance(message, AuditEvent):
                self.health.observe(message)
            else:
                self.health.observe_flag(message)


def _name(record: AuditEvent | ReviewFlag) -> str:
    return f"event {record.event_id}" if isinstance(record, AuditEvent) else f"review flag {record.flag_id}"


def _rewind(consumer: AIOKafkaConsumer, batch: list[ConsumerRecord]) -> None:
    """Seek each partition of `batch` still assigned back to its first record in it."""
    first: dict[TopicPartition, int] = {}
    for record in batch:
        tp = TopicPartition(record.topic, record.partition)
        first[tp] = min(first.get(tp, record.offset), record.offset)
    assigned = consumer.assignment()
    for tp, offset in first.items():
        if tp in assigned:
            consumer.seek(tp, offset)


def register_handlers(broker: KafkaBroker, settings: AuditorSettings, batches: AuditBatches) -> None:
    """Subscribe the auditor's consumer group to the audit topic, a batch at a time, with the fetch
    and session settings of every Weir consumer (weir.bus.consumer_settings)."""
    fetch = consumer_settings(settings, max_poll_records=settings.audit_batch_max_records)
    fetch.pop("enable_auto_commit")  # FastStream derives it from the ack policy: off for MANUAL

    @broker.subscriber(
        settings.topics.audit,
        group_id=settings.topics.auditor_group,
        batch=True,
        max_records=settings.audit_batch_max_records,
        batch_timeout_ms=settings.fetch_max_wait_ms,
        ack_policy=AckPolicy.MANUAL,  # AuditBatches acks after the ledger's commit (see the module doc)
        parser=parse_records,
        decoder=decode_items,
        auto_offset_reset="earliest",
        title="auditor/audit-records",
        description="AuditEvents and ReviewFlags into the hash-chained ledger, one group commit per batch; "
        "offsets committed after the SQLite commit.",
        **fetch,
    )
    async def on_audit_records(items: list[AuditItem], msg: KafkaMessage) -> None:
        await batches.handle(items, msg)
