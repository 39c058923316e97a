"""What gateway instances share through Kafka: API key records and rate-limit usage.

No shared database (docs/design.md, invariant 1): every instance
- reads the compacted keys topic from the beginning (no group) into its KeyStore, and keeps
  following it, so a key created or revoked by `weir keys` reaches every instance;
- publishes what it admitted, per limited scope, as UsageRecords on the usage topic every
  `usage_flush_ms`, and applies the records of the other instances to its own buckets. At start
  it replays the last `usage_replay_s` of records, so a restarted instance does not hand out a
  fresh minute. docs/gateway.md states the consistency this gives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from schemas.codec import DecodeError, decode, encode
from schemas.messages import ApiKeyRecord, UsageRecord, now_ms
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import KeyStore
from services.gateway.guard.limits import RateLimiter
from weir.bus import make_consumer, make_producer, partitions_of

log = logging.getLogger(__name__)


class PeerSync:
    """Kafka clients and loops that keep this instance's keys and buckets in step with the others."""

    def __init__(
        self,
        settings: GatewaySettings,
        gateway_id: str,
        keys: KeyStore,
        limiter: RateLimiter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.gateway_id = gateway_id
        self.keys = keys
        self.limiter = limiter
        self.clock = clock
        self.num_usage_applied = 0  # records of other instances applied (tests, metrics)
        self.started_ms = now_ms()
        self._pending: dict[str, list[int]] = {}  # scope -> [num_requests, num_tokens] not yet published
        self._producer: AIOKafkaProducer | None = None
        self._keys_consumer: AIOKafkaConsumer | None = None
        self._usage_consumer: AIOKafkaConsumer | None = None
        self._loops: list[asyncio.Task[None]] = []

    def record(self, scope: str, num_requests: int, num_tokens: int) -> None:
        """Queue consumption this instance applied locally; the flush loop publishes it."""
        pending = self._pending.setdefault(scope, [0, 0])
        pending[0] += num_requests
        pending[1] += num_tokens

    async def start(self) -> None:
        """Start the clients, read the keys topic to its end (bounded by keys_catch_up_s), seek the
        usage topic back one window, and start the loops. The topics exist (GatewayBus made them)."""
        s = self.settings
        self.started_ms = now_ms()
        self._producer = make_producer(s, client_id=f"{self.gateway_id}-usage", linger_ms=5)
        await self._producer.start()
        self._keys_consumer = make_consumer(s, client_id=f"{self.gateway_id}-keys", group_id=None)
        await self._keys_consumer.start()
        key_parts = await self._assign(self._keys_consumer, self.topics.keys)
        await self._keys_consumer.seek_to_beginning(*key_parts)
        await self._catch_up(self._keys_consumer, key_parts, self._read_keys)

        self._usage_consumer = make_consumer(s, client_id=f"{self.gateway_id}-usage", group_id=None)
        await self._usage_consumer.start()
        usage_parts = await self._assign(self._usage_consumer, self.topics.usage)
        since = await self._usage_consumer.offsets_for_times(
            {tp: max(0, now_ms() - int(s.usage_replay_s * 1000)) for tp in usage_parts}
        )
        for tp in usage_parts:
            found = since.get(tp)
            if found is None:
                await self._usage_consumer.seek_to_end(tp)
            else:
                self._usage_consumer.seek(tp, found.offset)
        await self._catch_up(self._usage_consumer, usage_parts, self._read_usage)
        self._loops = [
            asyncio.create_task(self._forever(self._follow_keys), name="gateway-keys"),
            asyncio.create_task(self._forever(self._follow_usage), name="gateway-usage-in"),
            asyncio.create_task(self._forever(self._flush_loop), name="gateway-usage-out"),
        ]
        log.info("gateway %s knows %d API keys", self.gateway_id, len(self.keys))

    async def stop(self) -> None:
        """Publish what is pending, stop the loops and the clients."""
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._producer is not None:
            try:
                await asyncio.wait_for(self.flush(), 5.0)
            except (KafkaError, TimeoutError) as exc:
                log.warning("usage not published at shutdown: %r", exc)
        for client in (self._keys_consumer, self._usage_consumer, self._producer):
            if client is not None:
                try:
                    await client.stop()
                except Exception:  # closing anyway
                    log.exception("closing a Kafka client failed")

    @property
    def is_running(self) -> bool:
        return bool(self._loops) and not any(task.done() for task in self._loops)

    async def flush(self) -> None:
        """Publish one UsageRecord per scope with pending consumption, keyed by scope."""
        if self._producer is None or not self._pending:
            return
        pending, self._pending = self._pending, {}
        sends = []
        for scope, (num_requests, num_tokens) in pending.items():
            record = UsageRecord(
                gateway_id=self.gateway_id, scope=scope, num_requests=num_requests, num_tokens=num_tokens
            )
            sends.append(await self._producer.send(self.topics.usage, encode(record), key=scope.encode()))
        await asyncio.gather(*sends)

    async def _assign(self, consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic))]
        consumer.assign(tps)
        return tps

    async def _catch_up(
        self, consumer: AIOKafkaConsumer, tps: list[TopicPartition], read: Callable[[int], Awaitable[None]]
    ) -> None:
        # Before serving: apply everything up to the end offsets of now (bounded by keys_catch_up_s).
        ends = await consumer.end_offsets(tps)
        deadline = self.clock() + self.settings.keys_catch_up_s
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            if self.clock() > deadline:
                log.warning(
                    "%s not read to its end within %.0f s; going on", tps[0].topic, self.settings.keys_catch_up_s
                )
                return
            await read(200)

    async def _follow_keys(self) -> None:
        while True:
            await self._read_keys(timeout_ms=1000)

    async def _read_keys(self, timeout_ms: int) -> None:
        assert self._keys_consumer is not None
        batches = await self._keys_consumer.getmany(timeout_ms=timeout_ms)
        for records in batches.values():
            for record in records:
                if record.value is None:
                    continue
                try:
                    self.keys.observe(decode(ApiKeyRecord, record.value))
                except DecodeError as exc:  # logged, not dead-lettered: every instance reads it
                    log.warning("ignoring key record %s@%d: %s", record.topic, record.offset, exc)

    async def _follow_usage(self) -> None:
        while True:
            await self._read_usage(1000)

    async def _read_usage(self, timeout_ms: int) -> None:
        assert self._usage_consumer is not None
        batches = await self._usage_consumer.getmany(timeout_ms=timeout_ms)
        for records in batches.values():
            for record in records:
                try:
                    usage = decode(UsageRecord, record.value)
                except DecodeError as exc:
                    log.warning("ignoring usage record %s@%d: %s", record.topic, record.offset, exc)
                    continue
                if usage.gateway_id == self.gateway_id and usage.sent_ms >= self.started_ms:
                    continue  # this process applied it when it admitted it
                self.limiter.debit(usage.scope, usage.num_requests, usage.num_tokens, self.clock())
                self.num_usage_applied += 1

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.usage_flush_ms / 1000)
            try:
                await self.flush()
            except KafkaError as exc:
                log.warning("usage records not published: %r", exc)

    async def _forever(self, loop_fn: Callable[[], Awaitable[object]]) -> None:
        while True:
            try:
                await loop_fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must go on
                log.exception("gateway peer loop failed; restarting in 1 s")
                await asyncio.sleep(1.0)
