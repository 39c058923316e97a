"""The batch job runner, started in every batcher process next to the batching loop.

Where the state lives (all in Kafka):
- `weir.job_commands` (keyed by job_id): "run" and "cancel". Runners share it in one consumer
  group, so exactly one runner owns a job: the owner of its partition. A run command's offset is
  committed only once its job is terminal, so a runner killed mid-job leaves the command to the
  partition's next owner, which resumes the job.
- `weir.jobs` (compacted, keyed by job_id): the BatchJob record; every runner reads it whole.
- `weir.replies.job.<job_id>`: the ReplyEvents of the job's requests. A resumed job reads it from
  the start, so it knows which lines already ended, and submits only the others (same
  deterministic request_id; a repeated answer is dropped by seq, the first ReplyEnd wins).
- `weir.files`: the input file (its owner must be the job's) and, at the end, the output and
  error files (random ids recorded in the job record before writing, identical content if
  written twice), so each custom_id appears exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from schemas.codec import DecodeError, decode, decode_reply, encode
from schemas.messages import BatchJob, BatchLineError, Cancellation, JobCommand, ReplyDelta, ReplyEnd, now_ms
from schemas.registry import RegistryState
from services.batcher.job_core import (
    JobResults,
    is_terminal,
    new_file_id,
    parse_input,
    transition,
)
from weir.bus import BusSettings, OffsetTracker, make_consumer, make_producer, partitions_of
from weir.files import FileHeader, chunk_file, is_behind, read_file, write_file
from weir.kafka.admin import ensure_topics

log = logging.getLogger(__name__)

# Requests of one job submitted and not yet ended: keeps the bulk lane fed without filling the
# workers' queues ahead of interactive requests (with 256, echo-model interactive latency doubled).
MAX_IN_FLIGHT = 128
PROGRESS_EVERY_S = 1.0
CANCEL_GRACE_S = 10.0


class JobRunner:
    """Runs the batch jobs whose job_commands partitions this process owns."""

    def __init__(
        self, settings: BusSettings, models: RegistryState, runner_id: str, max_in_flight: int = MAX_IN_FLIGHT
    ) -> None:
        # The batcher's followed registry state: job lines resolve as its requests do.
        self.settings, self.models, self.runner_id = settings, models, runner_id
        self.max_in_flight = max_in_flight
        self.topics = settings.topics
        self.producer = make_producer(settings, client_id=f"{runner_id}-jobs", linger_ms=5)
        self.commands = make_consumer(settings, client_id=f"{runner_id}-jobs", group_id=self.topics.job_runner_group)
        self.table = make_consumer(settings, client_id=f"{runner_id}-jobtable", group_id=None)
        self.jobs: dict[str, BatchJob] = {}
        self.cancels: set[str] = set()
        self.tasks: dict[str, tuple[asyncio.Task[None], TopicPartition]] = {}
        self.tracker = OffsetTracker()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set; jobs in progress are left to the partitions' next owner."""
        started: list[Any] = []
        follower: asyncio.Task[None] | None = None
        try:
            for client in (self.producer, self.table, self.commands):
                await client.start()
                started.append(client)
            await self._catch_up_table()
            follower = asyncio.create_task(self._follow_table())
            self.commands.subscribe([self.topics.job_commands], listener=_Revoke(self))
            while not stop.is_set():
                fetched = await self.commands.getmany(timeout_ms=200)
                for tp, records in fetched.items():
                    for record in records:
                        self.on_command(tp, record)
                committable = self.tracker.committable()
                if committable:
                    await self.commands.commit(committable)
        finally:
            for task, _tp in list(self.tasks.values()):
                task.cancel()
            if follower is not None:
                follower.cancel()
            for client in reversed(started):
                await client.stop()

    def on_command(self, tp: TopicPartition, record: Any) -> None:
        """Start, resume or cancel a job; a run command stays uncommitted until its job is terminal."""
        self.tracker.add(tp, record.offset)
        try:
            command = decode(JobCommand, record.value)
        except DecodeError as exc:
            log.warning("job command %s[%d]@%d ignored: %s", tp.topic, tp.partition, record.offset, exc)
            self.tracker.done(tp, record.offset)
            return
        if command.action == "cancel":
            self.cancels.add(command.job_id)
            self.tracker.done(tp, record.offset)
            if command.job_id in self.tasks:
                return
        elif command.job_id in self.tasks:  # a repeated run command
            self.tracker.done(tp, record.offset)
            return
        task = asyncio.create_task(self._own(command.job_id, tp, record.offset, command.action == "run"))
        self.tasks[command.job_id] = (task, tp)

    async def _own(self, job_id: str, tp: TopicPartition, offset: int, is_run: bool) -> None:
        try:
            job = await self._record(job_id, timeout_s=30.0 if is_run else 2.0)
            if job is None:
                log.warning("batch %s: no job record; command ignored", job_id)
            elif not is_terminal(job):
                await JobExecution(self, job).run()
        except asyncio.CancelledError:
            raise
        except Exception:  # one job's failure must not stop the runner
            log.exception("batch %s failed in the runner", job_id)
            job = self.jobs.get(job_id)
            if job is not None and not is_terminal(job):
                errors = [BatchLineError(code="internal_error", message="the job runner failed; see its log")]
                try:
                    await self.save(
                        job.model_copy(update={"status": "failed", "failed_ms": now_ms(), "errors": errors})
                    )
                except Exception:
                    log.exception("batch %s: cannot record the failure", job_id)
        finally:
            self.tasks.pop(job_id, None)
        if is_run or self.jobs.get(job_id) is None or is_terminal(self.jobs[job_id]):
            self.tracker.done(tp, offset)

    async def _record(self, job_id: str, timeout_s: float) -> BatchJob | None:
        deadline = time.monotonic() + timeout_s
        while job_id not in self.jobs and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded; no event per job
            await asyncio.sleep(0.05)
        return self.jobs.get(job_id)

    async def save(self, job: BatchJob) -> BatchJob:
        """Write a job record and wait until it is durable; returns it."""
        await self.producer.send_and_wait(self.topics.jobs, encode(job), key=job.job_id.encode())
        self.jobs[job.job_id] = job
        return job

    def on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Stop the jobs of partitions this runner no longer owns; their next owner resumes them."""
        for job_id, (task, tp) in list(self.tasks.items()):
            if tp in revoked:
                task.cancel()
                self.tasks.pop(job_id, None)
        self.tracker.forget(revoked)

    async def _catch_up_table(self) -> None:
        topic = self.topics.jobs
        tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(self.table, topic))]
        self.table.assign(tps)
        await self.table.seek_to_beginning(*tps)
        ends = await self.table.end_offsets(tps)
        while await is_behind(self.table, ends):
            self._apply_table(await self.table.getmany(timeout_ms=200))

    async def _follow_table(self) -> None:
        while True:
            self._apply_table(await self.table.getmany(timeout_ms=500))

    def _apply_table(self, fetched: dict[TopicPartition, list[Any]]) -> None:
        for records in fetched.values():
            for record in records:
                try:
                    job = decode(BatchJob, record.value)
                except DecodeError:
                    continue
                known = self.jobs.get(job.job_id)
                if known is None or job.updated_ms >= known.updated_ms:
                    self.jobs[job.job_id] = job


class _Revoke(ConsumerRebalanceListener):
    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self.runner.on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        pass


class JobExecution:
    """One job from its current record to a terminal one: validate, submit, collect, write files."""

    def __init__(self, runner: JobRunner, job: BatchJob) -> None:
        self.runner, self.job = runner, job
        self.topics = runner.topics
        self.reply_topic = self.topics.job_replies(job.job_id)
        self.submitted: set[str] = set()

    @property
    def producer(self) -> AIOKafkaProducer:
        return self.runner.producer

    async def run(self) -> None:
        """Drive the job to completed, failed, cancelled or expired."""
        job = self.job
        stored = await read_file(self.runner.settings, job.input_file_id, 30.0, f"{self.runner.runner_id}-files")
        # Another owner's file does not exist for this job (docs/design.md, "Batch files"): the
        # gateway checked it, and a job record written straight to Kafka is checked here again.
        if (
            stored is None
            or not stored.is_owned_by(job.tenant, job.credential, job.principal)
            or stored.first.purpose != "batch"
        ):
            return await self._fail(BatchLineError(code="file_not_found", message=f"no file {job.input_file_id!r}"))
        parsed = parse_input(stored.content(), job, self.runner.models, self.reply_topic)
        if parsed.errors:
            return await self._fail(*parsed.errors)
        results = JobResults(parsed.lines)
        if job.status == "validating":
            counts = results.counts()
            self.job = await self.runner.save(transition(job, "in_progress", now_ms(), request_counts=counts))
            log.info("batch %s in progress: %d requests", job.job_id, counts.total)
        await ensure_topics(self.runner.settings.kafka_bootstrap, [self.topics.job_reply_spec(job.job_id)])
        replies = make_consumer(self.runner.settings, client_id=f"{self.runner.runner_id}-{job.job_id}", group_id=None)
        await replies.start()
        try:
            tp = TopicPartition(self.reply_topic, 0)
            replies.assign([tp])
            await replies.seek_to_beginning(tp)
            end = (await replies.end_offsets([tp]))[tp]
            while await replies.position(tp) < end:  # what earlier owners already got
                self._apply(results, await replies.getmany(timeout_ms=200))
            outcome = await self._collect(results, replies)
            if outcome == "cancel":
                await self._cancel(results, replies)
            elif outcome == "expire":
                await self._finish(results, "expired", "batch_expired")
            else:
                self.job = await self.runner.save(
                    transition(self.job, "finalizing", now_ms(), request_counts=results.counts())
                )
                await self._finish(results, "completed", None)
        finally:
            await replies.stop()

    async def _collect(self, results: JobResults, replies: AIOKafkaConsumer) -> str:
        """Submit and read until every line ended ("done"), or a cancel ("cancel") or the expiry ("expire")."""
        last_progress = time.monotonic()
        counts = results.counts()
        lines = results.lines
        window = self._window(results)
        next_index = 0  # lines are submitted in file order; all before next_index were looked at
        in_flight: set[str] = set()
        while True:
            if self.job.job_id in self.runner.cancels or self.job.status == "cancelling":
                return "cancel"
            if now_ms() >= self.job.expires_ms:
                return "expire"
            if results.num_pending == 0:
                return "done"
            in_flight = {r for r in in_flight if not results.is_ended(r)}
            sends = []
            while next_index < len(lines) and len(in_flight) < window:
                line = lines[next_index]
                next_index += 1
                if line.request is None or results.is_ended(line.request_id):
                    continue
                sends.append(
                    await self.producer.send(self.topics.requests, encode(line.request), key=line.request_id.encode())
                )
                self.submitted.add(line.request_id)
                in_flight.add(line.request_id)
            if sends:
                await asyncio.gather(*sends)
            self._apply(results, await replies.getmany(timeout_ms=200, max_records=2000))
            if time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                if results.counts() != counts:
                    counts = results.counts()
                    self.job = await self.runner.save(
                        self.job.model_copy(update={"request_counts": counts, "updated_ms": now_ms()})
                    )

    def _window(self, results: JobResults) -> int:
        """Most requests in flight: MAX_IN_FLIGHT, and at most half the sequences the job's models
        run at once, so a bulk job leaves the workers room for interactive requests (workers have
        no lanes: what they hold, they run in arrival order)."""
        window = self.runner.max_in_flight
        for served_id in {line.model for line in results.lines if line.request is not None}:
            model = self.runner.models.config_of(served_id)
            if model is not None:
                window = min(window, max(1, model.max_num_seqs * model.instances // 2))
        return window

    async def _cancel(self, results: JobResults, replies: AIOKafkaConsumer) -> None:
        self.job = await self.runner.save(transition(self.job, "cancelling", now_ms(), request_counts=results.counts()))
        running = [line.request_id for line in results.pending() if line.request_id in self.submitted]
        for request_id in running:
            cancel = Cancellation(request_id=request_id, reason="user", reply_to=self.reply_topic)
            await self.producer.send(self.topics.control, encode(cancel), key=request_id.encode())
        await self.producer.flush()
        deadline = time.monotonic() + CANCEL_GRACE_S
        while running and time.monotonic() < deadline and any(not results.is_ended(r) for r in running):
            self._apply(results, await replies.getmany(timeout_ms=200))
        await self._finish(results, "cancelled", "batch_cancelled")

    async def _finish(self, results: JobResults, status: str, unfinished_code: str | None) -> None:
        if self.job.planned_output_file_id is None or self.job.planned_error_file_id is None:
            # Random ids, recorded before any file is written: a runner that restarts while writing
            # rewrites the same files, and no one can derive them from the batch id.
            planned = {"planned_output_file_id": new_file_id(), "planned_error_file_id": new_file_id()}
            self.job = await self.runner.save(self.job.model_copy(update={**planned, "updated_ms": now_ms()}))
        job = self.job
        assert job.planned_output_file_id is not None and job.planned_error_file_id is not None
        output, errors = results.files(job.endpoint, unfinished_code)
        changes: dict[str, Any] = {"request_counts": results.counts(), "usage": results.usage()}
        created_ms = job.finalizing_ms or job.cancelling_ms or now_ms()
        for file_id, name, text in (
            (job.planned_output_file_id, "output", output),
            (job.planned_error_file_id, "errors", errors),
        ):
            if not text:
                continue
            header = FileHeader(
                file_id,
                f"{job.job_id}_{name}.jsonl",
                "batch_output",
                job.tenant,
                job.credential,
                job.principal,
                created_ms,
            )  # the batch's owner owns its results
            await write_file(self.producer, self.topics.files, chunk_file(header, text.encode()))
            changes["output_file_id" if name == "output" else "error_file_id"] = file_id
        self.job = await self.runner.save(transition(job, status, now_ms(), **changes))
        counts = self.job.request_counts
        log.info(
            "batch %s %s: %d completed, %d failed of %d",
            job.job_id,
            status,
            counts.completed,
            counts.failed,
            counts.total,
        )

    async def _fail(self, *errors: BatchLineError) -> None:
        if self.job.status == "validating":
            failed = transition(self.job, "failed", now_ms(), errors=list(errors))
        else:  # a job that passed validation once and cannot be read again (its file expired)
            failed = self.job.model_copy(update={"status": "failed", "failed_ms": now_ms(), "errors": list(errors)})
        self.job = await self.runner.save(failed)
        log.info("batch %s failed validation: %s", self.job.job_id, errors[0].message)

    @staticmethod
    def _apply(results: JobResults, fetched: dict[TopicPartition, list[Any]]) -> None:
        for records in fetched.values():
            for record in records:
                try:
                    results.add(_fast_reply(record.value))
                except (DecodeError, orjson.JSONDecodeError):
                    continue


def _fast_reply(value: bytes | None) -> ReplyDelta | ReplyEnd:
    """A reply event; single-position deltas (most of a job's reply topic at low load) skip pydantic
    validation, since the runner shares the batcher's event loop and needs only their request_id,
    seq and text. A coalesced delta (count > 1), or one with logprobs (a line that asked for them),
    is validated: the runner may cut it, or keeps its logprobs."""
    raw = orjson.loads(value or b"")
    if isinstance(raw, dict) and raw.get("type") == "delta" and raw.get("count", 1) == 1 and not raw.get("logprobs"):
        request_id, seq, text = raw.get("request_id"), raw.get("seq"), raw.get("text")
        if isinstance(request_id, str) and isinstance(seq, int) and seq >= 0 and isinstance(text, str):
            return ReplyDelta.model_construct(request_id=request_id, seq=seq, text=text)
    return decode_reply(value)
