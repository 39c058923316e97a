"""The worker's Kafka edge: batches in, token deltas, terminal events and audit events out.

A batch's offset is committed only when every request in it has its terminal event durably
written (acks=all). A worker killed at any moment therefore leaves its unfinished batches
uncommitted; the consumer group hands them to another worker (or this one, restarted), which
regenerates them with the same seeds. Readers drop the repeated deltas by sequence number. A run
whose events cannot be written (the broker is away) is stopped and run again here once writes
may succeed (delivery.py), the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from schemas.codec import DecodeError, decode, encode
from schemas.fingerprint import key_id, keyed_hmac
from schemas.messages import (
    AuditEvent,
    Batch,
    Cancellation,
    EmbedRequest,
    ErrorInfo,
    GenerateRequest,
    ReplyDelta,
    ReplyEnd,
    Usage,
    now_ms,
)
from schemas.model_repo import ModelConfig
from schemas.topics import Topics
from services.worker.delivery import RedoPolicy, Writer, failure_of, first_failure, is_outage
from services.worker.fingerprints import FingerprintBatcher
from services.worker.runner import EngineHost
from services.worker.engine import EngineOutput
from weir.bus import BusSettings, CommitPacer, OffsetTracker, make_consumer, partitions_of, send_dead_letter

log = logging.getLogger(__name__)

_CANCEL_MEMORY_MS = 15 * 60 * 1000


@dataclass
class InFlight:
    """A request the worker has taken, and the batch offsets waiting for its end."""

    request: GenerateRequest | EmbedRequest
    batch_id: str
    offsets: list[tuple[TopicPartition, int]] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)  # every write of the current run
    failure: BaseException | None = None  # the first write of the current run that failed
    num_redos: int = 0


class ModelServer:
    """Serves one model: consumes its batch topic in the model's group, runs engine instances."""

    def __init__(
        self,
        config: ModelConfig,
        runners: list[EngineHost],
        settings: BusSettings,
        producer: AIOKafkaProducer,
        worker_id: str,
        audit_key: bytes,
        fingerprints: FingerprintBatcher | None = None,
        redo_policy: RedoPolicy | None = None,
    ) -> None:
        self.config = config
        self.runners = runners
        self.settings = settings
        self.topics: Topics = settings.topics
        self.producer = producer
        self.writer = Writer(producer)
        self.redo_policy = redo_policy or RedoPolicy()
        self._tasks: set[asyncio.Task] = set()  # settles and redos in flight (the loop keeps weak references)
        self.worker_id = worker_id
        self.audit_key = audit_key
        self.audit_key_id = key_id(audit_key)
        self.fingerprints = fingerprints
        self.tracker = OffsetTracker()
        self._commits = CommitPacer(settings.commit_interval_ms)
        self.in_flight: dict[str, InFlight] = {}
        self._owner: dict[str, EngineHost] = {}
        self._batch_left: dict[tuple[TopicPartition, int], int] = {}
        self._outputs: asyncio.Queue[list[EngineOutput]] = asyncio.Queue()
        self.recent_cancels: dict[str, int] = {}
        self.consumer: AIOKafkaConsumer | None = None
        self.num_done = 0
        self.next_offsets: dict[int, int] = {}  # owned partition -> next batch offset read (heartbeats)
        self.on_assignment: Callable[[], None] | None = None  # called when Kafka assigns partitions

    @property
    def model_version(self) -> str:
        return f"{self.config.name}@{self.config.version}"

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        """Called on the loop by the engine threads."""
        self._outputs.put_nowait(outputs)

    # -- consuming ----------------------------------------------------------------------------

    async def consume(self) -> None:
        """Take batches while engines have room; pause the partitions while they do not."""
        self.consumer = make_consumer(
            self.settings, client_id=self.worker_id, group_id=self.topics.worker_group(self.config.name),
            max_poll_records=8, session_timeout_ms=6000,
        )  # fmt: skip
        self.consumer.subscribe([self.topics.batches(self.config.name)], listener=_Revoked(self))
        await self.consumer.start()
        try:
            while True:
                room = self.config.max_num_seqs * len(self.runners) - len(self.in_flight)
                assigned = self.consumer.assignment()
                if room <= 0:
                    self.consumer.pause(*assigned)
                else:
                    self.consumer.resume(*assigned)
                records = await self.consumer.getmany(timeout_ms=100)
                for tp, batch in records.items():
                    for record in batch:
                        await self.on_batch_record(tp, record)
                if self._commits.is_due():
                    await self.commit()
        finally:
            try:  # what is durable now, so a clean stop leaves nothing to redo
                await asyncio.wait_for(self.commit(), 3.0)
            except (TimeoutError, KafkaError):
                pass
            await self.consumer.stop()

    def owned_partitions(self) -> tuple[list[int], dict[int, int]]:
        """The batch-topic partitions this server owns now, and the next offset it reads in each:
        what heartbeats advertise, so the batcher routes batches here and knows what was read."""
        owned = sorted(tp.partition for tp in self.consumer.assignment()) if self.consumer is not None else []
        return owned, {p: self.next_offsets[p] for p in owned if p in self.next_offsets}

    async def on_batch_record(self, tp: TopicPartition, record) -> None:
        self.tracker.add(tp, record.offset)
        self.next_offsets[tp.partition] = record.offset + 1
        try:
            batch = decode(Batch, record.value)
        except DecodeError as exc:
            await send_dead_letter(self.producer, self.topics, record, str(exc), self.worker_id)
            self.tracker.done(tp, record.offset)
            return
        key = (tp, record.offset)
        self._batch_left[key] = len(batch.requests)
        for request in batch.requests:
            await self.on_request(request, batch.batch_id, key)

    async def on_request(
        self, request: GenerateRequest | EmbedRequest, batch_id: str, key: tuple[TopicPartition, int]
    ) -> None:
        flight = self.in_flight.get(request.request_id)
        if flight is not None:  # the same request twice (a redelivered batch): one run answers both
            flight.offsets.append(key)
            return
        flight = InFlight(request, batch_id, [key])
        self.in_flight[request.request_id] = flight
        await self.start(flight)

    async def start(self, flight: InFlight) -> None:
        """Run a request taken from a batch (again, after a run that could not be written)."""
        request = flight.request
        now = now_ms()
        if request.model != self.config.name:
            info = ErrorInfo(code="wrong_model", message=f"batch for {self.config.name} holds a request for {request.model}")
            await self.finish_early(flight, "rejected", info)
        elif (request.kind == "embed") != (self.config.engine == "onnx"):
            await self.finish_early(flight, "rejected", self.unsupported_kind(request))
        elif request.request_id in self.recent_cancels:
            await self.finish_early(flight, "cancelled", ErrorInfo(code="cancelled", message="request was cancelled"))
        elif request.deadline_ms <= now:
            await self.finish_early(flight, "timeout", ErrorInfo(code="deadline_exceeded", message="deadline passed before the model ran"))
        else:
            runner = min(self.runners, key=lambda r: r.num_pending)
            self._owner[request.request_id] = runner
            runner.submit(request)

    def unsupported_kind(self, request: GenerateRequest | EmbedRequest) -> ErrorInfo:
        """Why this model cannot serve a request of that kind."""
        if request.kind == "embed":
            message = f"model {self.config.name} generates text; embeddings need an embedding model (engine onnx)"
        else:
            message = f"model {self.config.name} is an embedding model; it serves EmbedRequests (kind=embed) only"
        return ErrorInfo(code="unsupported_request_kind", message=message)

    def on_cancel(self, cancel: Cancellation) -> None:
        self.recent_cancels[cancel.request_id] = now_ms()
        runner = self._owner.get(cancel.request_id)
        if runner is not None:
            log.info("cancel request_id=%s reason=%s: aborting it", cancel.request_id, cancel.reason)
            runner.cancel(cancel.request_id)

    # -- producing ----------------------------------------------------------------------------

    async def publish(self) -> None:
        """Turn engine outputs into reply and audit events, in order, and settle offsets."""
        while True:
            outputs = await self._outputs.get()
            for runner in self.runners:
                if runner.failure is not None:
                    raise RuntimeError(f"engine of {self.config.name} failed: {runner.failure!r}")
            for out in outputs:
                flight = self.in_flight.get(out.request_id)
                if flight is None:
                    continue  # warmup, or a request this worker no longer owns
                await self.send_output(flight, out)

    async def send_output(self, flight: InFlight, out: EngineOutput) -> None:
        if flight.failure is not None:  # this run is broken: write nothing more of it
            if out.is_final:
                self.redo_later(flight, flight.failure)
            return
        req = flight.request
        key = req.request_id.encode()
        seq = out.seq
        if out.text or (out.token_ids and not out.is_final):
            delta = ReplyDelta(request_id=req.request_id, batch_id=flight.batch_id, seq=seq, text=out.text, token_ids=out.token_ids)
            self._note(flight, await self._send(req.reply_to, encode(delta), key))
            seq += 1
        if not out.is_final:
            return
        end = ReplyEnd(
            request_id=req.request_id, batch_id=flight.batch_id, seq=seq, finish_reason=out.finish_reason,
            usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                        total_tokens=out.prompt_tokens + out.completion_tokens),
            error=out.error, model_version=self.model_version, received_ms=out.received_ms,
            first_token_ms=out.first_token_ms, embeddings=out.embeddings,
        )  # fmt: skip
        self._note(flight, await self._send(req.reply_to, encode(end), key))
        if out.prompt_text is not None:
            self._note(flight, await self.send_audit(flight, out, key))
        self._spawn(self.settle(flight))

    async def send_audit(self, flight: InFlight, out: EngineOutput, key: bytes) -> asyncio.Future:
        """Produce the request's AuditEvent; with a fingerprint batcher, once its SimHashes are in.

        Returns a future of the durable write, which settle() waits for before the batch offset
        may be committed (a crash before it redoes the request, and so the AuditEvent).
        """
        fingerprints = self.fingerprints
        if fingerprints is None:
            return await self._send(self.topics.audit, encode(self.audit_event(flight, out)), key)

        async def fingerprint_then_send() -> object:
            event = self.audit_event(flight, out)
            try:
                prompt_sh, output_sh = await fingerprints.simhash(out.prompt_text or "", out.output_text or "")
                event = event.model_copy(update={"prompt_simhash": prompt_sh, "output_simhash": output_sh,
                                                 "fingerprint_model": fingerprints.model})
            except Exception as exc:  # noqa: BLE001 - the HMACs still go out
                log.warning("fingerprinting %s failed (%r); its AuditEvent has no SimHash", flight.request.request_id, exc)
            return await (await self._send(self.topics.audit, encode(event), key))

        return asyncio.get_running_loop().create_task(fingerprint_then_send())

    async def _send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future:
        return await self.writer.send(topic, value, key)

    def _note(self, flight: InFlight, future: asyncio.Future) -> None:
        """Count a write of the flight's current run. A write that failed stops the run: seen here
        when the writer refused it at once (the broker is away), or as the run's previous write
        (one event late); settle() looks at every write at the end. No callback per write: this
        runs for every token."""
        futures = flight.futures
        previous = futures[-1] if futures else None
        futures.append(future)
        if flight.failure is None:
            exc = failure_of(future) or (failure_of(previous) if previous is not None else None)
            if exc is not None:
                self._break(flight, exc)

    def _break(self, flight: InFlight, exc: BaseException) -> None:
        flight.failure = exc
        rid = flight.request.request_id
        log.warning("request %s: a write to %s failed (%r); stopping this run", rid, flight.request.reply_to, exc)
        runner = self._owner.get(rid)
        if runner is not None:
            runner.cancel(rid)  # its final output then comes to send_output, which redoes it

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def redo_later(self, flight: InFlight, failure: BaseException) -> None:
        """After a run that could not be written: run the request again from the start (readers
        drop the seqs they have), or give up on it when that cannot help."""
        req = flight.request
        delay_s = self.redo_policy.next_try_s(failure, flight.num_redos, req.deadline_ms, now_ms())
        if delay_s is None:
            why = "its deadline passed long ago" if is_outage(failure) else "its reply topic refuses it"
            log.error("request %s cannot be answered on %s (%r; %s); giving up on it", req.request_id, req.reply_to, failure, why)
            self._forget(flight)
            return
        log.info("request %s: running it again in %.1f s (redo %d)", req.request_id, delay_s, flight.num_redos + 1)
        flight.num_redos += 1

        async def redo() -> None:
            await asyncio.sleep(delay_s)
            if self.in_flight.get(req.request_id) is flight:  # not ended meanwhile (a rebalance redo here)
                self._spawn(first_failure(flight.futures))  # collects the broken run's failures (no warnings)
                flight.futures, flight.failure = [], None
                await self.start(flight)

        self._spawn(redo())

    async def finish_early(self, flight: InFlight, reason, error: ErrorInfo) -> None:
        """End a request that never reached the engine."""
        out = EngineOutput(flight.request.request_id, 0, finish_reason=reason, error=error, received_ms=now_ms())
        await self.send_output(flight, out)

    def audit_event(self, flight: InFlight, out: EngineOutput) -> AuditEvent:
        req = flight.request
        runner = self._owner.get(req.request_id) or self.runners[0]
        if isinstance(req, GenerateRequest):
            temperature, top_p, top_k, max_tokens, seed = req.temperature, req.top_p, req.top_k, req.max_tokens, req.effective_seed
        else:  # an embedding samples nothing
            temperature, top_p, top_k, max_tokens, seed = 0.0, 1.0, 0, 0, 0
        return AuditEvent(
            event_id=f"{req.request_id}:{self.model_version}", request_id=req.request_id, model=req.model,
            model_version=self.model_version, weights_sha256=runner.weights_sha256,
            principal=req.principal, tenant=req.tenant,
            prompt_hmac=keyed_hmac(self.audit_key, out.prompt_text or ""),
            output_hmac=keyed_hmac(self.audit_key, out.output_text or ""), hmac_key_id=self.audit_key_id,
            temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
            seed=seed, prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            finish_reason=out.finish_reason, worker_id=self.worker_id, request_created_ms=req.created_ms,
            received_ms=out.received_ms or now_ms(), first_token_ms=out.first_token_ms,
            finished_ms=out.finished_ms or now_ms(),
            mean_token_entropy=out.mean_token_entropy, watermark_z=out.watermark_z,
        )  # fmt: skip

    async def settle(self, flight: InFlight) -> None:
        """Once every write of the run is durable, the request's batch offsets may be committed;
        a run with a write that failed is run again instead (its batch stays uncommitted)."""
        failure = await first_failure(flight.futures)
        failure = flight.failure or failure
        if failure is not None:
            self.redo_later(flight, failure)
            return
        self._forget(flight)

    def _forget(self, flight: InFlight) -> None:
        """The request is done here: mark its batch offsets done once every request of the batch is."""
        if self.in_flight.get(flight.request.request_id) is not flight:
            return
        self.in_flight.pop(flight.request.request_id, None)
        self._owner.pop(flight.request.request_id, None)
        self.num_done += 1
        for key in flight.offsets:
            left = self._batch_left.get(key)
            if left is None:
                continue
            if left <= 1:
                del self._batch_left[key]
                self.tracker.done(*key)
            else:
                self._batch_left[key] = left - 1

    async def commit(self) -> None:
        positions = self.tracker.committable()
        if not positions or self.consumer is None:
            return
        try:
            await self.consumer.commit(positions)
        except (CommitFailedError, KafkaError) as exc:
            log.warning("commit failed (%r); the batches will be redone by their new owner", exc)

    def forget_old_cancels(self) -> None:
        cutoff = now_ms() - _CANCEL_MEMORY_MS
        for rid in [r for r, t in self.recent_cancels.items() if t < cutoff]:
            del self.recent_cancels[rid]


