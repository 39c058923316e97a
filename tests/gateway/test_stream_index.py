"""Streams that outlive their gateway, the pure parts: the StreamRecord a gateway writes, the
index every gateway keeps of weir.streams (forged and malformed records ignored, bounded, expired),
the owner check, and the reader's filter of another gateway's reply topic. No broker: the real one
is in test_streams_failover_kafka.py."""

from __future__ import annotations

import pytest

from schemas.codec import encode
from schemas.messages import GenerateRequest, ReplyDelta, ReplyEnd, StreamRecord, now_ms
from schemas.topics import Topics
from services.gateway.config import GatewaySettings
from services.gateway.guard.auth import Owner
from services.gateway.kafka_bus import Exchange, GatewayBus
from services.gateway.openai_format import ApiError, ChunkWriter
from services.gateway.replies import ReplyRouter
from services.gateway.resume import ResumableStreams
from services.gateway.stream_index import RemoteResumes, ReplyReader, StreamIndex, durable_record, record_problem
from weir.kafka import security

ANN = Owner("acme", "key", "ann")
SETTINGS = GatewaySettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="weir", max_indexed_streams=3)
TOPICS = SETTINGS.topics


def a_request(request_id: str = "cmpl-1", prompt: str = "a secret prompt") -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model="echo@1",
        prompt=prompt,
        deadline_ms=now_ms() + 60_000,
        reply_to=TOPICS.replies("gateway-a"),
        principal="ann",
        tenant="acme",
        stream=True,
    )


def a_record(request_id: str = "cmpl-1", **changes: object) -> StreamRecord:
    writer = ChunkWriter("completions", request_id, "echo", 1700000000, include_usage=True)
    record = durable_record(a_request(request_id), writer, ANN, 30, "gateway-a", TOPICS.replies("gateway-a"), 7)
    assert record is not None
    return record.model_copy(update=changes)


def test_a_record_holds_where_the_events_are_and_how_to_render_them_never_the_prompt() -> None:
    record = a_record()
    assert (record.request_id, record.member_ids, record.start_offset, record.grace_s) == ("cmpl-1", ["cmpl-1"], 7, 30)
    assert (record.owner_tenant, record.owner_credential, record.owner_principal) == ("acme", "key", "ann")
    assert record.render["pinned"] == "echo@1" and record.render["model"] == "echo"
    assert b"secret" not in encode(record)
    writer = ChunkWriter("completions", "cmpl-1", "echo", 0, include_usage=False)
    echo = ChunkWriter("completions", "cmpl-1", "echo", 0, include_usage=False, echo="a secret prompt")
    reply_topic = TOPICS.replies("gateway-a")
    assert (
        durable_record(a_request(), echo, ANN, 30, "gateway-a", reply_topic, 0) is None
    )  # its first chunk is the prompt
    assert durable_record(a_request(), writer, ANN, 0, "gateway-a", reply_topic, 0) is None  # not resumable
    assert durable_record(a_request(), writer, ANN, 30, "gateway-a", reply_topic, 0) is not None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"request_id": "cmpl-other"}, "key"),
        ({"reply_topic": TOPICS.keys}, "reply topics"),  # not a reply topic: a forged reader of the keys
        ({"member_ids": ["cmpl-1", "cmpl-victim"]}, "member_ids"),
        (
            {"reply_partition": 999},
            "one partition",
        ),  # a partition that is not there: a reader waiting for nothing  # events of a request it does not name
        ({"render": {"kind": "completions", "prompt": "x"}}, "render"),
    ],
)
def test_a_forged_record_is_refused_with_its_reason(changes: dict[str, object], reason: str) -> None:
    problem = record_problem(TOPICS, "cmpl-1", a_record(**changes))
    assert problem is not None and reason in problem
    assert record_problem(TOPICS, "cmpl-1", a_record()) is None


def test_the_index_ignores_bad_records_forgets_tombstones_and_expired_ones_and_stays_bounded() -> None:
    clock = [now_ms()]
    index = StreamIndex(SETTINGS, "test", clock=lambda: clock[0])
    index.on_record(b"cmpl-1", b"{not json", None)
    index.on_record(b"cmpl-1", encode(a_record(reply_topic=TOPICS.keys)), None)
    index.on_record(None, encode(a_record()), None)
    assert index.num_ignored == 3 and index.lookup("cmpl-1") is None
    index.on_record(b"cmpl-1", encode(a_record()), None)
    assert index.lookup("cmpl-1") == a_record()
    index.on_record(b"cmpl-1", None, None)
    assert index.lookup("cmpl-1") is None
    for i in range(5):
        index.on_record(f"cmpl-{i}".encode(), encode(a_record(f"cmpl-{i}")), None)
    assert len(index) == 3 and index.lookup("cmpl-0") is None and index.lookup("cmpl-4") is not None
    ended = a_record("cmpl-9", ended_ms=clock[0])
    index.on_record(b"cmpl-9", encode(ended), None)
    clock[0] += int(SETTINGS.resume_keep_s * 1000) + 1
    assert index.lookup("cmpl-9") is None and index.lookup("cmpl-4") is not None  # ended: kept for keep_s only


