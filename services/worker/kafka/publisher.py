"""Writes each run of a request (its deltas, its end, its audit event) and settles it.

A run is settled once every write of it is durable: the request is then done (Intake.forget),
and its batch offset may be committed. A run with a write that failed (the broker away past the
producer's timeout, a reply topic that refuses the record) is stopped in the engine and run
again from seq 0 after a backoff (delivery.py), or given up on when that cannot help: a reply
topic that refuses writes (weir/reply_topics.py: TopicRefused) fails only the requests that
named it (docs/design.md, "Reply topics").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from schemas.codec import encode
from schemas.messages import DeadLetter, now_ms
from schemas.model_repo import ModelConfig
from services.worker.engine import EngineOutput
from services.worker.kafka.coalesce import ReplyLane
from services.worker.kafka.delivery import RedoPolicy, Writer, failure_of, first_failure, is_outage
from services.worker.kafka.dispatch import Dispatch
from services.worker.kafka.events import audit_event, model_version, reply_events, shadow_live
from services.worker.kafka.fingerprints import FingerprintBatcher
from services.worker.kafka.intake import InFlight, Intake
from services.worker.kafka.serving_metrics import Recorder
from services.worker.kafka.traces import end_run, reply_headers
from weir.tracing import Tracing, child_context, inject

log = logging.getLogger(__name__)


class Publisher:
    """One model server's writes: reply events to each request's reply topic, audit events to
    the audit topic (with SimHashes when a fingerprint batcher is given), and the live answer of
    each mirrored request to the shadow topic (ShadowLive, for the comparison). A run that could not
    be written goes through `dispatch` again, as the model server sent it the first time."""

    def __init__(
        self,
        config: ModelConfig,
        writer: Writer,
        audit_topic: str,
        intake: Intake,
        dispatch: Dispatch,
        *,
        worker_id: str,
        audit_key: bytes,
        fingerprints: FingerprintBatcher | None = None,
        redo_policy: RedoPolicy | None = None,
        shadow_live_topic: str | None = None,
        tracing: Tracing | None = None,
        recorder: Recorder | None = None,
        dead_letter_topic: str | None = None,
    ) -> None:
        self.config = config
        self.version = model_version(config)
        self.writer = writer
        self.audit_topic = audit_topic
        self.shadow_live_topic = shadow_live_topic  # None: mirrored requests' answers are not published
        # Where a request whose reply topic refuses writes goes, with the reason (None: logged only)
        self.dead_letter_topic = dead_letter_topic
        self.intake = intake
        self.dispatch = dispatch  # where a run that could not be written is run again
        self.worker_id = worker_id
        self.audit_key = audit_key
        self.fingerprints = fingerprints
        self.recorder = recorder  # the version's serving metrics (None: not recorded, as in unit tests)
        self.redo_policy = redo_policy or RedoPolicy()
        self._tasks: set[asyncio.Task] = set()  # settles and redos in flight (the loop keeps weak references)
        self.num_dropped = 0  # requests given up on: their reply topic refused writes, or far past their deadline
        self.tracing = tracing or Tracing.off("worker")

    async def send_output(self, flight: InFlight, out: EngineOutput) -> None:
        """Write the events of one engine output; on the final one, settle the run."""
        if flight.failure is not None:  # this run is broken: write nothing more of it
            if out.is_final:
                self.redo_later(flight, flight.failure)
            return
        req = flight.request
        if self.recorder is not None:  # a run with a write that failed is recorded when it is redone
            self.recorder.on_output(req, out)
        key = req.request_id.encode()
        if flight.lane is None:
            flight.lane = self._lane(flight)
        lane = flight.lane
        for event in reply_events(req, flight.batch_id, out, self.version):
            await lane.offer(event)
        if req.mirrors:
            flight.token_ids.extend(out.token_ids)
        if not out.is_final:
            return
        if out.prompt_text is not None:
            self._note(flight, await self.send_audit(flight, out, key))
        live = shadow_live(req, out, flight.token_ids, self.version)
        if live is not None and self.shadow_live_topic is not None:
            self._note(flight, await self.writer.send(self.shadow_live_topic, encode(live), key))
        end_run(self.tracing, flight.span, out, self.version)
        self._spawn(self.settle(flight, out))

    def _lane(self, flight: InFlight) -> ReplyLane:
        """The reply lane of the flight's current run: its deltas coalesced while one is in flight."""
        req = flight.request
        key = req.request_id.encode()

        async def send(event) -> asyncio.Future:
            return await self.writer.send(req.reply_to, encode(event), key, reply_headers(flight.span, event))

        def is_broken() -> bool:  # a failed write, or a run redone since (this lane's records are stale)
            return flight.failure is not None or flight.lane is not lane

        lane = ReplyLane(send, lambda future: self._note(flight, future), is_broken, self._spawn)
        return lane

    async def send_audit(self, flight: InFlight, out: EngineOutput, key: bytes) -> asyncio.Future:
        """Produce the request's AuditEvent; with a fingerprint batcher, once its SimHashes are in.

        Returns a future of the durable write, which settle() waits for before the batch offset
        may be committed (a crash before it redoes the request, and so the AuditEvent).
        """
        event = audit_event(
            flight.request,
            out,
            self.config,
            weights_sha256=self.dispatch.weights_sha256(flight),
            worker_id=self.worker_id,
            audit_key=self.audit_key,
            now_ms=now_ms(),
        )
        fingerprints = self.fingerprints
        headers = inject(child_context(flight.span))  # the auditor's append continues the request's trace
        if fingerprints is None:
            return await self.writer.send(self.audit_topic, encode(event), key, headers)

        async def fingerprint_then_send() -> object:
            fingerprinted = event
            try:
                prompt_sh, output_sh = await fingerprints.simhash(out.prompt_text or "", out.output_text or "")
                fingerprinted = event.model_copy(
                    update={
                        "prompt_simhash": prompt_sh,
                        "output_simhash": output_sh,
                        "fingerprint_model": fingerprints.model,
                    }
                )
            except Exception as exc:  # noqa: BLE001 - the HMACs still go out
                log.warning(
                    "fingerprinting %s failed (%r); its AuditEvent has no SimHash", flight.request.request_id, exc
                )
            return await (await self.writer.send(self.audit_topic, encode(fingerprinted), key, headers))

        return asyncio.get_running_loop().create_task(fingerprint_then_send())

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
        if flight.host is not None:
            flight.host.cancel(rid)  # its final output then comes to send_output, which redoes it

    async def settle(self, flight: InFlight, end: EngineOutput | None = None) -> None:
        """Once every write of the run is durable, the request's batch offsets may be committed
        (and its `end` counted, once per request); a run with a write that failed is run again
        instead (its batch stays uncommitted)."""
        if flight.lane is not None:
            await flight.lane.drained()  # the end and any deltas held behind a record in flight
        failure = await first_failure(flight.futures)
        failure = flight.failure or failure
        if failure is not None:
            self.redo_later(flight, failure)
            return
        if self.recorder is not None and end is not None:
            self.recorder.settled(flight.request, end)
        self.intake.forget(flight)

    def redo_later(self, flight: InFlight, failure: BaseException) -> None:
        """After a run that could not be written: run the request again from the start (readers
        drop the seqs they have), or give up on it when that cannot help."""
        req = flight.request
        delay_s = self.redo_policy.next_try_s(failure, flight.num_redos, req.deadline_ms, now_ms())
        if delay_s is None:
            why = "its deadline passed long ago" if is_outage(failure) else "its reply topic refuses it"
            log.error(
                "request %s cannot be answered on %s (%r; %s); giving up on it",
                req.request_id,
                req.reply_to,
                failure,
                why,
            )
            self.num_dropped += 1
            self._spawn(first_failure(flight.futures))  # collects its other writes' failures (no warnings)
            if is_outage(failure) or self.dead_letter_topic is None:
                self.intake.forget(flight)
            else:  # its batch offset is committed once its dead letter is durable
                self._spawn(
                    self._dead_letter(
                        flight, f"reply topic {req.reply_to} refuses writes ({failure!r}); no reply was written"
                    )
                )
            return
        log.info("request %s: running it again in %.1f s (redo %d)", req.request_id, delay_s, flight.num_redos + 1)
        flight.num_redos += 1

        async def redo() -> None:
            await asyncio.sleep(delay_s)
            if self.intake.is_current(flight):  # not ended meanwhile (a rebalance redo here)
                self._spawn(first_failure(flight.futures))  # collects the broken run's failures (no warnings)
                flight.futures, flight.failure, flight.token_ids, flight.lane = [], None, [], None
                await self._run_again(flight)

        self._spawn(redo())

    async def _dead_letter(self, flight: InFlight, reason: str) -> None:
        """The request to the dead-letter topic with `reason` (docs/kafka.md, "Secure mode": a reply to
        a missing topic is refused and its request dead-lettered), then done. A dead letter that cannot
        be written either is logged: the request is done all the same, as before dead letters."""
        req = flight.request
        (tp, offset) = flight.offsets[0] if flight.offsets else (None, -1)
        letter = DeadLetter(
            source_topic=tp.topic if tp is not None else "",
            partition=tp.partition if tp is not None else -1,
            offset=offset,
            key=req.request_id,
            value=encode(req).decode("utf-8", "replace"),
            reason=reason[:2000],
            service=self.worker_id,
        )
        assert self.dead_letter_topic is not None
        try:
            if (
                failure := await first_failure(
                    [await self.writer.send(self.dead_letter_topic, encode(letter), req.request_id.encode())]
                )
            ) is not None:
                raise failure
            log.warning("dead-lettered request %s: %s", req.request_id, reason)
        except Exception as exc:  # noqa: BLE001 - the request is given up on either way
            log.error("request %s: its dead letter could not be written either (%r)", req.request_id, exc)
        finally:
            self.intake.forget(flight)

    async def _run_again(self, flight: InFlight) -> None:
        """Run the request again from the start: on an engine, or ended here when it is refused now
        (cancelled, or its deadline passed meanwhile)."""
        refused = self.dispatch.run(flight, now_ms())
        if refused is not None:
            await self.send_output(flight, refused)

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
