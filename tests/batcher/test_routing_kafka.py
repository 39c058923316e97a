"""Routing from heartbeats against the real broker: two fake workers of one model.

Each fake worker is test code that consumes one version's batch topic (`name@version`) in that
version's consumer group (so Kafka assigns it partitions) and publishes WorkerHeartbeats with that
assignment, the version's state and its room, which shrinks by what it received (it never
finishes anything). The batcher must send each
batch to a partition of a worker with room, never more than that worker advertised, keep a shared
prefix on one worker, and stop sending to a worker whose heartbeats stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas.codec import decode, encode
from schemas.messages import Batch, ChatMessage, GenerateRequest, VersionStatus, WorkerHeartbeat, now_ms
from schemas.model_repo import ModelConfig
from schemas.topics import BATCH_PARTITIONS, Topics
from services.batcher.app import BatcherApp
from services.batcher.config import BatcherSettings
from services.batcher.planner import cost_tokens
from services.batcher.routing import _score, prefix_key
from tests.kafka_helpers import produce
from tests.waiting import stays_false, until
from weir.kafka.admin import ensure_topics

from .factories import make_config, make_repo, version_specs

pytestmark = pytest.mark.kafka

BLOCK = 1  # tokens per "KV block": room is exact in tokens
HEARTBEAT_S = 0.25
TIMEOUT_MS = 1500
# A held request goes out at the first heartbeat that shows room; four heartbeats without one
# sent show the batcher keeps it held because there is none.
FULL_S = 4 * HEARTBEAT_S


class FakeWorker:
    """Consumes batches of one version in its group; heartbeats its assignment, the version's
    `state` (and `reason`) and its remaining room. With consume=False it only reports (a worker
    whose load failed or was refused never joins the version's group)."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        config: ModelConfig,
        worker_id: str,
        capacity_tokens: int,
        *,
        state: str = "ready",
        reason: str | None = None,
        consume: bool = True,
    ) -> None:
        self.topics, self.config, self.worker_id = topics, config, worker_id
        self.served_id = config.served_id
        self.capacity_tokens = capacity_tokens
        self.state, self.reason = state, reason
        self.is_beating = True
        self.received: list[tuple[int, Batch]] = []  # (partition, batch)
        self.advertised: set[int] = set()  # every partition it ever advertised
        self.next_offsets: dict[int, int] = {}  # partition -> next offset it reads
        self.consumer = (
            AIOKafkaConsumer(
                topics.batches(self.served_id),
                bootstrap_servers=bootstrap,
                group_id=topics.worker_group(self.served_id),
                auto_offset_reset="earliest",
                client_id=worker_id,
                fetch_max_wait_ms=50,
            )
            if consume
            else None
        )
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)

    @property
    def used_tokens(self) -> int:
        return sum(cost_tokens(r, self.config) for _, b in self.received for r in b.requests)

    @property
    def request_ids(self) -> set[str]:
        return {r.request_id for _, b in self.received for r in b.requests}

    def assignment(self) -> list[int]:
        return [] if self.consumer is None else sorted(tp.partition for tp in self.consumer.assignment())

    def heartbeat(self) -> WorkerHeartbeat:
        free_blocks = max(0, self.capacity_tokens - self.used_tokens) // BLOCK
        partitions = self.assignment()
        self.advertised |= set(partitions)
        serving = self.state in ("ready", "draining")  # heartbeats list partitions of these only
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            models=[self.served_id] if self.state == "ready" else [],
            is_ready=True,
            num_running=len(self.request_ids),
            num_waiting=0,
            max_num_seqs=64,
            free_kv_blocks=free_blocks,
            block_size_tokens=BLOCK,
            partitions={self.served_id: partitions} if serving else {},
            next_offsets={self.served_id: {p: o for p, o in self.next_offsets.items() if p in partitions}}
            if serving
            else {},
            versions={self.served_id: VersionStatus(state=self.state, reason=self.reason)},
        )

    async def run(self) -> None:
        if self.consumer is not None:
            await self.consumer.start()
        await self.producer.start()
        try:
            next_beat = 0.0
            while True:
                fetched = {} if self.consumer is None else await self.consumer.getmany(timeout_ms=50)
                if self.consumer is None:
                    await asyncio.sleep(0.05)  # the fake's loop without a consumer to wait on (its beat pace)
                for tp, records in fetched.items():
                    self.received += [(tp.partition, decode(Batch, r.value)) for r in records]
                    self.next_offsets[tp.partition] = records[-1].offset + 1
                if self.is_beating and time.monotonic() >= next_beat and (self.assignment() or self.consumer is None):
                    await self.producer.send_and_wait(
                        self.topics.workers, encode(self.heartbeat()), key=self.worker_id.encode()
                    )
                    next_beat = time.monotonic() + HEARTBEAT_S
        finally:
            if self.consumer is not None:
                await self.consumer.stop()
            await self.producer.stop()


def beat_seen(app: BatcherApp, worker: FakeWorker, since_ms: int = 0) -> bool:
    """Whether the batcher's router holds a heartbeat of `worker` sent at or after `since_ms`: what
    the worker reported from then on (its room, its versions' states) is what the batcher routes by."""
    known = app.router._workers.get(worker.worker_id)
    return known is not None and known.heartbeat.sent_ms >= since_ms


