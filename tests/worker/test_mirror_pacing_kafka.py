"""Mirror copies yield to live work in a worker (docs/design.md, "Traffic policies"), on the real
broker: a worker serves a live version and a mirror version (two echo models, each engine on its
own thread, as two versions of one name would be); batches are produced here as the batcher would
make them. While a live request runs, its mirror copy does not advance and, held past
WEIR_MIRROR_MAX_WAIT_MS, ends `rejected` (`mirror_dropped`) on the shadow reply topic; once live
work is idle, a copy completes.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from schemas.codec import decode, decode_reply, encode
from schemas.messages import Batch, ReplyDelta, ReplyEnd, WorkerHeartbeat
from schemas.model_repo import load_model_repo
from schemas.topics import Topics
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.conftest import BOOTSTRAP
from tests.kafka_helpers import produce, read_until
from weir.kafka.admin import deployment_specs, ensure_topics

from .factories import make_request

pytestmark = pytest.mark.kafka

WORDS = " ".join(f"w{i}" for i in range(80))


async def _serve(tmp_path: Path, **settings):
    """A worker of models `live` and `shadow` (echo, 25 ms a step), ready; (worker task, topics, served_ids)."""
    repo_file = tmp_path / "models.toml"
    repo_file.write_text(
        '[models.live]\nengine = "echo"\nmax_model_len = 4096\n\n'
        '[models.shadow]\nengine = "echo"\nmax_model_len = 4096\n'
    )
    repo = load_model_repo(repo_file)
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    specs = [*deployment_specs(topics, repo), topics.reply_spec("client"), topics.reply_spec("shadow")]
    await ensure_topics(BOOTSTRAP, specs)
    worker = WorkerService(
        WorkerSettings(
            kafka_bootstrap=BOOTSTRAP,
            topic_prefix=topics.prefix,
            model_repo=str(repo_file),
            audit_fingerprint_model="",
            heartbeat_interval_ms=300,
            echo_step_delay_ms=25,
            **settings,
        )
    )
    task = asyncio.create_task(worker.serve())
    beats = await read_until(
        BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs), 60
    )
    assert any(decode(WorkerHeartbeat, r.value).is_ready for r in beats), "the worker never became ready"
    return task, topics, repo.models["live"].served_id, repo.models["shadow"].served_id


async def _send_pair(topics: Topics, live_served_id: str, shadow_served_id: str) -> None:
    """A live request of 60 steps (1.5 s at least), then its copy once the live one streams."""
    client = topics.replies("client")
    live = make_request(WORDS, model=live_served_id, request_id="live", max_tokens=60, reply_to=client, mirrors=["2"])
    await _produce_batch(topics, live_served_id, "b1", live)
    await read_until(BOOTSTRAP, [client], lambda rs: len(rs) >= 3)
    copy = make_request(
        WORDS,
        model=shadow_served_id,
        request_id="live.mirror.2",
        max_tokens=10,
        shadow_of="live",
        priority="bulk",
        assignment="mirror",
        reply_to=topics.shadow_replies,
    )
    await _produce_batch(topics, shadow_served_id, "b2", copy)


async def _produce_batch(topics: Topics, served_id: str, batch_id: str, request) -> None:
    batch = Batch(batch_id=batch_id, model=served_id, requests=[request], batcher_id="test")
    await produce(BOOTSTRAP, topics.batches(served_id), [(batch_id, encode(batch))])


def _ends(records) -> dict[str, ReplyEnd]:
    return {e.request_id: e for e in (decode_reply(r.value) for r in records) if isinstance(e, ReplyEnd)}


async def test_a_copy_waits_while_live_work_runs_and_completes_once_it_is_idle(tmp_path: Path) -> None:
    task, topics, live_served_id, shadow_served_id = await _serve(tmp_path, mirror_yield_ms=0, mirror_idle_ms=0)
    try:
        await _send_pair(topics, live_served_id, shadow_served_id)
        client = await read_until(BOOTSTRAP, [topics.replies("client")], lambda rs: "live" in _ends(rs))
        shadow = await read_until(BOOTSTRAP, [topics.shadow_replies], lambda rs: "live.mirror.2" in _ends(rs))
        live_end, copy_end = _ends(client)["live"], _ends(shadow)["live.mirror.2"]
        assert live_end.finish_reason == "length" and copy_end.finish_reason == "length"
        last_live = max(e.created_ms for e in (decode_reply(r.value) for r in client) if isinstance(e, ReplyDelta))
        assert copy_end.received_ms < last_live  # the copy was in its engine while the live one ran...
        assert copy_end.first_token_ms >= last_live  # ...and made no token before the live one's last
        deltas = [e for e in (decode_reply(r.value) for r in shadow) if isinstance(e, ReplyDelta)]
        assert "".join(d.text for d in deltas) == " ".join(WORDS.split()[:10])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_copy_held_past_the_bound_ends_mirror_dropped_on_the_shadow_topic(tmp_path: Path) -> None:
    task, topics, live_served_id, shadow_served_id = await _serve(tmp_path, mirror_yield_ms=0, mirror_max_wait_ms=300)
    try:
        await _send_pair(topics, live_served_id, shadow_served_id)
        shadow = await read_until(BOOTSTRAP, [topics.shadow_replies], lambda rs: "live.mirror.2" in _ends(rs))
        client = await read_until(BOOTSTRAP, [topics.replies("client")], lambda rs: "live" in _ends(rs))
        copy_end, live_end = _ends(shadow)["live.mirror.2"], _ends(client)["live"]
        assert (copy_end.finish_reason, copy_end.error.code) == ("rejected", "mirror_dropped")
        assert copy_end.created_ms < live_end.created_ms  # dropped while the live request still ran
        assert live_end.finish_reason == "length"  # the live request is untouched
        assert [decode_reply(r.value).request_id for r in shadow] == ["live.mirror.2"]  # one event: its end
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
