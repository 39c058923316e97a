"""The batcher's /metrics after real traffic on the real broker: batch size and fill, time held,
queue depth and expiries per lane and tenant, and the consumer lag of its own group."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiokafka.errors import ConsumerStoppedError

from schemas.messages import now_ms
from schemas.topics import Topics
from services.batcher.app import BatcherApp, BatcherService
from services.batcher.config import BatcherSettings
from tests.kafka_helpers import group_lag, produce
from tests.waiting import until
from weir.kafka.admin import ensure_topics
from weir.lag import LAG_METRIC
from weir.metrics import value

from .factories import make_config, make_repo, make_request, version_specs
from .test_routing_kafka import TIMEOUT_MS, FakeWorker

pytestmark = pytest.mark.kafka


async def test_metrics_after_requests(batcher_bootstrap: str, fresh_topics: Topics) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    # echo requests cost 16 tokens; the worker has room for 8 of them, so no batch ever overfills it
    repo = make_repo(make_config("a", engine="echo", path=None, max_batch_size=4, max_wait_ms=20), slow=(10, 60_000))
    reply_to = topics.replies("test")
    await ensure_topics(bootstrap, version_specs(topics, repo) + [topics.reply_spec("test")])
    settings = BatcherSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        max_idle_wait_ms=50,
        worker_timeout_ms=TIMEOUT_MS,
        lag_interval_s=0.5,
    )
    service = BatcherService(settings, repo)
    app = BatcherApp(settings, repo, metrics=service.metrics)
    service.app = app
    worker = FakeWorker(bootstrap, topics, repo.models["a"], f"w-{topics.prefix}", 128)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(app.serve(stop))]

    def request(model: str, tenant: str, lane: str = "interactive", deadline_in_ms: int = 60_000):
        req = make_request(model, reply_to=reply_to, priority=lane, deadline_ms=now_ms() + deadline_in_ms)
        return req.model_copy(update={"tenant": tenant})

    try:
        await until(
            lambda: bool(worker.assignment()) and app.is_reading and app.router.num_workers == 1,
            timeout_s=40,
            what="the worker assigned and routed to",
            watch=tasks,
        )
        batched = [request("a", "acme") for _ in range(8)]
        held = [request("slow", "zed") for _ in range(3)] + [request("slow", "acme", "bulk") for _ in range(2)]
        expiring = request("slow", "zed", "bulk", deadline_in_ms=1500)  # expires while held
        expired = request("a", "acme", deadline_in_ms=-1000)  # expired on arrival
        await produce(bootstrap, topics.requests, [*batched, *held, expiring, expired])
        await until(
            lambda: worker.request_ids >= {r.request_id for r in batched},
            timeout_s=20,
            what="the 8 requests batched to the worker",
            watch=tasks,
        )
        await until(
            lambda: (
                all(app.planner.is_held(r.request_id) for r in held) and not app.planner.is_held(expiring.request_id)
            ),
            timeout_s=20,
            what="the slow requests held and the expiring one gone",
            watch=tasks,
        )
        await service.lag.start()  # (service.start() would; here the app was started by hand)
        key = (topics.batcher_group, topics.requests)
        read: list[int | None] = [None]

        async def agreed() -> bool:  # the monitor agrees with the broker read independently
            read[0] = await broker_lag(bootstrap, topics)
            return read[0] is not None and service.lag.lags.get(key) == read[0]

        await until(agreed, timeout_s=20, what="the lag monitor to agree with the broker")
        expected = read[0]
        text = service.metrics.render()
    finally:
        stop.set()
        await service.close()
        for task in tasks:
            task.cancel()
        for task in tasks:  # the app's loop may be inside a fetch when close() stops its consumer
            with contextlib.suppress(asyncio.CancelledError, ConsumerStoppedError):
                await task

    model = {"model_name": "a@1"}
    assert value(text, "weir_batcher_batch_size_sum", **model) == 8
    num_batches = value(text, "weir_batcher_batch_size_count", **model)
    assert num_batches is not None and num_batches >= 2  # at most 4 per batch
    assert value(text, "weir_batcher_batch_size_bucket", **model, le="4") == num_batches
    assert value(text, "weir_batcher_batch_fill_count", **model) == num_batches  # routed: each has a budget
    assert value(text, "weir_batcher_batch_fill_bucket", **model, le="1.0") == num_batches  # never past the room
    assert 0 < value(text, "weir_batcher_batch_fill_sum", **model) <= num_batches
    assert value(text, "weir_batcher_queue_wait_seconds_count", lane="interactive", tenant="acme") == 8
    assert value(text, "weir_batcher_queue_depth", lane="interactive", tenant="zed") == 3
    assert value(text, "weir_batcher_queue_depth", lane="bulk", tenant="acme") == 2
    assert value(text, "weir_batcher_requests_expired_total", lane="interactive", tenant="acme") == 1
    assert value(text, "weir_batcher_requests_expired_total", lane="bulk", tenant="zed") == 1
    # The batcher's own group: it commits what it finished; held requests' records hold their
    # partitions' commits back.
    assert value(text, LAG_METRIC, consumergroup=topics.batcher_group, topic=topics.requests) == expected


async def broker_lag(bootstrap: str, topics: Topics) -> int | None:
    """The batcher group's lag on the requests topic over the partitions it committed (None: none yet)."""
    offsets = await group_lag(bootstrap, topics.batcher_group, topics.requests)
    committed = [(c, end) for c, end in offsets.values() if c >= 0]
    return sum(max(end - c, 0) for c, end in committed) if committed else None
