"""A bad reply_to hurts only its own request (docs/design.md, "Reply topics"), on the real broker.

Raw records on the request topic whose reply_to is not a legal topic name, names one of the
deployment's internal topics, or names a reply topic that does not exist (the worker and the
batcher run with WEIR_REPLY_TOPIC_AUTO_CREATE=false, so it is never made), produced together with
ten normal requests: the ten are answered promptly, the bad ones are dead-lettered or dropped,
and no reply lands in any internal topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import orjson
import pytest

from schemas.codec import DecodeError, decode, decode_reply, encode
from schemas.messages import Batch, DeadLetter, ReplyEnd, WorkerHeartbeat, now_ms
from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from services.batcher.app import BatcherApp
from services.batcher.config import BatcherSettings
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.kafka_helpers import produce, read_until, wait_committed
from tests.waiting import until
from weir.kafka.admin import deployment_specs, ensure_topics, list_topic_names

from .factories import make_request

pytestmark = pytest.mark.kafka
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

PROMPTLY_S = 15.0  # each normal request takes well under a second here; a stall took 27-64 s


async def start_pipeline(tmp: Path, auto_create: bool):
    """A worker (echo) and a batcher on a fresh prefix; yields (topics, the worker)."""
    repo = tmp / "models.toml"
    repo.write_text('[models.echo]\nengine = "echo"\nmax_model_len = 4096\n')
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    await ensure_topics(BOOTSTRAP, [*deployment_specs(topics, load_model_repo(repo)), topics.reply_spec("good")])
    common = dict(
        kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix, model_repo=str(repo), reply_topic_auto_create=auto_create
    )
    worker = WorkerService(WorkerSettings(**common, audit_fingerprint_model="", heartbeat_interval_ms=300))
    tasks = [asyncio.create_task(worker.serve())]
    stop = asyncio.Event()
    try:
        beats = await read_until(
            BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs), 60
        )
        assert any(decode(WorkerHeartbeat, r.value).is_ready for r in beats), "the worker never became ready"
        tasks.append(asyncio.create_task(BatcherApp(BatcherSettings(**common), load_model_repo(repo)).serve(stop)))
        yield topics, worker
    finally:
        stop.set()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
async def pipeline(tmp_path_factory):
    """Neither the worker nor the batcher may create a reply topic (WEIR_REPLY_TOPIC_AUTO_CREATE=false)."""
    async for started in start_pipeline(tmp_path_factory.mktemp("replyto"), auto_create=False):
        yield started


@pytest.fixture(scope="module")
async def creating_pipeline(tmp_path_factory):
    """The default: the worker and the batcher ask the broker to create a missing reply topic."""
    async for started in start_pipeline(tmp_path_factory.mktemp("replyto-create"), auto_create=True):
        yield started


def raw_request(request_id: str, reply_to: str, model: str = "echo") -> tuple[str, bytes]:
    """A request record as any Kafka client may produce it (not built through the wire types)."""
    body = {
        "request_id": request_id,
        "model": model,
        "prompt": "one two three four",
        "max_tokens": 16,
        "temperature": 0.0,
        "deadline_ms": now_ms() + 60_000,
        "reply_to": reply_to,
    }
    return request_id, orjson.dumps(body)


def ends_of(records) -> dict[str, ReplyEnd]:
    return {e.request_id: e for e in (decode_reply(r.value) for r in records) if isinstance(e, ReplyEnd)}


def internal_topics(topics: Topics) -> list[str]:
    return [
        topics.requests,
        topics.keys,
        topics.usage,
        topics.audit,
        topics.control,
        topics.dead_letter,
        topics.workers,
        topics.files,
        topics.jobs,
        topics.job_commands,
        topics.batches("echo@1"),
    ]


def replies_in(records) -> list:
    """The records that are reply events (a ReplyDelta or a ReplyEnd)."""
    found = []
    for record in records:
        with contextlib.suppress(DecodeError):
            found.append(decode_reply(record.value))
    return found


async def produce_and_time(topic: str, records, reply_topic: str, want: set[str], timeout_s: float):
    """Produce `records`, then read `reply_topic` until every request of `want` has ended: the
    replies read, and each wanted request's seconds from the produce to its end."""
    started = time.monotonic()
    await produce(BOOTSTRAP, topic, records)
    arrivals: dict[str, float] = {}

    def all_ended(rs) -> bool:
        for rid in ends_of(rs):
            arrivals.setdefault(rid, time.monotonic() - started)
        return want <= set(arrivals)

    replies = await read_until(BOOTSTRAP, [reply_topic], all_ended, timeout_s=timeout_s)
    assert want <= set(arrivals), f"normal requests unanswered: {sorted(want - set(arrivals))}"
    return replies, arrivals


