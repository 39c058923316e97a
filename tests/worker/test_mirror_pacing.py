"""Mirror copies yield to live work (services/worker/hosts/mirror_pacing.py): the pacer's decisions
(pure, time as an argument), LivePressure's count and linger, and both through real engine loops
(EngineRunner threads over echo engines) in one event loop, as the worker wires them."""

from __future__ import annotations

import asyncio
import time

from services.worker.engine.echo_engine import EchoEngine
from services.worker.hosts.mirror_pacing import LivePressure, MirrorPacer, Pacing
from services.worker.hosts.runner import EngineRunner
from tests.waiting import until

from .factories import T0_MS, make_request
from .test_engine_process import Collector, echo_config, open_process

WORDS = " ".join(f"w{i}" for i in range(40))


def copy(rid: str = "live-1.mirror.2", **fields):
    return make_request(WORDS, request_id=rid, shadow_of="live-1", priority="bulk", assignment="mirror", **fields)


def test_an_engine_of_only_copies_yields_while_live_work_presses() -> None:
    pacer = MirrorPacer(Pacing(yield_ms=100, max_wait_ms=10_000))
    pacer.added(copy(), T0_MS)
    assert pacer.may_step(T0_MS) and pacer.wait_s(T0_MS) == 0  # no live work anywhere: step freely
    pacer.is_pressed = True
    assert pacer.is_yielding
    assert not pacer.may_step(T0_MS + 50)  # one step per 100 ms at most
    assert pacer.wait_s(T0_MS + 50) == 0.05
    assert pacer.may_step(T0_MS + 100) and not pacer.may_step(T0_MS + 150)
    pacer.is_pressed = False
    assert pacer.may_step(T0_MS + 151) and pacer.may_step(T0_MS + 152)


def test_an_engine_with_a_live_request_never_yields() -> None:
    pacer = MirrorPacer(Pacing(yield_ms=0))
    pacer.added(copy(), T0_MS)
    live = make_request(WORDS, request_id="live-9")
    pacer.added(live, T0_MS)
    pacer.is_pressed = True
    assert not pacer.is_yielding and pacer.may_step(T0_MS)
    engine = EchoEngine()
    engine.add(live, T0_MS)
    pacer.ended([engine.cancel("live-9", T0_MS)])  # the live request's terminal event
    assert pacer.is_yielding and not pacer.may_step(T0_MS + 10_000)  # yield_ms 0: no step at all


def test_an_engine_running_a_golden_check_never_yields() -> None:
    checking = [True]
    pacer = MirrorPacer(Pacing(yield_ms=0), lambda: checking[0])
    pacer.added(copy(), T0_MS)
    pacer.is_pressed = True
    assert not pacer.is_yielding and pacer.may_step(T0_MS)  # a check must answer within its timeout
    checking[0] = False
    assert pacer.is_yielding and not pacer.may_step(T0_MS + 1)


def test_a_copy_held_back_past_the_bound_ends_rejected_mirror_dropped() -> None:
    engine = EchoEngine()
    pacer = MirrorPacer(Pacing(yield_ms=0, max_wait_ms=1_000))
    held, fresh = copy("a.mirror.2"), copy("b.mirror.2")
    for request, at in ((held, T0_MS), (fresh, T0_MS + 600)):
        pacer.added(request, at)
        assert engine.add(request, at) is None
    assert pacer.drop_expired(engine, T0_MS + 5_000) == []  # not yielding: nothing is held back
    pacer.is_pressed = True
    assert pacer.wait_s(T0_MS + 400) == 0.6  # until the first copy's bound
    [dropped] = pacer.drop_expired(engine, T0_MS + 1_000)
    assert dropped.request_id == "a.mirror.2" and dropped.is_final
    assert dropped.finish_reason == "rejected" and dropped.error.code == "mirror_dropped"
    assert "WEIR_MIRROR_MAX_WAIT_MS" in dropped.error.message
    assert set(engine._active) == {"b.mirror.2"}  # ended in the engine too
    assert pacer.num_dropped == 1 and pacer.drop_expired(engine, T0_MS + 1_000) == []


class Sink:
    def __init__(self) -> None:
        self.told: list[bool] = []

    def press(self, is_pressed: bool) -> None:
        self.told.append(is_pressed)


# Under the 50 ms linger of the test below: a gap this short between two requests is not idleness.
WITHIN_THE_LINGER_S = 0.02


async def test_live_pressure_is_told_at_once_and_idle_only_after_the_linger() -> None:
    pressure, sink = LivePressure(idle_ms=50), Sink()
    pressure.attach(sink)
    pressure.started()
    pressure.started()
    assert sink.told == [True]
    pressure.ended()
    pressure.ended()
    assert sink.told == [True]  # not yet: a gap between requests is not idleness
    # What is tested is the linger itself (idle_ms=50, a timer of the event loop): the next request
    # comes within it, and after it nothing is told until a whole linger has passed without one.
    await asyncio.sleep(WITHIN_THE_LINGER_S)
    pressure.started()  # the next request came within the linger
    pressure.ended()
    await asyncio.sleep(WITHIN_THE_LINGER_S)
    assert sink.told == [True]
    await until(lambda: sink.told == [True, False], timeout_s=5, what="idle told once the linger passed")
    assert not pressure.is_pressed
    late = Sink()
    pressure.started()
    pressure.attach(late)  # an engine opened while live work runs hears it at once
    assert late.told == [True]


