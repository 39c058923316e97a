"""A worker's part in mirroring (docs/design.md, "Traffic policies"), on the real broker: the live
request of a mirrored pair has its answer published as a ShadowLive for the comparison, the copy's
answer goes only to the shadow reply topic, and audit events carry assignment and shadow_of.

An echo worker reads batches produced here as the batcher would make them.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from schemas.codec import decode, decode_reply, encode
from schemas.messages import AuditEvent, Batch, ReplyDelta, ReplyEnd, WorkerHeartbeat
from schemas.model_repo import load_model_repo
from schemas.registry import ShadowLive
from schemas.topics import Topics
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from tests.conftest import BOOTSTRAP
from tests.kafka_helpers import produce, read_until
from weir.kafka.admin import deployment_specs, ensure_topics

from .factories import make_request

pytestmark = pytest.mark.kafka


async def test_a_mirrored_live_answer_is_published_and_audit_events_say_how(tmp_path: Path) -> None:
    repo_file = tmp_path / "models.toml"
    repo_file.write_text('[models.echo]\nengine = "echo"\nmax_model_len = 4096\n')
    repo = load_model_repo(repo_file)
    served_id = repo.models["echo"].served_id
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    await ensure_topics(
        BOOTSTRAP, [*deployment_specs(topics, repo), topics.reply_spec("client"), topics.reply_spec("shadow")]
    )
    worker = WorkerService(
        WorkerSettings(
            kafka_bootstrap=BOOTSTRAP,
            topic_prefix=topics.prefix,
            model_repo=str(repo_file),
            audit_fingerprint_model="",
            heartbeat_interval_ms=300,
        )
    )
    task = asyncio.create_task(worker.serve())
    try:
        beats = await read_until(
            BOOTSTRAP, [topics.workers], lambda rs: any(decode(WorkerHeartbeat, r.value).is_ready for r in rs), 60
        )
        assert any(decode(WorkerHeartbeat, r.value).is_ready for r in beats), "the worker never became ready"
        client = topics.replies("client")

        def req(rid: str, **fields: object):
            return make_request(
                model=served_id, request_id=rid, prompt="one two three four", reply_to=client
            ).model_copy(update=fields)

        live = req("live", assignment="canary", mirrors=["2"])
        plain = req("plain", assignment="default")
        copy = req(
            "live.mirror.2", assignment="mirror", shadow_of="live", priority="bulk", reply_to=topics.shadow_replies
        )
        batch = Batch(batch_id="b1", model=served_id, requests=[live, plain, copy], batcher_id="test")
        await produce(BOOTSTRAP, topics.batches(served_id), [("b1", encode(batch))])

        shadow = await read_until(BOOTSTRAP, [topics.shadow_live], lambda rs: len(rs) >= 1)
        replies = await read_until(
            BOOTSTRAP, [client], lambda rs: sum(isinstance(decode_reply(r.value), ReplyEnd) for r in rs) >= 2
        )
        audits = await read_until(BOOTSTRAP, [topics.audit], lambda rs: len(rs) >= 3)
        copy_replies = await read_until(
            BOOTSTRAP, [topics.shadow_replies], lambda rs: any(isinstance(decode_reply(r.value), ReplyEnd) for r in rs)
        )

        # Only the live request with mirrors has its answer published, matching what its client got.
        [published] = [decode(ShadowLive, r.value) for r in shadow]
        events = [decode_reply(r.value) for r in replies]
        deltas = [e for e in events if isinstance(e, ReplyDelta) and e.request_id == "live"]
        assert published.request_id == "live" and published.model == served_id and published.assignment == "canary"
        assert published.text == "".join(d.text for d in deltas) and published.text
        assert published.token_ids == [t for d in deltas for t in d.token_ids] and published.token_ids
        [end] = [e for e in events if isinstance(e, ReplyEnd) and e.request_id == "live"]
        assert published.finish_reason == end.finish_reason
        assert end.received_ms is not None and end.first_token_ms is not None
        assert published.ttft_ms == end.first_token_ms - end.received_ms
        assert published.tokens_per_s is None or published.tokens_per_s > 0

        # The copy is answered on the shadow topic only: its client's topic never sees it.
        assert {e.request_id for e in events} == {"live", "plain"}
        assert {decode_reply(r.value).request_id for r in copy_replies} == {"live.mirror.2"}

        # Audit events say how each version was chosen, and which live request a copy copies.
        by_id = {e.request_id: e for e in (decode(AuditEvent, r.value) for r in audits)}
        assert (by_id["live"].assignment, by_id["live"].shadow_of) == ("canary", None)
        assert (by_id["plain"].assignment, by_id["plain"].shadow_of) == ("default", None)
        assert (by_id["live.mirror.2"].assignment, by_id["live.mirror.2"].shadow_of) == ("mirror", "live")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