async def test_bad_reply_to_records_harm_nobody_else(pipeline):
    topics, worker = pipeline
    good, missing = topics.replies("good"), topics.replies(f"nobody-{uuid.uuid4().hex[:6]}")
    refused_names = {
        "bad-name": "bad topic!",
        "unicode": f"{topics.prefix}.replies.café",
        "look-alike": f"{topics.prefix}.repliesX",
        "other-deployment": "other.replies.x",
    }
    refused_names |= {f"internal-{t}": t for t in internal_topics(topics)}
    bad = [raw_request(f"{why}-{uuid.uuid4().hex[:6]}", name) for why, name in refused_names.items()]
    dropped = raw_request(f"missing-{uuid.uuid4().hex[:6]}", missing)  # valid, but its topic does not exist
    unknown_model = raw_request(f"nomodel-{uuid.uuid4().hex[:6]}", missing, model="no-such-model")
    normal = [raw_request(f"ok-{i}-{uuid.uuid4().hex[:6]}", good) for i in range(10)]
    records = [*bad[:4], dropped, *normal[:5], unknown_model, *bad[4:], *normal[5:]]

    want = {rid for rid, _ in normal}
    replies, arrivals = await produce_and_time(topics.requests, records, good, want, PROMPTLY_S + 15)
    slowest = max(arrivals[rid] for rid in want)
    assert slowest < PROMPTLY_S, f"a normal request took {slowest:.1f} s: {arrivals}"
    ends = ends_of(replies)
    assert all(ends[rid].finish_reason in ("stop", "length") for rid in want)
    assert set(ends) == want, "a bad record was answered on the good reply topic"

    # Every record with a refused reply_to is dead-lettered, with the reason, by the batcher.
    letters: dict[str, DeadLetter] = {}
    expected_letters = {rid for rid, _ in bad} | {unknown_model[0]}

    def all_lettered(rs) -> bool:
        letters.update({letter.key: letter for letter in (decode(DeadLetter, r.value) for r in rs)})
        return expected_letters <= set(letters)

    await read_until(BOOTSTRAP, [topics.dead_letter], all_lettered, timeout_s=15)
    for rid, _ in bad:
        letter = letters[rid]
        assert letter.source_topic == topics.requests and letter.service == "batcher"
        assert "reply_to" in letter.reason and "no reply was written" in letter.reason, letter.reason
    assert "not a legal Kafka topic name" in letters[bad[0][0]].reason
    # The unknown model's terminal reply could not go to its (missing) topic: dead-lettered instead.
    assert "could not produce the terminal reply" in letters[unknown_model[0]].reason
    assert "refuses writes" in letters[unknown_model[0]].reason
    assert dropped[0] not in letters or letters[dropped[0]].service != "batcher"  # valid: the worker ran it

    # The worker gives up on the request whose reply topic does not exist, and never makes it.
    await until(
        lambda: worker.servers[0].publisher.num_dropped >= 1,
        timeout_s=15,
        what="the worker to give up on the reply to a missing topic",
    )
    assert worker.servers[0].publisher.num_dropped == 1
    assert missing not in await list_topic_names(BOOTSTRAP)
    # ... and dead-letters it with the reason (docs/design.md, "Reply topics"; issue 35)
    found = await read_until(
        BOOTSTRAP, [topics.dead_letter], lambda rs: any(r.key == dropped[0].encode() for r in rs), 15
    )
    [letter] = [decode(DeadLetter, r.value) for r in found if r.key == dropped[0].encode()]
    assert letter.source_topic == topics.batches("echo@1") and letter.service.startswith("worker")
    assert f"reply topic {missing} refuses writes" in letter.reason and "no reply was written" in letter.reason
    assert dropped[0] in letter.value  # the request itself, to look at or produce again

    # No reply landed in an internal topic; the request topic holds only what was produced.
    seen = await read_until(BOOTSTRAP, internal_topics(topics), lambda rs: False, timeout_s=3)
    assert replies_in(seen) == []
    assert sum(r.topic == topics.requests for r in seen) == len(records)

    # Nothing is left hanging: both groups commit past every record.
    lag = await wait_committed(BOOTSTRAP, topics.batcher_group, topics.requests)
    assert all(c == e for c, e in lag.values()), lag
    lag = await wait_committed(BOOTSTRAP, topics.worker_group("echo@1"), topics.batches("echo@1"))
    assert all(c == e for c, e in lag.values()), lag


