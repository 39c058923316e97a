"""The batcher loop against the real Kafka broker: batches, terminal replies, dead letters, commits."""

from __future__ import annotations

import asyncio
from collections import Counter

import orjson
import pytest

from schemas.codec import decode, decode_reply, encode
from schemas.messages import Batch, Cancellation, DeadLetter, now_ms
from schemas.topics import Topics
from services.batcher.app import BatcherApp
from services.batcher.config import BatcherSettings
from tests.kafka_helpers import produce, read_until, wait_committed
from tests.waiting import until
from weir.kafka.admin import ensure_topics

from .factories import make_repo, make_request, version_specs

pytestmark = pytest.mark.kafka


def settings_for(bootstrap: str, topics: Topics) -> BatcherSettings:
    return BatcherSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, max_idle_wait_ms=50)


def batched_ids(records) -> list[str]:
    return [r.request_id for rec in records for r in decode(Batch, rec.value).requests]


async def start(app: BatcherApp) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(app.serve(stop))


async def test_batches_replies_dead_letters_and_commits(batcher_bootstrap: str, fresh_topics: Topics) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    repo = make_repo(a=(4, 30), b=(3, 30), slow=(10, 60_000))
    reply_to = topics.replies("test")
    await ensure_topics(bootstrap, version_specs(topics, repo) + [topics.reply_spec("test")])

    now = now_ms()
    a_reqs = [make_request("a", reply_to=reply_to, deadline_ms=now + 60_000) for _ in range(10)]
    b_reqs = [make_request("b", reply_to=reply_to, deadline_ms=now + 60_000, priority="bulk") for _ in range(7)]
    unknown = make_request("nope", reply_to=reply_to, deadline_ms=now + 60_000)
    # refs that are not name@version: each rejected with the reason, the loop carries on
    malformed = [
        make_request(ref, reply_to=reply_to, deadline_ms=now + 60_000) for ref in ("a@", "@1", "a@bad version!", "a@9")
    ]
    expired = make_request("a", reply_to=reply_to, deadline_ms=now - 1_000)
    held = make_request("slow", reply_to=reply_to, deadline_ms=now + 60_000)  # waits 60 s: cancelled first
    await produce(bootstrap, topics.requests, [*a_reqs, a_reqs[0], *malformed, *b_reqs, unknown, expired, held])
    await produce(bootstrap, topics.requests, [("bad-1", b'{"request_id": "bad-1", "model": ')])
    # valid JSON, invalid request, but it says where its producer waits: answered there too
    invalid = {
        "request_id": "bad-2",
        "model": "a",
        "prompt": "x",
        "max_tokens": -5,
        "deadline_ms": now + 60_000,
        "reply_to": reply_to,
    }
    await produce(bootstrap, topics.requests, [("bad-2", orjson.dumps(invalid))])
    # the JSON Schema says integer: a string is refused, not coerced (strict validation at the edge)
    await produce(
        bootstrap, topics.requests, [("bad-3", orjson.dumps({**invalid, "request_id": "bad-3", "max_tokens": "8"}))]
    )

    app = BatcherApp(settings_for(bootstrap, topics), repo)
    stop, task = await start(app)
    try:
        want = {r.request_id for r in a_reqs + b_reqs}
        batches = await read_until(
            bootstrap, [topics.batches("a@1"), topics.batches("b@1")], lambda rs: set(batched_ids(rs)) >= want
        )
        await until(
            lambda: app.planner.is_held(held.request_id),
            timeout_s=20,
            what="the cancellable request held",
            watch=[task],
        )
        cancel = Cancellation(request_id=held.request_id, reply_to=reply_to)
        await produce(bootstrap, topics.control, [(held.request_id, encode(cancel))])
        replies = await read_until(bootstrap, [reply_to], lambda rs: len(rs) >= 9)
        dead = await read_until(bootstrap, [topics.dead_letter], lambda rs: len(rs) >= 3)
        lag = await wait_committed(bootstrap, topics.batcher_group, topics.requests)
    finally:
        stop.set()
        await task

    ids = batched_ids(batches)
    assert Counter(ids) == Counter(want)  # each exactly once: the duplicate record was dropped
    for record in batches:
        batch = decode(Batch, record.value)
        assert record.topic == topics.batches(batch.model)
        assert record.key == batch.batch_id.encode()
        assert 1 <= len(batch.requests) <= repo.models[batch.model.removesuffix("@1")].max_batch_size
        assert batch.batcher_id == app.batcher_id
        assert batch.model in ("a@1", "b@1") and all(r.model == batch.model for r in batch.requests)  # pinned

    ends = {e.request_id: e for e in map(decode_reply, (r.value for r in replies))}
    assert set(ends) == {unknown.request_id, expired.request_id, held.request_id, "bad-2", "bad-3"} | {
        r.request_id for r in malformed
    }
    why = {r.model: ends[r.request_id].error for r in malformed}
    assert all(e is not None and e.code == "model_not_found" for e in why.values())
    assert "is not 'name@version'" in why["a@"].message and "names no model" in why["@1"].message
    assert "is not 'name@version'" in why["a@bad version!"].message and "'a@9' is not registered" in why["a@9"].message
    rejected, timed_out = ends[unknown.request_id], ends[expired.request_id]
    assert (rejected.finish_reason, rejected.error.code) == ("rejected", "model_not_found")
    assert (timed_out.finish_reason, timed_out.error.code) == ("timeout", "deadline_exceeded")
    assert ends[held.request_id].finish_reason == "cancelled"
    assert (ends["bad-2"].finish_reason, ends["bad-2"].error.code) == ("rejected", "invalid_request")
    assert "max_tokens" in ends["bad-2"].error.message
    assert all(e.seq == 0 and e.type == "end" for e in ends.values())

    letters = {letter.key: letter for letter in (decode(DeadLetter, r.value) for r in dead)}
    assert set(letters) == {"bad-1", "bad-2", "bad-3"}
    assert (letters["bad-1"].source_topic, letters["bad-1"].service) == (topics.requests, "batcher")
    assert "not JSON" in letters["bad-1"].reason
    # 0 is a valid max_tokens on the wire since prompt logprobs (echo with max_tokens 0)
    assert letters["bad-2"].reason == "invalid request: max_tokens: must be greater than or equal to 0, got -5"
    assert letters["bad-3"].reason == 'invalid request: max_tokens: expected an integer, got "8"'
    assert ends["bad-3"].error.message == letters["bad-3"].reason

    assert lag and all(committed == end for committed, end in lag.values()), lag


