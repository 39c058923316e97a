"""Adaptive coalescing of reply deltas (services/worker/kafka/coalesce.py) and the Publisher that uses
it: one record per output while the producer keeps up, outputs merged while a record is in
flight, the end never before its deltas, and settling only once all is written. No broker: a
writer whose acknowledgements the test holds and releases."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka.errors import KafkaConnectionError

from schemas.codec import decode_reply
from schemas.messages import ReplyDelta, ReplyEnd, ToolCallDelta
from schemas.reply_stream import ReplyCursor
from services.worker.kafka.coalesce import ReplyLane
from services.worker.kafka.dispatch import Dispatch
from services.worker.kafka.intake import InFlight, Intake
from services.worker.kafka.publisher import Publisher

from .factories import make_model_config, make_output, make_request
from .positions import contiguous


class HeldWriter:
    """Records each produce; its acknowledgement waits until the test releases it (auto: at once)."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.records: list[tuple[str, bytes]] = []
        self.acks: list[asyncio.Future] = []

    async def send(self, topic: str, value: bytes, key: bytes, headers=None) -> asyncio.Future:
        self.records.append((topic, value))
        future = asyncio.get_running_loop().create_future()
        if self.auto:
            future.set_result(None)
        self.acks.append(future)
        return future

    def release(self, failure: BaseException | None = None) -> None:
        for future in self.acks:
            if not future.done():
                future.set_exception(failure) if failure is not None else future.set_result(None)

    def replies(self, topic: str) -> list[ReplyDelta | ReplyEnd]:
        return [decode_reply(value) for t, value in self.records if t == topic]


def delta(seq: int, text: str, calls: list[ToolCallDelta] | None = None) -> ReplyDelta:
    return ReplyDelta(request_id="r", seq=seq, text=text, token_ids=[100 + seq], tool_calls=calls)


def lane_of(writer: HeldWriter, broken: list[bool] | None = None) -> tuple[ReplyLane, list, set]:
    sent: list = []
    tasks: set = set()

    async def send(event):
        sent.append(event)
        return await writer.send("t", b"", b"r")

    def spawn(coro):
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        return task

    return ReplyLane(send, lambda future: None, lambda: bool(broken and broken[0]), spawn), sent, tasks


async def settle_loop() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_at_low_load_every_event_goes_out_at_once_one_record_each():
    writer = HeldWriter(auto=True)  # each record acknowledged before the next output
    lane, sent, _ = lane_of(writer)
    events = [delta(0, "a"), delta(1, "b"), delta(2, "c"), ReplyEnd(request_id="r", seq=3, finish_reason="stop")]
    for event in events:
        await lane.offer(event)
        assert sent[-1] is event  # handed to the producer within offer(): no latency added
    assert sent == events and lane.num_records == lane.num_events == 4
    await asyncio.wait_for(lane.drained(), 1)


async def test_while_a_record_is_in_flight_outputs_merge_into_one_delta_and_the_end_waits_behind_it():
    writer = HeldWriter()
    lane, sent, _ = lane_of(writer)
    await lane.offer(delta(0, "a"))
    for event in (delta(1, "b"), delta(2, "c"), delta(3, "d")):
        await lane.offer(event)
    await lane.offer(ReplyEnd(request_id="r", seq=4, finish_reason="stop"))
    assert [e.seq for e in sent] == [0] and lane.num_held == 2  # one merged delta, then the end
    drained = asyncio.ensure_future(lane.drained())
    await settle_loop()
    assert not drained.done()
    writer.release()  # the first record is acknowledged: what was held goes out, in order
    await settle_loop()
    assert [(e.type, e.seq) for e in sent] == [("delta", 0), ("delta", 1), ("end", 4)]
    merged = sent[1]
    assert (merged.count, merged.texts, merged.token_ids, merged.text) == (3, ["b", "c", "d"], [101, 102, 103], "bcd")
    assert contiguous(sent) and drained.done() and lane.num_records == 3 and lane.num_events == 5


async def test_outputs_arriving_while_held_ones_go_out_wait_for_the_next_round():
    writer = HeldWriter()
    lane, sent, _ = lane_of(writer)
    await lane.offer(delta(0, "a"))
    await lane.offer(delta(1, "b"))
    writer.release()
    await settle_loop()
    assert [e.seq for e in sent] == [0, 1]  # the held one went out; it is in flight now
    await lane.offer(delta(2, "c"))
    await lane.offer(delta(3, "d"))
    assert [e.seq for e in sent] == [0, 1]
    writer.release()
    await settle_loop()
    assert [(e.seq, e.count) for e in sent] == [(0, 1), (1, 1), (2, 2)]