class _Revoked(ConsumerRebalanceListener):
    """On losing partitions: commit what is durable, then forget them (their new owner redoes the rest)."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server

    async def on_partitions_revoked(self, revoked) -> None:
        await self.server.commit()
        self.server.tracker.forget(list(revoked))
        for key in [k for k in self.server._batch_left if k[0] in revoked]:
            del self.server._batch_left[key]

    async def on_partitions_assigned(self, assigned) -> None:
        log.info("assigned %s", sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))
        for partition in set(self.server.next_offsets) - {tp.partition for tp in assigned}:
            del self.server.next_offsets[partition]
        if self.server.on_assignment is not None:
            self.server.on_assignment()  # tell the batchers at once, not at the next heartbeat


async def open_cancellations(settings: BusSettings, worker_id: str) -> AIOKafkaConsumer:
    """A consumer of every partition of the control topic, positioned at the recent history.

    Called before the worker says it is ready, so no cancel published after that can be missed:
    the end offsets are read before the lookback is searched, and a partition with nothing recent
    starts at that end offset (not at a lazily resolved "latest", which would skip whatever was
    produced in between).
    """
    topics = settings.topics
    consumer = make_consumer(settings, client_id=worker_id, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        # Every partition: a Cancellation lands on the partition of its request_id's hash.
        parts = [TopicPartition(topics.control, p) for p in sorted(await partitions_of(consumer, topics.control))]
        consumer.assign(parts)
        ends = await consumer.end_offsets(parts)
        since = await consumer.offsets_for_times({tp: now_ms() - _CANCEL_MEMORY_MS for tp in parts})
        for tp in parts:
            found = since.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
    except BaseException:
        await consumer.stop()
        raise
    return consumer


async def consume_cancellations(
    consumer: AIOKafkaConsumer, settings: BusSettings, servers: list[ModelServer], producer, worker_id: str
) -> None:
    """Pass the cancels of the control topic (from open_cancellations) to the model servers."""
    topics = settings.topics
    try:
        async for record in consumer:
            try:
                cancel = decode(Cancellation, record.value)
            except DecodeError as exc:
                await send_dead_letter(producer, topics, record, str(exc), worker_id)
                continue
            for server in servers:
                server.on_cancel(cancel)
    finally:
        await consumer.stop()