async def test_copies_wait_while_live_requests_run_and_complete_once_they_are_idle() -> None:
    loop = asyncio.get_running_loop()
    pressure = LivePressure(idle_ms=0)
    live_out, mirror_out = Collector(), Collector()
    live_host = EngineRunner(EchoEngine(step_delay_s=0.01), loop, live_out)
    mirror_host = EngineRunner(EchoEngine(), loop, mirror_out, pacing=Pacing(yield_ms=0, max_wait_ms=60_000))
    for host in (live_host, mirror_host):
        host.attach_pressure(pressure)
        host.start()
    try:
        live = make_request(WORDS, request_id="live-1", max_tokens=30)
        live_host.submit(live)
        assert pressure.is_pressed
        mirror_host.submit(copy(max_tokens=30))
        await live_out.until(lambda: len(live_out.outputs) >= 5, timeout_s=30, what="5 outputs of the live request")
        assert mirror_out.outputs == []  # held back: not one step while the live request runs
        await live_out.until(
            lambda: "live-1" in live_out.finals(), timeout_s=30, what="the live request's final output"
        )
        await mirror_out.until(
            lambda: "live-1.mirror.2" in mirror_out.finals(), timeout_s=5, what="the mirror copy's final output"
        )
        assert mirror_out.finals()["live-1.mirror.2"].finish_reason == "length"
        assert min(o.seq for o in mirror_out.outputs) == 0 and not pressure.is_pressed
    finally:
        live_host.stop()
        mirror_host.stop()


async def test_a_copy_held_too_long_in_a_worker_is_ended_dropped_and_counted() -> None:
    loop = asyncio.get_running_loop()
    pressure = LivePressure(idle_ms=0)
    live_out, mirror_out = Collector(), Collector()
    live_host = EngineRunner(EchoEngine(step_delay_s=0.02), loop, live_out)
    mirror_host = EngineRunner(EchoEngine(), loop, mirror_out, pacing=Pacing(yield_ms=0, max_wait_ms=200))
    for host in (live_host, mirror_host):
        host.attach_pressure(pressure)
        host.start()
    try:
        live_host.submit(make_request(WORDS, request_id="live-1", max_tokens=40))
        mirror_host.submit(copy(max_tokens=30))
        await mirror_out.until(
            lambda: "live-1.mirror.2" in mirror_out.finals(), timeout_s=5, what="the mirror copy's final output"
        )
        end = mirror_out.finals()["live-1.mirror.2"]
        assert (end.finish_reason, end.error.code) == ("rejected", "mirror_dropped")
        assert "live-1" not in live_out.finals()  # it was dropped while the live request still ran
        assert mirror_host.num_mirrors_dropped == 1 and mirror_host.num_pending == 0
    finally:
        live_host.stop()
        mirror_host.stop()
    assert pressure.num_live == 0  # a stopped engine's live requests no longer press


async def test_engine_processes_hear_the_pressure_and_pace_as_the_settings_say() -> None:
    """The worker's default hosts: each engine a spawned child, the pressure a command on its pipe,
    the pacing from WorkerSettings (WEIR_MIRROR_YIELD_MS, WEIR_MIRROR_MAX_WAIT_MS)."""
    pressure = LivePressure(idle_ms=0)
    live_out, mirror_out = Collector(), Collector()
    live_host = await open_process(echo_config(), live_out, echo_step_delay_ms=20)
    mirror_host = await open_process(echo_config(), mirror_out, mirror_yield_ms=300, mirror_max_wait_ms=60_000)
    for host in (live_host, mirror_host):
        host.attach_pressure(pressure)
    try:
        began = time.monotonic()
        live_host.submit(make_request(WORDS, request_id="live-1", max_tokens=40))
        mirror_host.submit(copy(max_tokens=30))
        await live_out.until(
            lambda: "live-1" in live_out.finals(), timeout_s=30, what="the live request's final output"
        )
        steps_meanwhile, live_s = len(mirror_out.outputs), time.monotonic() - began
        assert "live-1.mirror.2" not in mirror_out.finals()  # unpaced, its 31 steps take milliseconds
        assert 1 <= steps_meanwhile <= live_s / 0.3 + 2  # a step per 300 ms at most while the live one ran
        await mirror_out.until(
            lambda: "live-1.mirror.2" in mirror_out.finals(), timeout_s=10, what="the mirror copy's final output"
        )
        assert mirror_out.finals()["live-1.mirror.2"].finish_reason == "length"
    finally:
        live_host.stop()
        mirror_host.stop()