async def test_tool_call_pieces_close_a_merged_delta():
    writer = HeldWriter()
    lane, sent, _ = lane_of(writer)
    call = [ToolCallDelta(index=0, id="call_r_0", name="f", arguments="{}")]
    await lane.offer(delta(0, "a"))
    for event in (delta(1, "b"), delta(2, "", call), delta(3, "c")):
        await lane.offer(event)
    writer.release()
    await settle_loop()
    assert [(e.seq, e.count, e.tool_calls) for e in sent] == [(0, 1, None), (1, 2, call), (3, 1, None)]


async def test_a_failed_write_drops_what_was_held_and_the_lane_drains():
    writer = HeldWriter()
    broken = [False]
    lane, sent, _ = lane_of(writer, broken)
    await lane.offer(delta(0, "a"))
    await lane.offer(delta(1, "b"))
    broken[0] = True  # the publisher saw the failure (its note) and broke the run
    writer.release(KafkaConnectionError("down"))
    await asyncio.wait_for(lane.drained(), 1)
    assert [e.seq for e in sent] == [0] and isinstance(writer.acks[0].exception(), KafkaConnectionError)
    await lane.offer(delta(2, "c"))
    assert [e.seq for e in sent] == [0]


def _publisher(writer: HeldWriter, intake: Intake) -> Publisher:
    config = make_model_config("tiny")
    return Publisher(config, writer, "weir.audit", intake, Dispatch(config, []), worker_id="w", audit_key=b"k" * 32)


def _outputs(rid: str) -> list:
    """A reply's engine outputs: one token each, the third's text released with the fourth's."""
    return [
        make_output(rid, 0, text="The", token_ids=[1]),
        make_output(rid, 1, text=" caf", token_ids=[2]),
        make_output(rid, 2, text="é is", token_ids=[3, 4]),
        make_output(rid, 4, text=" open", token_ids=[5]),
        make_output(
            rid,
            5,
            text=".",
            token_ids=[6],
            finish_reason="stop",
            prompt_tokens=2,
            completion_tokens=6,
            prompt_text="p",
            output_text="The café is open.",
        ),
    ]


async def _run(hold: bool) -> tuple[list, Intake, InFlight]:
    writer = HeldWriter(auto=not hold)
    intake = Intake()
    publisher = _publisher(writer, intake)
    request = make_request("p", model="tiny")
    flight = InFlight(request, "b1", host=SimpleNamespace(weights_sha256="0" * 64, cancel=lambda rid: None))
    intake.in_flight[request.request_id] = flight
    for out in _outputs(request.request_id):
        await publisher.send_output(flight, out)
    if hold:
        await settle_loop()
        assert request.request_id in intake.in_flight  # not settled: its end is held behind a record in flight
        writer.release()  # the first delta and the audit event are acknowledged: the held ones go out
        await settle_loop()
        assert [decode_reply(v).type for t, v in writer.records if t == request.reply_to][-1] == "end"
        assert request.request_id in intake.in_flight  # settled only once the end is durable too
    for _ in range(20):
        await asyncio.sleep(0)
        writer.release()
    return writer.replies(request.reply_to), intake, flight


async def test_the_publisher_coalesces_under_a_held_produce_and_the_reader_assembles_the_same_reply():
    quick, intake_a, _ = await _run(hold=False)
    held, intake_b, _ = await _run(hold=True)
    assert [(e.type, e.seq) for e in quick] == [
        ("delta", 0),
        ("delta", 1),
        ("delta", 2),
        ("delta", 4),
        ("delta", 5),
        ("end", 6),
    ]
    assert [(e.type, e.seq) for e in held] == [("delta", 0), ("delta", 1), ("end", 6)]
    assert held[1].count == 5 and held[1].texts == [" caf", "", "é is", " open", "."]
    assert contiguous(quick) and contiguous(held)
    for events in (quick, held, held[:2] + quick):  # a rerun after a crash, coalesced otherwise
        cursor, text = ReplyCursor(), ""
        for event in events:
            part = cursor.take(event)
            text += part.text if isinstance(part, ReplyDelta) else ""
        assert text == "The café is open." and cursor.missing == 0
    assert not intake_a.in_flight and not intake_b.in_flight  # both settled once everything was written


async def test_a_lane_of_a_run_redone_since_sends_nothing_more():
    writer = HeldWriter()
    intake = Intake()
    publisher = _publisher(writer, intake)
    request = make_request("p", model="tiny")
    flight = InFlight(request, "b1", host=SimpleNamespace(weights_sha256="0" * 64, cancel=lambda rid: None))
    intake.in_flight[request.request_id] = flight
    for out in _outputs(request.request_id)[:3]:
        await publisher.send_output(flight, out)
    old = flight.lane
    assert old is not None and old.num_held == 1 and len(writer.records) == 1
    flight.futures, flight.failure, flight.token_ids, flight.lane = (
        [],
        None,
        [],
        None,
    )  # what a redo does before its rerun
    writer.release()
    await asyncio.wait_for(old.drained(), 1)
    assert len(writer.records) == 1  # the stale run's held delta was dropped, not written beside the new run
