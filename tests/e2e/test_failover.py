"""Failover between two workers of a model (docs/design.md, "Scale-out and failover"): a kill -9
of the worker running some streams moves them to the other, which regenerates them with the same
seeds; every stream ends once with the text of its seeded rerun. Nothing is restarted."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from schemas.codec import decode, decode_reply
from schemas.messages import ReplyDelta, WorkerHeartbeat, now_ms
from tests.kafka_helpers import read_until
from tests.waiting import until
from weir.bus import BusSettings, read_topic
from weir.kafka.admin import list_topic_names
from weir.stack import wait_http_ok

from .conftest import start_pipeline
from .test_faults import MODEL, assert_each_ends_once, stream_one

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
NUM_STREAMS = 10
MAX_TOKENS = 96
WORKERS = ("worker", "worker-2")


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """A stack whose model has two workers, each a static member under its own instance name."""
    p = start_pipeline(
        tmp_path_factory.mktemp("failover"),
        WEIR_MODELS=MODEL,
        WEIR_AUDIT_FINGERPRINT_MODEL="",
        WEIR_WORKER_INSTANCE="worker-1",
    )
    try:
        p.stack.own_env["worker-2"] = {"WEIR_WORKER_INSTANCE": "worker-2"}
        p.stack.start("worker-2", service="worker")
        wait_http_ok(f"{p.stack.url('worker-2')}/readyz", 180, p.stack)
        asyncio.run(until_both_own_partitions(p))
        yield p
    finally:
        p.stack.stop_all()


async def until_both_own_partitions(p, timeout_s: float = 60) -> None:
    """Until two workers' fresh heartbeats each list partitions of the model's batch topic (the
    group rebalanced over both, and the batcher routes to both)."""
    settings = BusSettings(kafka_bootstrap=p.bootstrap, topic_prefix=p.topics.prefix)

    async def both_own() -> bool:
        latest: dict[str, WorkerHeartbeat] = {}
        for _key, value in await read_topic(settings, p.topics.workers):
            hb = decode(WorkerHeartbeat, value)
            latest[hb.worker_id] = hb
        owners = [
            hb
            for hb in latest.values()
            if now_ms() - hb.sent_ms < 3000
            and any(served_id.startswith(f"{MODEL}@") and parts for served_id, parts in hb.partitions.items())
        ]
        return len(owners) == 2

    await until(both_own, timeout_s=timeout_s, interval_s=0.5, what="both workers owning partitions of the batch topic")


def num_running(client: httpx.Client, url: str) -> float:
    """The worker's weir_worker_num_running (its /metrics)."""
    text = client.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("weir_worker_num_running{")
    )


@pytest.mark.timeout(600)  # the two workers' start is counted: about a minute in CI, minutes on a loaded machine
async def test_kill_9_of_one_of_two_workers_moves_its_streams_to_the_other(two_workers):
    p = two_workers
    log: dict = {}
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=p.base_url, timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        tasks = [asyncio.create_task(stream_one(client, i, started, log, 0.0, MAX_TOKENS)) for i in range(NUM_STREAMS)]
        await asyncio.wait_for(started.wait(), 60)
        with httpx.Client(timeout=5) as probe:
            running = {name: num_running(probe, p.stack.url(name)) for name in WORKERS}
        victim = max(running, key=running.get)
        assert running[victim] > 0, f"no worker runs a stream: {running}"
        p.stack.kill(victim)  # SIGKILL: it leaves nothing behind but its uncommitted batches
        in_flight = NUM_STREAMS - len(log)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert in_flight > 0, "every stream ended before the kill"
    await assert_each_ends_once(p, log, NUM_STREAMS, MAX_TOKENS)
    assert p.stack.dead() == [], "the surviving worker (or another service) died"
    await assert_runs_are_positions(p)


async def assert_runs_are_positions(p) -> None:
    """Each request's deltas on the reply topics, in order, are runs of positions from 0 without a
    gap (a run regenerated after the kill starts at 0 again, coalesced its own way), and its end
    follows the last run's last position. Prints how many deltas were coalesced (load decides)."""
    topics = [t for t in await list_topic_names(p.bootstrap) if t.startswith(f"{p.topics.prefix}.replies.")]
    records = await read_until(p.bootstrap, topics, lambda rs: False, 5)
    at: dict[str, int] = {}
    num_deltas = num_coalesced = num_restarts = 0
    for record in records:
        event = decode_reply(record.value)
        if isinstance(event, ReplyDelta):
            num_deltas += 1
            num_coalesced += event.count > 1
            if event.seq != at.get(event.request_id, 0):
                assert event.seq == 0, (
                    f"{event.request_id}: a delta at {event.seq} after position {at.get(event.request_id)}"
                )
                num_restarts += 1
            at[event.request_id] = event.end
        elif event.finish_reason in ("stop", "length"):
            assert event.seq == at.get(event.request_id, 0), f"{event.request_id}: end at {event.seq}"
    assert num_restarts > 0, "no request was regenerated"
    print(f"reply deltas: {num_deltas}, coalesced: {num_coalesced}, runs restarted at 0: {num_restarts}")