def chat(system: str, user: str, model: str, topics: Topics) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"{user}-{time.monotonic_ns()}",
        model=model,
        max_tokens=10,
        deadline_ms=now_ms() + 120_000,
        messages=[ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)],
        reply_to=topics.replies("unused"),  # a reply topic of the deployment, or the batcher refuses it
    )


async def test_batches_follow_heartbeats_room_prefixes_and_liveness(
    batcher_bootstrap: str, fresh_topics: Topics
) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    config = make_config("m", max_batch_size=4, max_wait_ms=20)
    repo = make_repo(config)
    await ensure_topics(bootstrap, version_specs(topics, repo))
    w1 = FakeWorker(bootstrap, topics, config, f"w1-{topics.prefix}", capacity_tokens=2000)
    w2 = FakeWorker(bootstrap, topics, config, f"w2-{topics.prefix}", capacity_tokens=2000)
    settings = BatcherSettings(
        kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, max_idle_wait_ms=50, worker_timeout_ms=TIMEOUT_MS
    )
    app = BatcherApp(settings, repo)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w1.run()), asyncio.create_task(w2.run())]
    try:
        # The group settles: each worker owns some of the partitions, together all of them.
        await until(
            lambda: (
                bool(w1.assignment())
                and bool(w2.assignment())
                and len(w1.assignment()) + len(w2.assignment()) == BATCH_PARTITIONS
            ),
            timeout_s=40,
            what="both workers assigned every batch partition",
            watch=tasks,
        )
        tasks.append(asyncio.create_task(app.serve(stop)))
        await until(
            lambda: app.router.live_workers("m@1", now_ms()) == sorted([w1.worker_id, w2.worker_id]),
            timeout_s=20,
            what="the batcher routing to both workers",
            watch=tasks,
        )

        def both() -> set[str]:
            return w1.request_ids | w2.request_ids

        # 1. A shared system prompt sticks to one worker.
        shared = [
            chat("You are Weir's test assistant. Answer briefly.", f"q{i}", "m", topics) for i in range(8)
        ]  # m -> m@1
        await produce(bootstrap, topics.requests, shared)
        await until(
            lambda: both() >= {r.request_id for r in shared},
            timeout_s=20,
            what="the shared-prefix requests batched",
            watch=tasks,
        )
        owners = {w.worker_id for w in (w1, w2) for r in shared if r.request_id in w.request_ids}
        assert len(owners) == 1

        # 2. Room for 3 requests left on w1, for 5 on w2; 20 are sent.
        flood = [chat(f"flood system {i:02d}", f"f{i:02d}", "m", topics) for i in range(20)]
        cost = cost_tokens(flood[0], config)
        assert {cost_tokens(r, config) for r in flood} == {cost}
        w1.capacity_tokens, w2.capacity_tokens = w1.used_tokens + 3 * cost + cost // 2, w2.used_tokens + 5 * cost
        changed_ms = now_ms()
        await until(
            lambda: beat_seen(app, w1, changed_ms) and beat_seen(app, w2, changed_ms),
            timeout_s=10,
            what="the batcher reading heartbeats with the new room",
            watch=tasks,
        )
        before1, before2 = len(w1.request_ids), len(w2.request_ids)
        await produce(bootstrap, topics.requests, flood)
        await until(
            lambda: len(both() & {r.request_id for r in flood}) >= 8,
            timeout_s=20,
            what="8 of the flood batched",
            watch=tasks,
        )
        await stays_false(
            lambda: (len(w1.request_ids) - before1, len(w2.request_ids) - before2) != (3, 5),
            for_s=FULL_S,
            what="more of the flood sent to full workers",
        )
        assert w1.used_tokens <= w1.capacity_tokens and w2.used_tokens <= w2.capacity_tokens
        assert app.planner.num_held == 12 and app.planner.blocked_models() == ["m@1"]

        # 3. Room again: the held requests leave. Then w1's heartbeats stop: it gets nothing more,
        # even for prefixes whose affinity is w1.
        w1.capacity_tokens += 2000
        w2.capacity_tokens += 2000
        await until(
            lambda: both() >= {r.request_id for r in flood}, timeout_s=20, what="the whole flood batched", watch=tasks
        )
        w1.is_beating = False
        await until(
            lambda: app.router.live_workers("m@1", now_ms()) == [w2.worker_id],
            timeout_s=TIMEOUT_MS / 1000 + 10,
            what="w1 no longer live once its heartbeats stop",
            watch=tasks,
        )
        got1 = set(w1.request_ids)
        late = []
        while len(late) < 6:
            req = chat(f"late system {len(late)} {time.monotonic_ns()}", f"l{len(late)}", "m", topics)
            if max((w1.worker_id, w2.worker_id), key=lambda w: _score(prefix_key(req), w)) == w1.worker_id:
                late.append(req)
        await produce(bootstrap, topics.requests, late)
        await until(
            lambda: w2.request_ids >= {r.request_id for r in late},
            timeout_s=20,
            what="the late requests batched to w2",
            watch=tasks,
        )
        assert w1.request_ids == got1
    finally:
        stop.set()
        for task in tasks[:2]:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    for worker in (w1, w2):
        # Every batch went to a partition its worker advertised (explicit partition=, not keyed).
        assert worker.received and {p for p, _ in worker.received} <= worker.advertised
        assert all(1 <= len(b.requests) <= config.max_batch_size for _, b in worker.received)
