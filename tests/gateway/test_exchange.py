"""Exchange: one request's events in order, ended at its deadline, cancelled when abandoned.

Uses a GatewayBus that was never started (no broker); publishes are recorded instead.
"""

from __future__ import annotations

from schemas.messages import GenerateRequest, ReplyDelta, ReplyEnd, now_ms
from services.gateway.config import GatewaySettings
from services.gateway.kafka_bus import Exchange, GatewayBus


def make_bus(**settings: float) -> tuple[GatewayBus, list[tuple[str, str]]]:
    bus = GatewayBus(GatewaySettings(kafka_bootstrap="127.0.0.1:1", **settings))
    published: list[tuple[str, str]] = []
    bus.publish_cancel = lambda rid, reason: published.append((rid, reason))
    return bus, published


def open_exchange(bus: GatewayBus, timeout_ms: int = 10_000) -> Exchange:
    request = GenerateRequest(
        request_id="r1", model="echo", prompt="hi", deadline_ms=now_ms() + timeout_ms, reply_to=bus.reply_topic
    )
    queue = bus.router.register("r1")
    exchange = Exchange(bus, request, queue)
    bus._exchanges["r1"] = exchange
    return exchange


async def test_events_come_in_order_and_a_finished_request_publishes_nothing() -> None:
    bus, published = make_bus()
    exchange = open_exchange(bus)
    for event in (
        ReplyDelta(request_id="r1", seq=1, text="b"),
        ReplyDelta(request_id="r1", seq=0, text="a"),
        ReplyEnd(request_id="r1", seq=2, finish_reason="stop"),
    ):
        bus.router.on_event(event)
    got = [await exchange.next_event() for _ in range(3)]
    assert [(e.type, e.seq) for e in got] == [("delta", 0), ("delta", 1), ("end", 2)]
    assert exchange.first_token_ms is not None and exchange.num_deltas == 2
    exchange.close("client_disconnect", status=200)
    assert published == [] and "r1" not in bus.router


async def test_deadline_gives_a_timeout_terminal_and_a_cancel() -> None:
    bus, published = make_bus(reply_grace_s=0.0)
    exchange = open_exchange(bus, timeout_ms=100)
    bus.router.on_event(ReplyDelta(request_id="r1", seq=0, text="a"))
    assert (await exchange.next_event()).type == "delta"
    end = await exchange.next_event()
    assert isinstance(end, ReplyEnd) and end.finish_reason == "timeout" and end.seq == 1
    assert published == [("r1", "deadline")]
    exchange.close("client_disconnect", status=504)
    assert published == [("r1", "deadline")]


async def test_a_gap_that_stays_open_is_skipped() -> None:
    bus, _ = make_bus(gap_timeout_s=0.1)
    exchange = open_exchange(bus)
    bus.router.on_event(ReplyDelta(request_id="r1", seq=0, text="a"))
    bus.router.on_event(ReplyDelta(request_id="r1", seq=2, text="c"))
    bus.router.on_event(ReplyEnd(request_id="r1", seq=3, finish_reason="stop"))
    got = [await exchange.next_event() for _ in range(3)]
    assert [e.seq for e in got] == [0, 2, 3]


async def test_abandoned_request_publishes_one_cancel() -> None:
    bus, published = make_bus()
    exchange = open_exchange(bus)
    exchange.close("client_disconnect", status=200)
    exchange.close("user", status=200)
    assert published == [("r1", "client_disconnect")]
