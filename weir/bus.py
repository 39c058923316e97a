"""Kafka plumbing every service shares: client factories, dead-lettering, offset bookkeeping.

The factories fix the settings that invariant 3 of docs/design.md depends on: producers are idempotent
with acks=all; consumers never auto-commit, so a service commits an offset only once the effect of
that message has been durably produced. On a secure deployment they log in as the service's own
principal (WEIR_KAFKA_SECURITY=sasl, WEIR_KAFKA_USER, WEIR_KAFKA_PASSWORD_FILE; docs/design.md,
"The Kafka trust boundary"). OffsetTracker turns out-of-order completions into the
contiguous offsets that are safe to commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.codec import encode
from schemas.messages import DeadLetter
from schemas.topics import DEFAULT_PREFIX, Topics
from weir.kafka.admin import wait_for_broker
from weir.kafka.security import client_credentials

log = logging.getLogger(__name__)

_MAX_DEAD_VALUE_CHARS = 64 * 1024


class BusSettings(BaseSettings):
    """Kafka settings common to all services (env: WEIR_KAFKA_BOOTSTRAP, WEIR_TOPIC_PREFIX)."""

    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore")

    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma-separated.")
    topic_prefix: str = Field(DEFAULT_PREFIX, description="Prefix of every topic and group id.")
    # Measured (docs/benchmarks.md): the broker answers a parked fetch as soon as a record lands
    # (fetch.min.bytes=1), so a long wait adds no latency to a new record. A short one does cost:
    # at 5 ms every idle consumer re-fetches 200 times a second, and the four services and the
    # broker burned 1.25 of this machine's 2 cores doing nothing, which doubled time-to-first-token.
    fetch_max_wait_ms: int = Field(500, ge=0, description="Longest the broker parks a fetch that finds no data.")
    commit_interval_ms: int = Field(
        200, ge=0, description="Shortest time between two offset commits of one consumer (0: commit at every chance)."
    )
    # aiokafka expires a record that found no broker for this long: its send fails. Past it, a
    # broker outage is visible to the services, which redo or refuse what they could not write.
    producer_request_timeout_ms: int = Field(
        30_000, ge=1000, description="How long a produce may wait for the broker before it fails."
    )

    # `weir up` starts the services while its broker boots (their imports and model loading
    # overlap the JVM's start) and sets this to its own start-up timeout.
    kafka_wait_s: float = Field(
        0.0,
        ge=0,
        description="How long a service waits at start for the Kafka cluster to answer (0: not at all; "
        "it exits 3 when the first connection fails).",
    )

    # A reply topic is named by whoever produced the request (docs/design.md, "Reply topics").
    reply_topic_auto_create: bool = Field(
        True,
        description="Whether the worker and the batcher ask the broker to create a reply topic that does not "
        "exist yet (it does so only where auto.create.topics.enable is true); false: a request whose reply topic "
        "does not exist is dropped, unanswered, and the reply topics must be made first (weir topics create --reply).",
    )

    # aiokafka forgets a topic whose metadata answer was an error (UnknownTopicOrPartition while a
    # broker restarts, reloads or moves leaders) and asks again only after metadata_max_age_ms, by
    # default 5 minutes; a group member then holds no partition of it for that long, and its
    # group's work waits (docs/design.md, "Scale-out and failover"). Group consumers refresh sooner.
    group_metadata_max_age_ms: int = Field(
        5000,
        ge=500,
        description="How often a consumer-group member refreshes its topics' metadata: the longest a "
        "topic lost from a metadata answer stays unassigned, and how soon a new topic matching a pattern "
        "subscription (the batcher's requests.*) is read.",
    )

    http_host: str = Field(
        "127.0.0.1", description="Address of the service's HTTP endpoint (/healthz, /readyz, /metrics)."
    )

    # Secure mode (weir/kafka/security.py): the principal this process logs in as.
    kafka_security: Literal["plaintext", "sasl"] = Field(
        "plaintext",
        description="plaintext: no credentials (the default local broker); sasl: SASL/SCRAM-SHA-512 "
        "as kafka_user (a secure broker: `weir kafka up --secure`).",
    )
    kafka_user: str | None = Field(
        None,
        description="The Kafka principal with kafka_security=sasl (gateway, "
        "batcher, worker, auditor, admin, or one from `weir kafka user add`).",
    )
    kafka_password_file: Path | None = Field(
        None, description="Its password file (mode 0600); default $WEIR_HOME/secrets/kafka/<kafka_user>.password."
    )

    @property
    def topics(self) -> Topics:
        """Topic names and group ids under this deployment's prefix."""
        return Topics(self.topic_prefix)

    def kafka_options(self) -> dict[str, Any]:
        """aiokafka's security keyword arguments for this principal ({} for plaintext); raises
        KafkaSecurityError (a ValueError) for inconsistent settings or an unusable password file."""
        creds = client_credentials(self.kafka_security, self.kafka_user, self.kafka_password_file)
        return creds.client_options() if creds else {}

    def faststream_security(self) -> Any:
        """The same login as FastStream's KafkaBroker takes it (None for plaintext)."""
        creds = client_credentials(self.kafka_security, self.kafka_user, self.kafka_password_file)
        if creds is None:
            return None
        from faststream.security import SASLScram512

        return SASLScram512(creds.user, creds.password, use_ssl=False)