async def test_requests_held_by_a_dead_batcher_are_batched_by_the_next(
    batcher_bootstrap: str, fresh_topics: Topics
) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    patient = make_repo(a=(100, 60_000))  # holds everything for a minute
    eager = make_repo(a=(2, 10))
    await ensure_topics(bootstrap, version_specs(topics, eager) + [topics.reply_spec("test")])
    reqs = [make_request("a", reply_to=topics.replies("test"), deadline_ms=now_ms() + 60_000) for _ in range(6)]
    await produce(bootstrap, topics.requests, reqs)

    first = BatcherApp(settings_for(bootstrap, topics), patient)
    _, task = await start(first)
    await until(
        lambda: first.planner.num_held == len(reqs),
        timeout_s=20,
        what="the first batcher holding all six",
        watch=[task],
    )
    task.cancel()  # dies holding all six, nothing committed
    with pytest.raises(asyncio.CancelledError):
        await task

    second = BatcherApp(settings_for(bootstrap, topics), eager)
    stop, task = await start(second)
    try:
        want = {r.request_id for r in reqs}
        batches = await read_until(bootstrap, [topics.batches("a@1")], lambda rs: set(batched_ids(rs)) >= want)
        lag = await wait_committed(bootstrap, topics.batcher_group, topics.requests)
    finally:
        stop.set()
        await task
    assert Counter(batched_ids(batches)) == Counter(want)
    assert all(committed == end for committed, end in lag.values()), lag


async def test_a_rebalance_releases_held_requests_to_their_new_owner(
    batcher_bootstrap: str, fresh_topics: Topics
) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    patient, eager = make_repo(a=(100, 60_000)), make_repo(a=(3, 10))
    await ensure_topics(bootstrap, version_specs(topics, eager) + [topics.reply_spec("test")])
    reqs = [make_request("a", reply_to=topics.replies("test"), deadline_ms=now_ms() + 60_000) for _ in range(16)]
    await produce(bootstrap, topics.requests, reqs)

    first = BatcherApp(settings_for(bootstrap, topics), patient)
    stop_first, first_task = await start(first)
    await until(
        lambda: first.planner.num_held == len(reqs),
        timeout_s=20,
        what="the first batcher holding all six",
        watch=[first_task],
    )
    second = BatcherApp(settings_for(bootstrap, topics), eager)
    stop_second, second_task = await start(second)
    try:
        # The first keeps only what its remaining partitions hold; the second batches the rest.
        await until(
            lambda: len(second.requests.assignment()) > 0,
            timeout_s=20,
            what="the second batcher assigned partitions",
            watch=[second_task],
        )
        await until(
            lambda: first.planner.num_held < len(reqs),
            timeout_s=20,
            what="the first batcher handing held requests over",
            watch=[first_task],
        )
        stop_first.set()  # now the second owns everything, the first's held requests included
        await first_task
        want = {r.request_id for r in reqs}
        batches = await read_until(bootstrap, [topics.batches("a@1")], lambda rs: set(batched_ids(rs)) >= want)
        lag = await wait_committed(bootstrap, topics.batcher_group, topics.requests)
    finally:
        stop_first.set()
        stop_second.set()
        await asyncio.gather(first_task, second_task, return_exceptions=True)
    assert Counter(batched_ids(batches)) == Counter(want)
    assert all(len(decode(Batch, r.value).requests) <= 3 for r in batches)
    assert all(committed == end for committed, end in lag.values()), lag
