"""The gateway's store of OpenAI's Files and Batch APIs, over Kafka only (the routes:
routes/batches.py; the objects and checks: batch_format.py).

Uploads become FileChunks on `weir.files`, each carrying its owner (tenant, principal); a new
batch becomes its first BatchJob record on the compacted `weir.jobs` and a "run" JobCommand on
`weir.job_commands`, which the batcher's job runner executes. Every gateway reads both topics whole and keeps following them, so any instance answers
for any file or batch; an instance sees its own writes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

from aiokafka import TopicPartition

from schemas.codec import DecodeError, decode, encode
from schemas.messages import BatchJob, FileChunk, JobCommand, now_ms
from services.gateway.batch_upload import Upload
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import Identity
from weir.bus import instance_id, make_consumer, make_producer, partitions_of
from weir.files import FileHeader, FileIndex, is_behind, write_spooled

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    """A fresh id no one can guess: `prefix` and 128 random bits (docs/design.md, "Batch files")."""
    return f"{prefix}{secrets.token_hex(16)}"


class BatchStore:
    """This gateway's view of the files and jobs topics, and the producer that writes them.

    create_app's lifespan calls start() after the bus and guard have started, and stop() first."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.producer: Any = None  # AIOKafka clients need the running loop: made in start()
        self.follower: Any = None
        self.files = FileIndex()
        self.jobs: dict[str, BatchJob] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read both topics to their end, then keep following them."""
        client_id = instance_id("gateway-batches")
        self.producer = make_producer(self.settings, client_id=client_id)
        self.follower = make_consumer(self.settings, client_id=client_id, group_id=None)
        await self.producer.start()
        await self.follower.start()
        tps = [
            TopicPartition(topic, p)
            for topic in (self.topics.files, self.topics.jobs)
            for p in sorted(await partitions_of(self.follower, topic))
        ]
        self.follower.assign(tps)
        await self.follower.seek_to_beginning(*tps)
        ends = await self.follower.end_offsets(tps)
        while await is_behind(self.follower, ends):
            self._apply(await self.follower.getmany(timeout_ms=200))
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        """Stop following and close the clients."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in (self.follower, self.producer):
            if client is not None:
                await client.stop()

    async def _follow(self) -> None:
        while True:
            self._apply(await self.follower.getmany(timeout_ms=500))

    def _apply(self, fetched: dict[TopicPartition, list[Any]]) -> None:
        for tp, records in fetched.items():
            for record in records:
                try:
                    if tp.topic == self.topics.files:
                        self.files.add(decode(FileChunk, record.value))
                    else:
                        self._keep(decode(BatchJob, record.value))
                except DecodeError as exc:
                    log.warning("ignored %s[%d]@%d: %s", tp.topic, tp.partition, record.offset, exc)

    def _keep(self, job: BatchJob) -> None:
        known = self.jobs.get(job.job_id)
        if known is None or job.updated_ms >= known.updated_ms:
            self.jobs[job.job_id] = job

    async def put_upload(self, upload: Upload, identity: Identity) -> FileChunk:
        """Store a checked upload as a batch input file owned by `identity`, under a fresh random
        id, a chunk at a time from its spooled file; returns its first chunk (the file's metadata)."""
        assert upload.file is not None
        owner = identity.owner
        header = FileHeader(
            new_id("file-"), upload.filename, "batch", owner.tenant, owner.credential, owner.principal, now_ms()
        )
        return await write_spooled(self.producer, self.topics.files, header, upload.file, upload.size, self.files.add)

    async def create_job(self, job: BatchJob) -> None:
        """Write the job's first record, then the command that makes a runner take it."""
        await self.producer.send_and_wait(self.topics.jobs, encode(job), key=job.job_id.encode())
        self._keep(job)
        await self.command(job.job_id, "run")

    async def command(self, job_id: str, action: str) -> None:
        """Send a JobCommand to the job's runner."""
        command = JobCommand(job_id=job_id, action=action)
        await self.producer.send_and_wait(self.topics.job_commands, encode(command), key=job_id.encode())
