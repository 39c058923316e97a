"""Kafka edge of the auditor: decode audit records, append them to the ledger, dead-letter the rest.

The audit topic carries AuditEvents (from workers) and ReviewFlags (from gateways' input guards),
told apart by `kind` (schemas.codec.decode_audit_record); both go into the ledger, each into its
own hash chains. Offsets (DESIGN.md, invariant 3): the subscriber uses AckPolicy.NACK_ON_ERROR,
so FastStream commits the consumer's position only after on_audit_record returned, that is after the SQLite
commit. A message that cannot be parsed is dead-lettered (and the DeadLetter durably produced)
before it is acked. A ledger write that fails is nacked: the consumer seeks back and the event is
redelivered after a pause, never skipped.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaProducer, ConsumerRecord
from faststream import AckPolicy, BaseMiddleware
from faststream.exceptions import HandlerException, NackMessage
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.message import StreamMessage

from schemas.codec import DecodeError, decode_audit_record
from schemas.messages import SCHEMA_VERSION, AuditEvent, ReviewFlag
from schemas.topics import Topics
from services.auditor.config import AuditorSettings
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger, unstorable_reason
from weir.bus import send_dead_letter

log = logging.getLogger(__name__)

SERVICE = "auditor"

async def decode_audit_message(msg: StreamMessage[Any]) -> AuditEvent | ReviewFlag:
    """FastStream decoder of the audit topic: raw bytes to AuditEvent or ReviewFlag (by `kind`), or
    DecodeError with why."""
    record = decode_audit_record(msg.body)
    if record.schema_version > SCHEMA_VERSION:
        raise DecodeError(f"schema_version {record.schema_version} is newer than this auditor's {SCHEMA_VERSION}")
    if (reason := unstorable_reason(record)) is not None:
        raise DecodeError(f"invalid {type(record).__name__}: {reason}")
    return record


class LedgerWriter:
    """A Ledger on one dedicated thread, so SQLite's fsync never blocks the event loop."""

    def __init__(self, settings: AuditorSettings) -> None:
        self.target = settings.ledger_target()
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
        self._ledger = await self._run(lambda: Ledger(self.target, checkpoint_every_records=self._every_records,
                                                      checkpoint_every_s=self._every_s))

    async def checkpoint_due(self) -> int:
        """Ledger.checkpoint_due on the ledger thread (called on a timer)."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return int(await self._run(self._ledger.checkpoint_due))

    async def append(self, event: AuditEvent, partition: int, offset: int) -> bool:
        """Ledger.append on the ledger thread; True when the event became a new record."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return bool(await self._run(self._ledger.append, event, partition, offset))

    async def append_flag(self, flag: ReviewFlag, partition: int, offset: int) -> bool:
        """Ledger.append_flag on the ledger thread; True when the flag became a new record."""
        assert self._ledger is not None, "LedgerWriter.open() was not called"
        return bool(await self._run(self._ledger.append_flag, flag, partition, offset))

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
    """Broker middleware: a message that cannot be parsed goes to the dead-letter topic with why.

    FastStream builds one middleware per message by calling this object. The producer is set at
    startup (it needs the event loop). Once the DeadLetter is durable the error is swallowed, so
    the ack policy acks the message and the consumer carries on (DESIGN.md, invariant 6).
    """

    def __init__(self, topics: Topics) -> None:
        self.topics = topics
        self.producer: AIOKafkaProducer | None = None

    def __call__(self, msg: Any, /, *, context: Any) -> _DeadLetterScope:
        return _DeadLetterScope(msg, context=context, sink=self)


class _DeadLetterScope(BaseMiddleware):
    """The middleware of one message: dead-letters it if parsing or decoding it failed."""

    def __init__(self, msg: Any, /, *, context: Any, sink: DeadLetters) -> None:
        super().__init__(msg, context=context)
        self.sink = sink
        self.reached_handler = False

    async def consume_scope(self, call_next: Any, msg: StreamMessage[Any]) -> Any:
        # Reached only when parser and decoder succeeded; errors from here on are the handler's.
        self.reached_handler = True
        return await call_next(msg)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> bool | None:
        if not isinstance(exc_val, Exception) or isinstance(exc_val, HandlerException):
            return False
        if self.reached_handler and not isinstance(exc_val, DecodeError):
            return False  # a handler failure: the ack policy nacks it, it is not the message's fault
        assert self.sink.producer is not None, "the dead-letter producer was not started"
        reason = str(exc_val) if isinstance(exc_val, DecodeError) else f"unparsable message: {exc_val!r}"
        await send_dead_letter(self.sink.producer, self.sink.topics, self.msg, reason, SERVICE)
        return True


def register_handlers(
    broker: KafkaBroker, settings: AuditorSettings, writer: LedgerWriter, health: HealthMetrics | None = None
) -> None:
    """Subscribe the auditor's consumer group to the audit topic; new records feed `health`."""
    topics = settings.topics

    @broker.subscriber(
        topics.audit,
        group_id=topics.auditor_group,
        ack_policy=AckPolicy.NACK_ON_ERROR,
        decoder=decode_audit_message,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        title="auditor/audit-records",
        description="AuditEvents and ReviewFlags into the hash-chained ledger; commits after the SQLite commit.",
    )
    async def on_audit_record(event: AuditEvent | ReviewFlag, msg: KafkaMessage) -> None:
        record = msg.raw_message
        assert isinstance(record, ConsumerRecord), "a batch reached the per-event handler"
        what = f"event {event.event_id}" if isinstance(event, AuditEvent) else f"review flag {event.flag_id}"
        try:
            if isinstance(event, AuditEvent):
                is_new = await writer.append(event, record.partition, record.offset)
            else:
                is_new = await writer.append_flag(event, record.partition, record.offset)
        except Exception as exc:
            # Never skip a record: pause (no hot loop on a full disk), then seek back to it.
            log.error("ledger write of %s failed (%r); redelivering in %.1f s", what, exc,
                      settings.audit_retry_backoff_s, exc_info=not isinstance(exc, sqlite3.Error))
            await asyncio.sleep(settings.audit_retry_backoff_s)
            raise NackMessage() from exc
        if not is_new:
            log.info("%s is already in the ledger (redelivery); skipped", what)
        elif health is not None:
            if isinstance(event, AuditEvent):
                health.observe(event)
            else:
                health.observe_flag(event)
