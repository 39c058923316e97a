"""The batch job runner against the real broker: it runs only a job whose input file belongs to
the job's owner, and writes a job's result files under random ids, recorded in the job record
first, owned by the job's owner (docs/design.md, "Batch files"); a completed job reports the sum of
its requests' usage."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import orjson
import pytest
from aiokafka import TopicPartition

from schemas.codec import decode_request, encode
from schemas.messages import BatchJob, JobCommand, ReplyEnd, Usage, now_ms
from schemas.model_repo import load_model_repo
from schemas.registry import RegistryState
from services.batcher import jobs
from services.batcher.job_core import request_id_of
from services.batcher.jobs import JobRunner
from tests.waiting import until
from weir.bus import BusSettings, make_consumer, make_producer, partitions_of
from weir.files import FileHeader, chunk_file, read_file, write_file
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

pytestmark = pytest.mark.kafka

REPO = load_model_repo(Path(__file__).parents[2] / "models.toml")
LINES = b"".join(
    orjson.dumps(
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
        }
    )
    + b"\n"
    for i in range(3)
)


async def wait_for(runner: JobRunner, job_id: str, status: str, timeout_s: float = 60) -> BatchJob:
    def in_status() -> BatchJob | None:
        job = runner.jobs.get(job_id)
        return job if job is not None and job.status == status else None

    return await until(in_status, timeout_s=timeout_s, what=f"job {job_id} {status}")


async def test_a_job_runs_only_its_owners_file_and_its_results_get_random_ids(
    batcher_bootstrap, fresh_topics, monkeypatch
) -> None:
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
            job = BatchJob(
                job_id=job_id,
                status="validating",
                endpoint="/v1/chat/completions",
                input_file_id=file_id,
                tenant="acme",
                credential="key",
                principal="ann",
                expires_ms=now_ms() + 86_400_000,
            )
            await producer.send_and_wait(topics.jobs, encode(job), key=job_id.encode())
            await producer.send_and_wait(
                topics.job_commands, encode(JobCommand(job_id=job_id, action="run")), key=job_id.encode()
            )

        await submit("batch_theirs", "file-theirs", ("evil", "key", "eve"))  # a job record naming another's file
        failed = await wait_for(runner, "batch_theirs", "failed")
        assert [e.code for e in failed.errors] == ["file_not_found"]

        await submit("batch_mine", "file-mine", ("acme", "key", "ann"))
        await wait_for(runner, "batch_mine", "in_progress")
        await producer.send_and_wait(
            topics.job_commands, encode(JobCommand(job_id="batch_mine", action="cancel")), key=b"batch_mine"
        )
        done = await wait_for(runner, "batch_mine", "cancelled")
        assert done.error_file_id is not None and done.error_file_id == done.planned_error_file_id
        assert re.fullmatch(r"file-[0-9a-f]{32}", done.error_file_id) and "mine" not in done.error_file_id
        assert done.planned_output_file_id != done.planned_error_file_id and done.output_file_id is None
        stored = await read_file(settings, done.error_file_id, 30, "test-reader")
        assert (
            stored is not None and stored.is_owned_by("acme", "key", "ann") and stored.first.purpose == "batch_output"
        )
        rows = [orjson.loads(x) for x in stored.content().splitlines()]
        assert [(r["custom_id"], r["error"]["code"]) for r in rows] == [(f"c{i}", "batch_cancelled") for i in range(3)]
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await producer.stop()
        await delete_prefixed_topics(batcher_bootstrap, topics.prefix)


async def test_a_completed_jobs_usage_is_the_sum_of_its_requests_ends(batcher_bootstrap, fresh_topics) -> None:
    """A worker stand-in answers each request with a ReplyEnd (twice: a redelivery) whose usage
    grows with the line; the completed job reports their sum once, as OpenAI's batch usage."""
    topics = fresh_topics
    await ensure_topics(batcher_bootstrap, topics.core_specs())
    settings = BusSettings(kafka_bootstrap=batcher_bootstrap, topic_prefix=topics.prefix)
    runner = JobRunner(settings, RegistryState(REPO), "test-runner")
    stop = asyncio.Event()
    running = asyncio.create_task(runner.run(stop))
    producer = make_producer(settings, client_id="test-gateway")
    await producer.start()
    requests = make_consumer(settings, client_id="test-worker", group_id=None)
    await requests.start()

    async def answer() -> None:
        tps = [TopicPartition(topics.requests, p) for p in await partitions_of(requests, topics.requests)]
        requests.assign(tps)
        await requests.seek_to_beginning(*tps)
        while True:
            for records in (await requests.getmany(timeout_ms=200)).values():
                for record in records:
                    request = decode_request(record.value)
                    n = int(request.request_id == request_id_of("batch_used", "c1")) + 1  # c1 costs twice c0, c2
                    end = ReplyEnd(
                        request_id=request.request_id,
                        seq=0,
                        finish_reason="stop",
                        usage=Usage(
                            prompt_tokens=10 * n, completion_tokens=3 * n, total_tokens=13 * n, cached_prompt_tokens=n
                        ),
                    )
                    for _ in range(2):
                        await producer.send_and_wait(request.reply_to, encode(end), key=request.request_id.encode())

    worker = asyncio.create_task(answer())
    try:
        header = FileHeader("file-used", "in.jsonl", "batch", "acme", "key", "ann", now_ms())
        await write_file(producer, topics.files, chunk_file(header, LINES))
        job = BatchJob(
            job_id="batch_used",
            status="validating",
            endpoint="/v1/chat/completions",
            input_file_id="file-used",
            tenant="acme",
            credential="key",
            principal="ann",
            expires_ms=now_ms() + 86_400_000,
        )
        assert job.usage is None
        await producer.send_and_wait(topics.jobs, encode(job), key=b"batch_used")
        await producer.send_and_wait(
            topics.job_commands, encode(JobCommand(job_id="batch_used", action="run")), key=b"batch_used"
        )
        done = await wait_for(runner, "batch_used", "completed")
        assert done.request_counts.completed == 3
        assert done.usage == Usage(prompt_tokens=40, completion_tokens=12, total_tokens=52, cached_prompt_tokens=4)
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
        await requests.stop()
        stop.set()
        await asyncio.wait_for(running, 30)
        await producer.stop()
        await delete_prefixed_topics(batcher_bootstrap, topics.prefix)