async def wait_for_cluster(settings: BusSettings) -> None:
    """Return once the cluster answers, waiting up to settings.kafka_wait_s (TimeoutError after
    that: the service exits 3); at once when that is 0. Called first by every service's start."""
    if settings.kafka_wait_s > 0:
        log.info("waiting up to %.0f s for the Kafka cluster at %s", settings.kafka_wait_s, settings.kafka_bootstrap)
        await wait_for_broker(settings.kafka_bootstrap, settings.kafka_wait_s, settings.kafka_options())


def instance_id(service: str) -> str:
    """A unique id for one replica of a service (nothing assumes a service runs once)."""
    return f"{service}-{uuid.uuid4().hex[:12]}"


def make_producer(settings: BusSettings, client_id: str, linger_ms: int = 0) -> AIOKafkaProducer:
    """An idempotent producer with acks=all: a send that returns is durably written, once."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        linger_ms=linger_ms,
        request_timeout_ms=settings.producer_request_timeout_ms,
        retry_backoff_ms=100,
        **settings.kafka_options(),
    )


def consumer_settings(
    settings: BusSettings,
    max_poll_records: int = 500,
    session_timeout_ms: int = 10_000,
    heartbeat_interval_ms: int | None = None,
) -> dict[str, Any]:
    """The fetch, session and isolation settings of every consumer of Weir, aiokafka's or FastStream's
    (the auditor's subscriber takes the same): no auto-commit, committed reads only. The heartbeat
    defaults to a quarter of the session (at least 100 ms), so three heartbeats may be lost before
    the coordinator gives the member up."""
    if heartbeat_interval_ms is None:
        heartbeat_interval_ms = max(100, session_timeout_ms // 4)
    if not 0 < heartbeat_interval_ms < session_timeout_ms:
        raise ValueError(
            f"heartbeat interval {heartbeat_interval_ms} ms must be below the session timeout {session_timeout_ms} ms"
        )
    return {
        "enable_auto_commit": False,
        "fetch_max_wait_ms": settings.fetch_max_wait_ms,
        "max_poll_records": max_poll_records,
        "session_timeout_ms": session_timeout_ms,
        "heartbeat_interval_ms": heartbeat_interval_ms,
        "isolation_level": "read_committed",
    }


def make_consumer(
    settings: BusSettings,
    *topics: str,
    client_id: str,
    group_id: str | None,
    auto_offset_reset: str = "earliest",
    max_poll_records: int = 500,
    session_timeout_ms: int = 10_000,
    heartbeat_interval_ms: int | None = None,
    group_instance_id: str | None = None,
) -> AIOKafkaConsumer:
    """A consumer that never commits by itself; the service commits after its effects are durable.
    `group_instance_id` makes it a static member of `group_id` (docs/design.md, "Scale-out and failover")."""
    if group_instance_id is not None and group_id is None:
        raise ValueError("a static member (group_instance_id) needs a group_id")
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=settings.kafka_bootstrap,
        client_id=client_id,
        group_id=group_id,
        group_instance_id=group_instance_id,
        auto_offset_reset=auto_offset_reset,
        **({"metadata_max_age_ms": settings.group_metadata_max_age_ms} if group_id is not None else {}),
        **consumer_settings(settings, max_poll_records, session_timeout_ms, heartbeat_interval_ms),
        **settings.kafka_options(),
    )


def dead_letter_of(record: ConsumerRecord, reason: str, service: str) -> DeadLetter:
    """The DeadLetter that records why `record` could not be used."""
    key = record.key.decode("utf-8", "replace") if isinstance(record.key, bytes) else None
    raw = record.value if isinstance(record.value, bytes) else b""
    return DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=key,
        value=raw.decode("utf-8", "replace")[:_MAX_DEAD_VALUE_CHARS],
        reason=reason[:2000],
        service=service,
    )


async def send_dead_letter(
    producer: AIOKafkaProducer, topics: Topics, record: ConsumerRecord, reason: str, service: str
) -> None:
    """Produce the record's DeadLetter and wait until it is durable; the caller then moves on."""
    letter = dead_letter_of(record, reason, service)
    log.warning("dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
    await producer.send_and_wait(topics.dead_letter, encode(letter), key=letter.key.encode() if letter.key else None)


@dataclass
class _PartitionOffsets:
    # pending: offsets taken but not yet done, in arrival order; done flags parallel to it.
    pending: deque[list[Any]] = field(default_factory=deque)
    committed: int = -1  # next offset to read, as last reported committable


class OffsetTracker:
    """Tracks which consumed offsets have their effects durable, per partition.

    Kafka commits a position, not a set: committing N says every offset below N is done. Work
    finishes out of order (a short request ends before a long one), so the safe position is the
    lowest offset still in flight. Pure: no I/O, driven by the consumer loop.
    """

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionOffsets] = {}

    def add(self, tp: TopicPartition, offset: int) -> None:
        """Record that `offset` of `tp` was taken and its work started."""
        part = self._parts.setdefault(tp, _PartitionOffsets())
        part.pending.append([offset, False])

    def done(self, tp: TopicPartition, offset: int) -> None:
        """Record that the effects of `offset` are durable. Unknown offsets are ignored."""
        part = self._parts.get(tp)
        if part is None:
            return
        for entry in part.pending:
            if entry[0] == offset:
                entry[1] = True
                return

    def committable(self) -> dict[TopicPartition, int]:
        """Positions that advanced since the last call: {tp: next offset to read}."""
        out: dict[TopicPartition, int] = {}
        for tp, part in self._parts.items():
            position = None
            while part.pending and part.pending[0][1]:
                position = part.pending.popleft()[0] + 1
            if position is not None and position > part.committed:
                part.committed = position
                out[tp] = position
        return out

    def num_in_flight(self) -> int:
        """How many taken offsets are not done yet."""
        return sum(1 for part in self._parts.values() for entry in part.pending if not entry[1])

    def forget(self, partitions: set[TopicPartition] | list[TopicPartition]) -> None:
        """Drop partitions this consumer no longer owns (after a rebalance)."""
        for tp in partitions:
            self._parts.pop(tp, None)


class CommitPacer:
    """Spaces one consumer's offset commits at least `interval_ms` apart.

    Each commit is a broker round trip: an OffsetCommit request that cost the broker and the
    client about a millisecond of CPU each on this project's 2-core test machine, and the worker
    and the batcher made one per finished request. Spacing them never commits an effect that is not
    durable (the positions come from OffsetTracker either way); it only widens what a crash makes
    the next owner redo, which readers drop by sequence number (docs/design.md, invariant 3). The Java
    consumer's auto-commit default is 5 s.
    """

    def __init__(self, interval_ms: int) -> None:
        self.interval_s = interval_ms / 1000
        self._last = -float("inf")

    def is_due(self) -> bool:
        """True (and the clock restarts) when the last commit is at least the interval ago."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, wait_s: float = 30.0) -> set[int]:
    """The partitions of `topic`, from fresh metadata; RuntimeError if it does not exist.

    (AIOKafkaConsumer.topics() fetches metadata but does not keep it, so partitions_for_topic
    stays empty for a topic it neither subscribes nor is assigned; the fetched metadata is read.)
    """
    # A topic created a moment ago may take a while to appear (seconds on a loaded machine: a
    # service started beside `weir topics create`); bounded in time (`wait_s`), not in rounds,
    # since one round of all the metadata takes a second or more on a busy broker.
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        metadata = await consumer._client.fetch_all_metadata()  # see above
        partitions = metadata.partitions_for_topic(topic)
        if partitions:
            return set(partitions)
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    raise RuntimeError(f"topic {topic} does not exist; were the deployment's topics created? (weir up creates them)")


async def read_topic(
    settings: BusSettings, topic: str, client_id: str = "weir-models"
) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) of every record of `topic`, read from its beginning to its end (no group: for
    the CLI's views of compacted or short-lived topics)."""
    consumer = make_consumer(settings, client_id=client_id, group_id=None)
    await consumer.start()
    out: list[tuple[bytes | None, bytes | None]] = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while any([await consumer.position(tp) < end for tp, end in ends.items()]):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out += [(message.key, message.value) for message in records]
    finally:
        await consumer.stop()
    return out


class TopicFollower:
    """Reads a topic (every partition, no group) from its beginning to its end at start(), then
    keeps following it until stop(), handing each record's (key, value, ConsumerRecord) to
    `on_record` on the loop, then `on_batch` (when given) after each fetch that held records. For
    views of compacted topics a service keeps in memory (the model registry, token usage, health
    alerts). `on_record` must not raise for bad input: it skips what it cannot read (docs/design.md,
    invariant 6); an exception it raises is logged and the record skipped."""

    def __init__(
        self,
        settings: BusSettings,
        topic: str,
        client_id: str,
        on_record: Callable[[bytes | None, bytes | None, ConsumerRecord], None],
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.topic = topic
        self.client_id = client_id
        self.on_record = on_record
        self.on_batch = on_batch
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._consumer = consumer = make_consumer(self.settings, client_id=self.client_id, group_id=None)
        await consumer.start()
        tps = [TopicPartition(self.topic, p) for p in sorted(await partitions_of(consumer, self.topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while any([await consumer.position(tp) < end for tp, end in ends.items()]):
            self._apply(await consumer.getmany(timeout_ms=200))
        self._task = asyncio.create_task(self._follow(), name=f"follow-{self.topic}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()

    async def _follow(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                fetched = await self._consumer.getmany(timeout_ms=500)
            except KafkaError as exc:  # a fetch that failed must not end the view for good
                log.warning("following %s: %r; fetching again in 1 s", self.topic, exc)
                await asyncio.sleep(1.0)
                continue
            self._apply(fetched)

    def _apply(self, batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        for records in batches.values():
            for message in records:
                try:
                    self.on_record(message.key, message.value, message)
                except Exception:  # a bad record must not stop the view
                    log.exception("record at %s/%d skipped", message.topic, message.offset)
        if self.on_batch is not None and any(batches.values()):
            self.on_batch()
