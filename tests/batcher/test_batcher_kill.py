"""kill -9 of a batcher process that holds requests: the next batcher process batches them all."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from schemas.codec import decode, decode_reply
from schemas.messages import Batch, now_ms
from schemas.topics import Topics, TopicSpec
from tests.kafka_helpers import produce, read_until, wait_committed
from weir.kafka.admin import ensure_topics

from .factories import make_request

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_repo(path: Path, max_batch_size: int, max_wait_ms: int) -> Path:
    path.write_text(f'[models.a]\nengine = "echo"\nmax_batch_size = {max_batch_size}\nmax_wait_ms = {max_wait_ms}\n')
    return path


async def spawn_batcher(bootstrap: str, topics: Topics, repo: Path, log: Path) -> asyncio.subprocess.Process:
    argv = ["-m", "services.batcher.app", "--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            "--model-repo",
            str(repo),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


async def test_kill_9_while_holding_loses_nothing(batcher_bootstrap: str, fresh_topics: Topics, tmp_path: Path) -> None:
    bootstrap, topics = batcher_bootstrap, fresh_topics
    reply_to = topics.replies("test")
    # One request partition, so the reply to the last record proves every earlier one was read.
    specs = [
        TopicSpec(topics.requests, 1),
        TopicSpec(topics.control, 1),
        TopicSpec(topics.dead_letter, 1),
        TopicSpec(topics.batches("a@1"), 1),
        topics.reply_spec("test"),
    ]
    await ensure_topics(bootstrap, specs)
    reqs = [make_request("a", reply_to=reply_to, deadline_ms=now_ms() + 120_000) for _ in range(6)]
    marker = make_request("not-served", reply_to=reply_to, deadline_ms=now_ms() + 120_000)
    await produce(bootstrap, topics.requests, [*reqs, marker])

    log = tmp_path / "batchers.log"
    first = await spawn_batcher(bootstrap, topics, write_repo(tmp_path / "patient.toml", 100, 60_000), log)
    try:
        replies = await read_until(bootstrap, [reply_to], lambda rs: len(rs) >= 1, timeout_s=60)
        assert [decode_reply(r.value).request_id for r in replies] == [marker.request_id], log.read_text()
    finally:
        if first.returncode is None:
            first.send_signal(signal.SIGKILL)
        await first.wait()

    second = await spawn_batcher(bootstrap, topics, write_repo(tmp_path / "eager.toml", 4, 10), log)
    try:
        want = {r.request_id for r in reqs}

        def batched(records) -> list[str]:
            return [r.request_id for rec in records for r in decode(Batch, rec.value).requests]

        batches = await read_until(bootstrap, [topics.batches("a@1")], lambda rs: set(batched(rs)) >= want, 60)
        assert Counter(batched(batches)) == Counter(want), log.read_text()
        lag = await wait_committed(bootstrap, topics.batcher_group, topics.requests)
        assert lag == {0: (7, 7)}, log.read_text()
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(second.wait(), 30) == 0, log.read_text()