async def test_another_owner_gets_the_same_404_as_an_unknown_id() -> None:
    bus = GatewayBus(SETTINGS)
    index = StreamIndex(SETTINGS, "test")
    index.on_record(b"cmpl-1", encode(a_record()), None)
    remote = RemoteResumes(SETTINGS, bus, index, ResumableStreams(60, 10))
    answers = []
    for request_id, owner in (
        ("cmpl-1", Owner("acme", "jwt", "ann")),
        ("cmpl-1", Owner("other", "key", "ann")),
        ("cmpl-unknown", ANN),
    ):
        with pytest.raises(ApiError) as caught:
            await remote.attach(request_id, owner)
        answers.append((caught.value.status, caught.value.code))
    assert answers == [(404, "stream_not_found")] * 3 and remote.num_open == 0


def test_the_reader_renders_only_the_events_of_the_requests_its_record_names() -> None:
    router = ReplyRouter()
    queue = router.register("cmpl-1")
    reader = ReplyReader(SETTINGS, a_record(), router, "test")
    events = [
        ReplyDelta(request_id="cmpl-victim", seq=0, text="not yours"),
        ReplyDelta(request_id="cmpl-1", seq=0, text="a"),
        ReplyDelta(request_id="cmpl-1", seq=0, text="a"),
        ReplyDelta(request_id="cmpl-1", seq=1, text="b"),
    ]
    assert [reader.on_value(encode(e)) for e in events] == [False] * 4
    assert reader.on_value(b"garbage") is False
    assert reader.on_value(encode(ReplyEnd(request_id="cmpl-1", seq=2, finish_reason="stop"))) is True  # the end
    assert [queue.get_nowait().seq for _ in range(queue.qsize())] == [0, 1, 2]  # the repeat dropped


async def test_the_local_store_writes_the_end_and_the_tombstone_of_a_durable_stream() -> None:
    bus = GatewayBus(SETTINGS)
    written: list[tuple[str, StreamRecord | None]] = []
    streams = ResumableStreams(0, 10, journal=lambda rid, record: written.append((rid, record)))
    exchange = Exchange(bus, a_request(), bus.router.register("cmpl-1"))
    writer = ChunkWriter("completions", "cmpl-1", "echo", 0, include_usage=False)
    entry = streams.add(exchange, writer.fresh, 30, ANN, a_record())
    bus.router.on_event(ReplyEnd(request_id="cmpl-1", seq=0, finish_reason="stop"))
    entry.leave()  # the reader finished: the stream ended
    assert [(rid, r is not None and r.ended_ms is not None) for rid, r in written] == [("cmpl-1", True)]
    with pytest.raises(ApiError):
        streams.attach("cmpl-1", ANN)  # keep_s 0: it is pruned at the next look, and forgotten on Kafka
    assert written[-1] == ("cmpl-1", None) and len(written) == 2


def test_only_gateways_may_write_the_streams_topic() -> None:
    topics = Topics(prefix="weir")
    writers = {
        g.user
        for g in security.service_grants(topics)
        if "write" in g.operations
        and g.resource == "topic"
        and (g.name == topics.streams if g.pattern == "literal" else topics.streams.startswith(g.name))
    }
    assert writers == {"gateway"}


async def test_a_gateway_that_stops_leaves_its_durable_streams_running_and_cancels_the_others() -> None:
    bus = GatewayBus(SETTINGS)
    cancelled: list[tuple[str, str]] = []
    bus.publish_cancel = lambda rid, reason: cancelled.append((rid, reason))
    for request_id, is_durable in (("cmpl-1", True), ("cmpl-2", False)):
        exchange = Exchange(bus, a_request(request_id), bus.router.register(request_id))
        exchange.is_durable = is_durable
        bus._exchanges[request_id] = exchange
    await bus.stop()
    assert cancelled == [("cmpl-2", "shutdown")]  # cmpl-1's client resumes it through another gateway
