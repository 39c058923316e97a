"""The worker against the real broker: batches in, deltas + one terminal + audit out, commits after."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from schemas.codec import decode, decode_reply, encode
from schemas.messages import AuditEvent, Batch, Cancellation, DeadLetter, ReplyEnd, WorkerHeartbeat
from schemas.topics import BATCH_PARTITIONS, Topics
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.kafka_helpers import produce, read_until, wait_committed
from weir.kafka.admin import ensure_topics

from .factories import make_request

pytestmark = pytest.mark.kafka
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092


def write_repo(tmp: Path, model_dir: Path) -> Path:
    repo = tmp / "models.toml"
    repo.write_text(f"""
[models.tiny]
path = "{model_dir}"
max_model_len = 128
warmup = ["def "]

[models.echo]
engine = "echo"
max_model_len = 4096
""")
    return repo


def ends_by_request(records) -> dict[str, list[ReplyEnd]]:
    ends: dict[str, list[ReplyEnd]] = {}
    for r in records:
        event = decode_reply(r.value)
        if isinstance(event, ReplyEnd):
            ends.setdefault(event.request_id, []).append(event)
    return ends


async def test_worker_serves_batches_cancels_and_dead_letters(tmp_path, llama_dir):
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    settings = WorkerSettings(
        kafka_bootstrap=BOOTSTRAP,
        topic_prefix=topics.prefix,
        model_repo=str(write_repo(tmp_path, llama_dir)),
        echo_step_delay_ms=20,
        heartbeat_interval_ms=200,
    )
    replies = topics.replies("test")
    await ensure_topics(BOOTSTRAP, [*topics.core_specs(), topics.reply_spec("test")])
    service = WorkerService(settings)
    task = asyncio.create_task(service.serve())
    try:
        beats = await read_until(
            BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs)
        )
        assert any(decode(WorkerHeartbeat, r.value).is_ready for r in beats), "worker never became ready"

        tiny = [make_request("def add(a, b):", model="tiny", reply_to=replies, max_tokens=6) for _ in range(5)]
        echo = make_request("one two three four", model="echo", reply_to=replies, max_tokens=100)
        slow = make_request("word " * 1500, model="echo", reply_to=replies, max_tokens=2000)  # ~30 s unless cancelled
        batches = [
            Batch(batch_id="b1", model="tiny@1", requests=tiny, batcher_id="test"),
            Batch(batch_id="b2", model="echo@1", requests=[echo, slow], batcher_id="test"),
        ]
        await produce(BOOTSTRAP, topics.batches("tiny@1"), [("b1", encode(batches[0])), ("bad", b"{not json")])
        forged = Batch(
            batch_id="b3",
            model="tiny@1",
            requests=[make_request("x", model="tiny", reply_to=replies)],
            batcher_id="test",
        )  # on echo@1's topic: never run by echo@1 (invariant 10)
        await produce(BOOTSTRAP, topics.batches("echo@1"), [("b2", encode(batches[1])), ("b3", encode(forged))])
        # the slow request runs (its first reply is out), then its cancellation arrives
        await read_until(
            BOOTSTRAP,
            [replies],
            lambda rs: any(decode_reply(r.value).request_id == slow.request_id for r in rs),
            timeout_s=60,
        )
        await produce(BOOTSTRAP, topics.control, [(slow.request_id, encode(Cancellation(request_id=slow.request_id)))])

        want = {r.request_id for r in [*tiny, echo, slow]}
        records = await read_until(BOOTSTRAP, [replies], lambda rs: want <= set(ends_by_request(rs)))
        ends = ends_by_request(records)
        assert {rid: len(v) for rid, v in ends.items()} == dict.fromkeys(want, 1)
        assert ends[slow.request_id][0].finish_reason == "cancelled"
        assert ends[echo.request_id][0].finish_reason == "stop"
        echo_text = "".join(
            e.text
            for e in map(decode_reply, (r.value for r in records))
            if e.request_id == echo.request_id and e.type == "delta"
        )
        assert echo_text == "one two three four"
        for r in tiny:
            assert ends[r.request_id][0].finish_reason in ("length", "stop")
            assert ends[r.request_id][0].model_version == "tiny@1"

        audit = await read_until(BOOTSTRAP, [topics.audit], lambda rs: len(rs) >= len(want))
        events = [decode(AuditEvent, r.value) for r in audit]
        assert {e.request_id for e in events} == want
        assert all("def add" not in r.value.decode() for r in audit), "raw prompt leaked into the audit topic"

        dead = await read_until(BOOTSTRAP, [topics.dead_letter], lambda rs: len(rs) >= 2)
        letters = {decode(DeadLetter, r.value).source_topic: decode(DeadLetter, r.value) for r in dead}
        assert "not JSON" in letters[topics.batches("tiny@1")].reason
        assert "names model 'tiny@1' on the batch topic of echo@1" in letters[topics.batches("echo@1")].reason
        assert forged.requests[0].request_id not in ends

        lag = await wait_committed(BOOTSTRAP, topics.worker_group("tiny@1"), topics.batches("tiny@1"))
        assert all(c == e for c, e in lag.values()), lag

        # Heartbeats tell the batcher which batch partitions this worker owns (all: it is alone in
        # the group) and how far it has read them (two records of the tiny topic: b1 and "bad").
        def read_both(hb: WorkerHeartbeat) -> bool:
            return sum(hb.next_offsets.get("tiny@1", {}).values()) == 2

        beats = await read_until(
            BOOTSTRAP, [topics.workers], lambda rs: any(read_both(decode(WorkerHeartbeat, r.value)) for r in rs)
        )
        latest = [hb for hb in (decode(WorkerHeartbeat, r.value) for r in beats) if read_both(hb)][-1]
        assert latest.partitions["tiny@1"] == latest.partitions["echo@1"] == list(range(BATCH_PARTITIONS))
        assert sorted(latest.models) == ["echo@1", "tiny@1"]
        assert {served_id: s.state for served_id, s in latest.versions.items()} == {
            "echo@1": "ready",
            "tiny@1": "ready",
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
