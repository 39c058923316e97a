"""Routing by version against the real broker: the batcher follows the registry and the workers'
heartbeats (docs/design.md, invariant 10 and "The model registry").

Fake workers (test_routing_kafka.FakeWorker) each read one version's batch topic in its group and
report that version's state. The test walks a model through its lifecycle: the seeded version
serves bare-name requests; a version registered while the batcher runs gets its topic and takes
requests pinned to it; a promotion moves new bare-name requests to it within a second while
requests pinned to the old version go to its draining worker; a version that failed on its only
worker is rejected with the worker's reason (also when its requests were held while it loaded);
forged registry records change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from schemas.codec import decode_reply, encode
from schemas.messages import ReplyEnd, now_ms
from schemas.registry import ModelManifest, ModelRoute, ModelVersionRecord
from schemas.topics import Topics
from services.batcher.app import BatcherApp, BatcherService
from services.batcher.config import BatcherSettings
from tests.kafka_helpers import produce, read_until
from tests.waiting import until
from weir.kafka.admin import ensure_topics, list_topic_names
from weir.metrics import value
from weir.registry import promote, publish, read_registry, register

from .factories import make_config, make_repo, version_specs
from .test_routing_kafka import TIMEOUT_MS, FakeWorker, beat_seen, chat

pytestmark = pytest.mark.kafka

SERVING = {"engine": "echo", "max_batch_size": 4, "max_wait_ms": 20}


def version(name: str, ver: str) -> ModelVersionRecord:
    manifest = ModelManifest(name=name, version=ver, format="echo", location="", serving=SERVING)
    return ModelVersionRecord(manifest=manifest, registered_by="test")


async def test_requests_follow_versions_promotions_and_failures(batcher_bootstrap: str, fresh_topics: Topics) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    repo = make_repo(make_config("m", engine="echo", path=None, max_batch_size=4, max_wait_ms=20))  # seeds m@1
    reply_to = topics.replies("v")
    await ensure_topics(bootstrap, version_specs(topics, repo) + [topics.reply_spec("v")])
    settings = BatcherSettings(
        kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, max_idle_wait_ms=50, worker_timeout_ms=TIMEOUT_MS
    )
    app = BatcherApp(settings, repo)
    stop = asyncio.Event()
    config1 = repo.models["m"]
    v1 = FakeWorker(bootstrap, topics, config1, f"v1-{topics.prefix}", capacity_tokens=100_000)
    tasks = [asyncio.create_task(v1.run()), asyncio.create_task(app.serve(stop))]

    def requests(model: str, n: int, tag: str) -> list:
        return [
            chat(f"system {tag} {i}", f"{tag}{i}", model, topics).model_copy(update={"reply_to": reply_to})
            for i in range(n)
        ]

    try:
        # 1. The seeded version m@1 serves bare "m": every request goes to its ready worker, pinned.
        await until(
            lambda: bool(v1.assignment()) and app.is_reading,
            timeout_s=40,
            what="v1 assigned and the batcher reading",
            watch=tasks,
        )
        first = requests("m", 6, "a")
        await produce(bootstrap, topics.requests, first)
        await until(
            lambda: v1.request_ids >= {r.request_id for r in first},
            timeout_s=20,
            what="the first requests batched to v1",
            watch=tasks,
        )
        assert {b.model for _, b in v1.received} == {"m@1"}
        assert all(r.model == "m@1" for _, b in v1.received for r in b.requests)

        # 2. m@2 registered while the batcher runs: its topic is made, and requests pinned to it
        # go to its worker only (never to m@1's).
        await publish(settings, register(await read_registry(settings, repo), version("m", "2")))
        await until(lambda: "m@2" in app.registry.state.versions, timeout_s=20, what="m@2 in the registry", watch=tasks)

        async def topic_made() -> bool:
            return topics.batches("m@2") in await list_topic_names(bootstrap)

        await until(topic_made, timeout_s=20, what="the batcher to make m@2's batch topic", watch=tasks)
        v2 = FakeWorker(bootstrap, topics, app.registry.state.config_of("m@2"), f"v2-{topics.prefix}", 100_000)
        tasks.append(asyncio.create_task(v2.run()))
        await until(lambda: bool(v2.assignment()), timeout_s=40, what="v2 assigned", watch=tasks)
        await until(
            lambda: app.router.live_workers("m@2", now_ms()) == [v2.worker_id],
            timeout_s=10,
            what="the batcher to read v2's heartbeat",
            watch=tasks,
        )
        pinned2 = requests("m@2", 4, "p")
        await produce(bootstrap, topics.requests, pinned2)
        await until(
            lambda: v2.request_ids >= {r.request_id for r in pinned2},
            timeout_s=20,
            what="the m@2-pinned requests batched to v2",
            watch=tasks,
        )
        assert not v1.request_ids & {r.request_id for r in pinned2}

        # 3. Promote m@2: within a second the batcher routes bare "m" to it. m@1's worker drains:
        # requests pinned to m@1 still go there, as no worker has m@1 ready.
        await publish(settings, promote(await read_registry(settings, repo), "m@2", by="test"))
        promoted = time.monotonic()
        await until(
            lambda: app.registry.state.default_version("m") == "2",
            timeout_s=5,
            what="m@2 promoted to default",
            watch=tasks,
        )
        assert time.monotonic() - promoted < 1.0
        v1.state, changed_ms = "draining", now_ms()
        await until(
            lambda: beat_seen(app, v1, changed_ms), timeout_s=10, what="the batcher to read v1 draining", watch=tasks
        )
        after = requests("m", 6, "b")
        pinned1 = requests("m@1", 3, "o")
        await produce(bootstrap, topics.requests, [*after, *pinned1])
        await until(
            lambda: (
                v2.request_ids >= {r.request_id for r in after} and v1.request_ids >= {r.request_id for r in pinned1}
            ),
            timeout_s=20,
            what="after-promotion requests at v2, v1's pinned at v1",
            watch=tasks,
        )
        assert not v1.request_ids & {r.request_id for r in after}
        assert not v2.request_ids & {r.request_id for r in pinned1}
        assert {b.model for _, b in v2.received} == {"m@2"} and {b.model for _, b in v1.received} == {"m@1"}

        # 4. m@3 registered; its only worker reports it loading (requests are held), then failed
        # with a reason: the held request and a new one are rejected with that reason at once.
        await publish(settings, register(await read_registry(settings, repo), version("m", "3")))
        await until(lambda: "m@3" in app.registry.state.versions, timeout_s=20, what="m@3 in the registry", watch=tasks)
        v3 = FakeWorker(
            bootstrap,
            topics,
            app.registry.state.config_of("m@3"),
            f"v3-{topics.prefix}",
            100_000,
            state="loading",
            consume=False,
        )
        tasks.append(asyncio.create_task(v3.run()))
        await until(lambda: beat_seen(app, v3), timeout_s=10, what="the batcher to read v3 loading", watch=tasks)
        held = requests("m@3", 1, "h")[0]
        await produce(bootstrap, topics.requests, [held])
        await until(
            lambda: app.planner.is_held(held.request_id),
            timeout_s=20,
            what="the m@3 request held while m@3 loads",
            watch=tasks,
        )
        v3.state, v3.reason = "failed", "weights.safetensors: sha256 mismatch"
        fresh = requests("m@3", 1, "f")[0]
        await until(
            lambda: app.router.version_problem("m@3", now_ms()) is not None,
            timeout_s=10,
            what="the batcher to read v3 failed",
            watch=tasks,
        )
        rejected_at = time.monotonic()
        await produce(bootstrap, topics.requests, [fresh])
        replies = await read_until(bootstrap, [reply_to], lambda rs: len(rs) >= 2)
        assert time.monotonic() - rejected_at < 5  # not held to its 120 s deadline
        ends = {e.request_id: e for e in (decode_reply(r.value) for r in replies) if isinstance(e, ReplyEnd)}
        assert set(ends) == {held.request_id, fresh.request_id}
        for end in ends.values():
            assert end.finish_reason == "rejected" and end.error is not None and end.error.code == "model_unavailable"
            assert (
                "'m@3'" in end.error.message
                and f"failed on {v3.worker_id}: weights.safetensors: sha256 mismatch" in end.error.message
            )
        assert app.handlers.num_unservable == {"m@3": 2}

        # 5. Forged registry records (not JSON, a key that is not the record's, an unknown kind)
        # are skipped: routing is unchanged and the batcher keeps batching.
        forged_route = ModelRoute(name="m", default_version="1")
        await produce(
            bootstrap,
            topics.models,
            [
                ("route:m", b"{not json"),
                ("route:other", encode(forged_route)),
                ("version:m@9", b'{"kind": "weird", "schema_version": 1}'),
            ],
        )
        await until(
            lambda: app.registry.num_skipped == 3, timeout_s=20, what="3 bad registry records skipped", watch=tasks
        )
        assert app.registry.state.default_version("m") == "2" and "m@9" not in app.registry.state.versions
        last = requests("m", 4, "c")
        await produce(bootstrap, topics.requests, last)
        await until(
            lambda: v2.request_ids >= {r.request_id for r in last},
            timeout_s=20,
            what="the last requests batched to v2",
            watch=tasks,
        )
        assert not v1.request_ids & {r.request_id for r in last}

        # 6. /metrics shows it per version.
        service = BatcherService(settings, repo)
        service.app = app
        text = service.metrics.render()
        service.metrics.shutdown()
        assert value(text, "weir_batcher_requests_unservable", model="m@3") == 2
        assert value(text, "weir_batcher_registry_skipped") == 3 and value(text, "weir_batcher_registry_versions") == 3
        assert value(text, "weir_batcher_routable_workers", model="m@2", state="ready") == 1
        assert value(text, "weir_batcher_routable_workers", model="m@1", state="draining") == 1
        assert value(text, "weir_batcher_routable_workers", model="m@3", state="ready") == 0
    finally:
        stop.set()
        for task in tasks:
            if task is not tasks[1]:
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