async def test_worker_dead_letters_a_batch_request_with_a_refused_reply_to(pipeline):
    """A Batch produced straight onto the batch topic (past the batcher): the worker checks too."""
    topics, worker = pipeline
    good = topics.replies("good")
    ok = make_request("a b c", model="echo", reply_to=good, max_tokens=8)
    to_keys = make_request("a b c", model="echo", reply_to=topics.keys, max_tokens=8)
    illegal = make_request("a b c", model="echo", reply_to="bad topic!", max_tokens=8)
    batch = Batch(
        batch_id=f"b-{uuid.uuid4().hex[:6]}", model="echo@1", requests=[to_keys, ok, illegal], batcher_id="test"
    )
    before = worker.servers[0].num_invalid_reply_to
    await produce(BOOTSTRAP, topics.batches("echo@1"), [(batch.batch_id, encode(batch))])

    replies = await read_until(BOOTSTRAP, [good], lambda rs: ok.request_id in ends_of(rs), timeout_s=PROMPTLY_S)
    assert ok.request_id in ends_of(replies)
    dead = await read_until(
        BOOTSTRAP,
        [topics.dead_letter],
        lambda rs: sum(batch.batch_id in decode(DeadLetter, r.value).reason for r in rs) >= 2,
        timeout_s=15,
    )
    reasons = [d.reason for d in (decode(DeadLetter, r.value) for r in dead) if batch.batch_id in d.reason]
    assert sorted(r.split("'")[1] for r in reasons) == sorted([to_keys.request_id, illegal.request_id]), reasons
    assert all(d.startswith("request ") and "it was not run, no reply was written" in d for d in reasons)
    assert worker.servers[0].num_invalid_reply_to == before + 2
    keys = await read_until(BOOTSTRAP, [topics.keys], lambda rs: False, timeout_s=2)
    assert keys == []
    lag = await wait_committed(BOOTSTRAP, topics.worker_group("echo@1"), topics.batches("echo@1"))
    assert all(c == e for c, e in lag.values()), lag


async def test_a_reply_topic_that_never_appears_holds_up_nobody(creating_pipeline):
    """A legal reply topic the broker will not create: `<prefix>.replies.a_b` collides with an
    existing `<prefix>.replies.a.b` ('.' and '_' are one character to Kafka's metrics). Asked to
    create it, the broker answers "unknown topic" for ever: the writers wait for it (10 s) in the
    background, then drop what named it, while the other requests go on."""
    topics, worker = creating_pipeline
    good = topics.replies("good")
    await ensure_topics(BOOTSTRAP, [topics.reply_spec("a.b")])
    never = topics.replies("a_b")
    assert topics.reply_to_problem(never) is None
    run = raw_request(f"never-{uuid.uuid4().hex[:6]}", never)  # the worker waits for its topic
    end_here = raw_request(f"never-nomodel-{uuid.uuid4().hex[:6]}", never, model="no-such-model")  # the batcher does
    normal = [raw_request(f"ok-{i}-{uuid.uuid4().hex[:6]}", good) for i in range(10)]
    dropped_before = worker.servers[0].publisher.num_dropped

    want = {rid for rid, _ in normal}
    _, arrivals = await produce_and_time(topics.requests, [end_here, run, *normal], good, want, 30)
    slowest = max(arrivals[rid] for rid in want)
    assert slowest < 6, f"a normal request took {slowest:.1f} s, behind the 10 s wait for {never}: {arrivals}"

    letters = await read_until(
        BOOTSTRAP, [topics.dead_letter], lambda rs: any(r.key == end_here[0].encode() for r in rs), 30
    )
    [letter] = [decode(DeadLetter, r.value) for r in letters if r.key == end_here[0].encode()]
    assert "could not produce the terminal reply" in letter.reason and "refuses writes" in letter.reason
    await until(
        lambda: worker.servers[0].publisher.num_dropped >= dropped_before + 1,
        timeout_s=20,
        what="the worker to drop the terminal reply it could not produce",
    )
    assert worker.servers[0].publisher.num_dropped == dropped_before + 1
    lag = await wait_committed(BOOTSTRAP, topics.batcher_group, topics.requests)
    assert all(c == e for c, e in lag.values()), lag
