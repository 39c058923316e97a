"""Resumable streams: a reader that leaves and comes back gets the frames it missed, once.

Uses a GatewayBus that was never started (no broker); publishes are recorded instead.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from schemas.messages import GenerateRequest, ReplyDelta, ReplyEnd, now_ms
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import Owner
from services.gateway.guard.output_guard import PassThrough
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.openai_format import ApiError, ChunkWriter
from services.gateway.resume import ResumableStreams, StreamEntry, resume_grace_s
from services.gateway.streaming import frames, sse_events
from tests.waiting import stays_false, until


def make_bus() -> tuple[GatewayBus, list[tuple[str, str]]]:
    bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1"))
    published: list[tuple[str, str]] = []
    bus.publish_cancel = lambda rid, reason: published.append((rid, reason))
    return bus, published


ANN = Owner("acme", "key", "ann")
# The graces here are 0.05 s, timed by the event loop: three of them without a cancellation show the
# grace's timer found the ended stream and published none.
PAST_THE_GRACE_S = 0.15


def open_stream(
    bus: GatewayBus, streams: ResumableStreams, grace_s: float, owner: Owner = ANN, timeout_ms: int = 10_000
) -> StreamEntry:
    request = GenerateRequest(
        request_id="r1",
        model="echo",
        prompt="hi",
        deadline_ms=now_ms() + timeout_ms,
        reply_to=bus.reply_topic,
        principal=owner.principal,
        tenant=owner.tenant,
        stream=True,
    )
    exchange = Exchange(bus, request, bus.router.register("r1"))
    bus._exchanges["r1"] = exchange
    writer = ChunkWriter("completions", "r1", "echo", 0, include_usage=False)
    return streams.add(exchange, writer.fresh, grace_s, owner)


def send(bus: GatewayBus, *texts: str, end_seq: int | None = None) -> None:
    start = bus.router.next_seq("r1")
    for i, text in enumerate(texts):
        bus.router.on_event(ReplyDelta(request_id="r1", seq=start + i, text=text))
    if end_seq is not None:
        bus.router.on_event(ReplyEnd(request_id="r1", seq=end_seq, finish_reason="stop"))


async def read_texts(entry: StreamEntry, count: int) -> list[tuple[int, str]]:
    got: list[tuple[int, str]] = []
    async for seq, frame in frames(entry.exchange, entry.new_writer(), PassThrough()):
        assert not isinstance(frame, ApiError)
        got.append((seq, frame["choices"][0]["text"]))
        if len(got) == count:
            break
    return got


async def test_a_reader_that_comes_back_within_the_grace_gets_the_rest_and_nothing_is_cancelled() -> None:
    bus, published = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=5)
    send(bus, "a", "b")
    assert await read_texts(entry, 2) == [(0, "a"), (1, "b")]
    entry.leave()  # the connection dropped
    send(bus, "c", "d", end_seq=4)  # generation goes on meanwhile
    await asyncio.sleep(0)
    again = streams.attach("r1", ANN)
    raw = b"".join(
        [chunk async for chunk in sse_events(again.exchange, again.new_writer(), PassThrough(), after_seq=1)]
    )
    again.leave()
    events = [block.split("\n") for block in raw.decode().strip().split("\n\n")]
    assert [e[0] for e in events] == ["id: 2", "id: 3", "id: 4", "id: 4"]
    assert '"text":"c"' in events[0][1] and '"text":"d"' in events[1][1] and events[-1][1] == "data: [DONE]"
    assert published == [] and entry.exchange.is_closed
    assert streams.attach("r1", ANN).exchange.end is not None  # kept a while after its end


async def test_nobody_coming_back_cancels_after_the_grace() -> None:
    bus, published = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=0.05)
    send(bus, "a")
    await read_texts(entry, 1)
    entry.leave()
    assert published == []
    await until(lambda: published, timeout_s=5, what="the cancellation once the grace is over")
    assert published == [("r1", "client_disconnect")]
    with pytest.raises(ApiError) as gone:
        streams.attach("r1", ANN)
    assert gone.value.status == 404 and gone.value.code == "stream_not_found"


async def test_without_a_grace_a_leaving_reader_cancels_at_once_and_cannot_resume() -> None:
    bus, published = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=0)
    entry.leave()
    assert published == [("r1", "client_disconnect")]
    with pytest.raises(ApiError) as gone:
        streams.attach("r1", ANN)
    assert gone.value.status == 404


async def test_a_stream_that_ended_while_nobody_read_it_closes_without_a_cancel() -> None:
    bus, published = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=0.05)
    entry.leave()
    send(bus, "a", end_seq=1)
    await until(lambda: entry.exchange.is_closed, timeout_s=5, what="the stream closed at its end")
    await stays_false(lambda: published, for_s=PAST_THE_GRACE_S, what="a cancellation of the ended stream")
    again = streams.attach("r1", ANN)
    assert await read_texts(again, 1) == [(0, "a")]


@pytest.mark.parametrize(
    "intruder",
    [
        Owner("acme", "key", "bob"),  # another principal of the same tenant
        Owner("globex", "key", "ann"),  # the same principal's name in another tenant
        Owner("acme", "jwt", "ann"),  # a JWT whose subject is the key's principal
        Owner("globex", "jwt", "ann"),  # ... of another tenant (the case)
        Owner("acme", "open", "ann"),
    ],
)
async def test_only_the_owner_resumes_and_anyone_else_gets_the_404_of_an_unknown_stream(intruder: Owner) -> None:
    bus, _ = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=5, owner=ANN)
    entry.leave()
    with pytest.raises(ApiError) as refused:
        streams.attach("r1", intruder)
    with pytest.raises(ApiError) as unknown:
        streams.attach("r2", intruder)
    assert (refused.value.status, refused.value.code) == (404, "stream_not_found")
    assert refused.value.message.replace("r1", "r2") == unknown.value.message  # nothing tells that r1 exists
    assert entry.num_readers == 0  # the refused reader was not counted
    streams.attach("r1", ANN).cancel("user")


async def test_an_explicit_cancel_ends_it_for_good() -> None:
    bus, published = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=5)
    entry.cancel("user")
    assert published == [("r1", "user")]
    with pytest.raises(ApiError):
        streams.attach("r1", ANN)


async def test_past_max_streams_the_oldest_unread_one_is_dropped_and_cancelled() -> None:
    bus, published = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=1)
    first = open_stream(bus, streams, grace_s=5)
    first.leave()
    request = GenerateRequest(
        request_id="r2", model="echo", prompt="hi", deadline_ms=now_ms() + 10_000, reply_to=bus.reply_topic, stream=True
    )
    second = Exchange(bus, request, bus.router.register("r2"))
    streams.add(second, ChunkWriter("completions", "r2", "echo", 0, include_usage=False).fresh, 5, ANN)
    assert published == [("r1", "client_disconnect")] and len(streams) == 1


def test_the_grace_header_is_checked() -> None:
    assert resume_grace_s({}, 0.0, 300) == 0.0
    assert resume_grace_s({"x-weir-resume-grace-s": "30"}, 0.0, 300) == 30.0
    for bad in ("-1", "301", "soon", "nan"):
        with pytest.raises(ApiError) as refused:
            resume_grace_s({"x-weir-resume-grace-s": bad}, 0.0, 300)
        assert refused.value.param == "X-Weir-Resume-Grace-S"


async def test_a_cancelled_reader_loses_no_event() -> None:
    bus, _ = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=5)
    waiting = asyncio.ensure_future(entry.exchange.next_event())
    await asyncio.sleep(0)
    send(bus, "a")
    await asyncio.sleep(0)
    waiting.cancel()  # the reader's connection went away just as the event arrived
    await asyncio.gather(waiting, return_exceptions=True)
    assert await read_texts(entry, 1) == [(0, "a")]


def coalesced(seq: int, *texts: str) -> ReplyDelta:
    """A delta of positions [seq, seq + len(texts)), one token each."""
    many = len(texts) > 1
    return ReplyDelta(
        request_id="r1",
        seq=seq,
        count=len(texts),
        text="".join(texts),
        texts=list(texts) if many else None,
        token_ids=list(range(seq, seq + len(texts))),
    )


# The reply topic's records of one request: a first run coalesced [0,2) [2,5) and died; its rerun
# (same tokens) coalesced [0,1) [1,4) [4,6) [6,7) and ended at 7.
WORDS = ["a", "b", "c", "d", "e", "f", "g"]
RECORDS = [
    coalesced(0, "a", "b"),
    coalesced(2, "c", "d", "e"),
    coalesced(0, "a"),
    coalesced(1, "b", "c", "d"),
    coalesced(4, "e", "f"),
    coalesced(6, "g"),
    ReplyEnd(request_id="r1", seq=7, finish_reason="stop"),
]


def sse_blocks(raw: bytes) -> list[tuple[str, str]]:
    blocks = [block.split("\n") for block in raw.decode().strip().split("\n\n")]
    return [(b[0], b[1]) for b in blocks]


async def test_coalesced_deltas_of_two_runs_resume_from_the_position_the_client_saw_on_any_gateway() -> None:
    bus, _ = make_bus()
    streams = ResumableStreams(keep_s=60, max_streams=10)
    entry = open_stream(bus, streams, grace_s=5)
    for record in RECORDS[:2]:
        bus.router.on_event(record)
    assert await read_texts(entry, 2) == [(0, "ab"), (2, "cde")]  # ids: the position of each delta's first token
    entry.leave()
    for record in RECORDS[2:]:
        bus.router.on_event(record)
    await asyncio.sleep(0)
    again = streams.attach("r1", ANN)
    raw = b"".join(
        [chunk async for chunk in sse_events(again.exchange, again.new_writer(), PassThrough(), after_seq=2)]
    )
    again.leave()
    rest = sse_blocks(raw)
    assert [i for i, _ in rest] == [
        "id: 5",
        "id: 6",
        "id: 7",
        "id: 7",
    ]  # the rerun's positions 5 and 6, cut out of [4,6)
    assert '"text":"f"' in rest[0][1] and '"text":"g"' in rest[1][1]
    # another gateway reads the same records with a router of its own (stream_index.py): the same ids
    other, _ = make_bus()
    elsewhere = open_stream(other, ResumableStreams(keep_s=60, max_streams=10), grace_s=5)
    for record in RECORDS:
        other.router.on_event(record)
    raw = b"".join(
        [c async for c in sse_events(elsewhere.exchange, elsewhere.new_writer(), PassThrough(), after_seq=2)]
    )
    elsewhere.leave()
    assert sse_blocks(raw) == rest
    everything = b"".join([c async for c in sse_events(elsewhere.exchange, elsewhere.new_writer(), PassThrough())])
    texts = [orjson.loads(d[6:])["choices"][0]["text"] for _, d in sse_blocks(everything) if d != "data: [DONE]"]
    assert "".join(texts) == "".join(WORDS)  # each position once
