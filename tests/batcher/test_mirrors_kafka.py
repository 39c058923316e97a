"""Mirroring against the real broker (docs/design.md, "Traffic policies"): the batcher copies each
live request of a name whose route mirrors 100% to the mirror version, in the bulk lane, with its
replies to the shadow topic; the live request lists its mirrors and keeps its client's reply
topic; under load mirror copies are dropped first, ended on the shadow topic and counted.

Fake workers (test_routing_kafka.FakeWorker) read each version's batch topic and report their room.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from schemas.codec import decode_reply
from schemas.messages import ReplyEnd, now_ms
from schemas.topics import Topics
from services.batcher.app import BatcherApp, BatcherService
from services.batcher.config import BatcherSettings
from tests.kafka_helpers import produce, read_until
from tests.waiting import until
from weir.kafka.admin import ensure_topics
from weir.metrics import value
from weir.registry import publish, read_registry, register, set_route

from .factories import make_config, make_repo, version_specs
from .test_routing_kafka import TIMEOUT_MS, FakeWorker, beat_seen, chat
from .test_versions_kafka import version

pytestmark = pytest.mark.kafka


async def test_live_requests_are_mirrored_in_the_bulk_lane_and_copies_dropped_first(
    batcher_bootstrap: str, fresh_topics: Topics
) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    repo = make_repo(make_config("m", engine="echo", path=None, max_batch_size=4, max_wait_ms=20))
    client = topics.replies("client")
    await ensure_topics(
        bootstrap,
        version_specs(topics, repo)
        + topics.model_specs("m@2")
        + topics.model_specs("m@3")
        + [topics.reply_spec("client"), topics.reply_spec("shadow")],
    )
    settings = BatcherSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        max_idle_wait_ms=50,
        worker_timeout_ms=TIMEOUT_MS,
        mirror_max_queued=4,
    )
    await publish(settings, register(await read_registry(settings, repo), version("m", "2")))
    await publish(settings, register(await read_registry(settings, repo), version("m", "3")))
    await publish(settings, set_route(await read_registry(settings, repo), "m", "test", default="2", mirror={"3": 100}))
    app = BatcherApp(settings, repo)
    stop = asyncio.Event()
    live_worker = FakeWorker(bootstrap, topics, version("m", "2").manifest.config(), f"w2-{topics.prefix}", 100_000)
    mirror_worker = FakeWorker(bootstrap, topics, version("m", "3").manifest.config(), f"w3-{topics.prefix}", 100_000)
    tasks = [asyncio.create_task(w.run()) for w in (live_worker, mirror_worker)]
    tasks.append(asyncio.create_task(app.serve(stop)))

    def requests(n: int, tag: str) -> list:
        return [
            chat(f"system {tag}", f"{tag}{i}", "m", topics).model_copy(update={"reply_to": client}) for i in range(n)
        ]

    try:
        await until(
            lambda: (
                bool(live_worker.assignment())
                and bool(mirror_worker.assignment())
                and app.is_reading
                and app.registry.state.routes.get("m") is not None
                and app.registry.state.routes["m"].mirror == {"3": 100}
            ),
            timeout_s=40,
            what="the workers assigned, the mirror route read",
            watch=tasks,
        )

        # 1. Every live request goes to the default, listing its mirror; its copy goes to m@3 in
        # the bulk lane, a request of its own whose replies go to the shadow topic.
        first = requests(4, "a")
        await produce(bootstrap, topics.requests, first)
        ids = {r.request_id for r in first}
        await until(
            lambda: live_worker.request_ids >= ids and mirror_worker.request_ids >= {f"{i}.mirror.3" for i in ids},
            timeout_s=20,
            what="every request and its mirror copy batched",
            watch=tasks,
        )
        lives = [r for _, b in live_worker.received for r in b.requests]
        assert {r.request_id for r in lives} == ids  # no copy on the live version's topic
        for r in lives:
            assert (r.model, r.assignment, r.mirrors, r.reply_to, r.priority, r.shadow_of) == (
                "m@2",
                "default",
                ["3"],
                client,
                "interactive",
                None,
            )
        copies = [r for _, b in mirror_worker.received for r in b.requests]
        assert len(copies) == 4
        for c in copies:
            assert c.request_id == f"{c.shadow_of}.mirror.3" and c.shadow_of in ids
            assert (c.model, c.assignment, c.priority, c.reply_to, c.mirrors) == (
                "m@3",
                "mirror",
                "bulk",
                topics.shadow_replies,
                [],
            )
        assert app.handlers.num_mirrors_dropped == 0

        # 2. The mirror version has no room: copies wait, up to the bound (4); the next are dropped,
        # ended on the shadow topic and counted. Live requests are not held back.
        mirror_worker.capacity_tokens = 0
        changed_ms = now_ms()
        await until(
            lambda: beat_seen(app, mirror_worker, changed_ms),
            timeout_s=10,
            what="the batcher to read the mirror worker full",
            watch=tasks,
        )
        second = requests(7, "b")
        await produce(bootstrap, topics.requests, second)
        await until(
            lambda: live_worker.request_ids >= {r.request_id for r in second},
            timeout_s=20,
            what="the second round batched to the live worker",
            watch=tasks,
        )
        await until(
            lambda: app.handlers.num_mirrors_dropped == 3 and app.handlers.num_mirrors_held == 4,
            timeout_s=20,
            what="3 mirror copies dropped and 4 held",
            watch=tasks,
        )

        # 3. The live version has no room either: an interactive request waits, so every held
        # mirror copy is dropped (its own copy too: the bound is reached).
        live_worker.capacity_tokens = 0
        changed_ms = now_ms()
        await until(
            lambda: beat_seen(app, live_worker, changed_ms),
            timeout_s=10,
            what="the batcher to read the live worker full",
            watch=tasks,
        )
        third = requests(1, "c")
        await produce(bootstrap, topics.requests, third)
        await until(
            lambda: app.handlers.num_mirrors_dropped == 8 and app.handlers.num_mirrors_held == 0,
            timeout_s=20,
            what="all 8 mirror copies dropped",
            watch=tasks,
        )
        assert app.planner.is_held(third[0].request_id)  # the live request waits; it is not dropped
        service = BatcherService(settings, repo)
        service.app = app
        text = service.metrics.render()
        service.metrics.shutdown()
        assert value(text, "weir_batcher_mirrors_dropped") == 8 and value(text, "weir_batcher_mirrors_held") == 0

        dropped_ids = {f"{r.request_id}.mirror.3" for r in second + third} - mirror_worker.request_ids
        assert len(dropped_ids) == 8
        shadow = await read_until(
            bootstrap,
            [topics.shadow_replies],
            lambda recs: {decode_reply(r.value).request_id for r in recs} >= dropped_ids,
        )
        ends = [decode_reply(r.value) for r in shadow]
        assert {e.request_id for e in ends} == dropped_ids
        for end in ends:
            assert isinstance(end, ReplyEnd) and end.finish_reason == "rejected"
            assert end.error is not None and end.error.code == "mirror_dropped"

        # 4. A request record carrying what only the batcher sets (a forged copy) is refused: its
        # sender gets a rejection, no worker sees it, the comparison's topic gets nothing of it.
        forged = requests(1, "f")[0].model_copy(update={"request_id": "forged.mirror.3", "shadow_of": "x"})
        await produce(bootstrap, topics.requests, [forged])
        replies = await read_until(
            bootstrap, [client], lambda recs: any(decode_reply(r.value).request_id == forged.request_id for r in recs)
        )
        [refusal] = [decode_reply(r.value) for r in replies if decode_reply(r.value).request_id == forged.request_id]
        assert isinstance(refusal, ReplyEnd) and refusal.error is not None and refusal.error.code == "invalid_request"
        assert forged.request_id not in mirror_worker.request_ids | live_worker.request_ids

        # 5. A client never receives a mirror's answer: nothing on its reply topic names a copy.
        assert not [
            r
            for r in replies
            if decode_reply(r.value).request_id.endswith(".mirror.3")
            and decode_reply(r.value).request_id != forged.request_id
        ]
    finally:
        stop.set()
        for task in tasks[:-1]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
