"""The batch job runner against the real broker: it runs only a job whose input file belongs to
the job's owner, and writes a job's result files under random ids, recorded in the job record
first, owned by the job's owner (docs/design.md, "Batch files")."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import orjson
import pytest

from schemas.codec import encode
from schemas.messages import BatchJob, JobCommand, now_ms
from schemas.model_repo import load_model_repo
from schemas.registry import RegistryState
from services.batcher import jobs
from services.batcher.jobs import JobRunner
from weir.bus import BusSettings, make_producer
from weir.files import FileHeader, chunk_file, read_file, write_file
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

pytestmark = pytest.mark.kafka

REPO = load_model_repo(Path(__file__).parents[2] / "models.toml")
LINES = b"".join(orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
    "model": "echo", "messages": [{"role": "user", "content": "hi"}]}}) + b"\n" for i in range(3))  # fmt: skip


async def wait_for(runner: JobRunner, job_id: str, status: str, timeout_s: float = 60) -> BatchJob:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        job = runner.jobs.get(job_id)
        if job is not None and job.status == status:
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(f"{job_id} is {runner.jobs.get(job_id)}, not {status}")


async def test_a_job_runs_only_its_owners_file_and_its_results_get_random_ids(batcher_bootstrap, fresh_topics,
                                                                               monkeypatch) -> None:  # fmt: skip
    monkeypatch.setattr(jobs, "CANCEL_GRACE_S", 0.5)  # no worker answers here: do not wait for one
    topics = fresh_topics
    await ensure_topics(batcher_bootstrap, topics.core_specs())
    settings = BusSettings(kafka_bootstrap=batcher_bootstrap, topic_prefix=topics.prefix)
    runner = JobRunner(settings, RegistryState(REPO), "test-runner")
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    producer = make_producer(settings, client_id="test-gateway")
    await producer.start()
    try:
        async def submit(job_id: str, file_id: str, owner: tuple[str, str, str]) -> None:
            header = FileHeader(file_id, "in.jsonl", "batch", *owner, now_ms())
            await write_file(producer, topics.files, chunk_file(header, LINES))
            job = BatchJob(job_id=job_id, status="validating", endpoint="/v1/chat/completions", input_file_id=file_id,
                           tenant="acme", credential="key", principal="ann", expires_ms=now_ms() + 86_400_000)  # fmt: skip
            await producer.send_and_wait(topics.jobs, encode(job), key=job_id.encode())
            await producer.send_and_wait(topics.job_commands, encode(JobCommand(job_id=job_id, action="run")),
                                         key=job_id.encode())

        await submit("batch_theirs", "file-theirs", ("evil", "key", "eve"))  # a job record naming another's file
        failed = await wait_for(runner, "batch_theirs", "failed")
        assert [e.code for e in failed.errors] == ["file_not_found"]

        await submit("batch_mine", "file-mine", ("acme", "key", "ann"))
        await wait_for(runner, "batch_mine", "in_progress")
        await producer.send_and_wait(topics.job_commands, encode(JobCommand(job_id="batch_mine", action="cancel")),
                                     key=b"batch_mine")
        done = await wait_for(runner, "batch_mine", "cancelled")
        assert done.error_file_id is not None and done.error_file_id == done.planned_error_file_id
        assert re.fullmatch(r"file-[0-9a-f]{32}", done.error_file_id) and "mine" not in done.error_file_id
        assert done.planned_output_file_id != done.planned_error_file_id and done.output_file_id is None
        stored = await read_file(settings, done.error_file_id, 30, "test-reader")
        assert stored is not None and stored.is_owned_by("acme", "key", "ann") and stored.first.purpose == "batch_output"
        rows = [orjson.loads(x) for x in stored.content().splitlines()]
        assert [(r["custom_id"], r["error"]["code"]) for r in rows] == [(f"c{i}", "batch_cancelled") for i in range(3)]
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await producer.stop()
        await delete_prefixed_topics(batcher_bootstrap, topics.prefix)
