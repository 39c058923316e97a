"""The auditor's traffic counts and canary guard, one handler at a time (services/auditor/traffic.py).
The topics themselves are exercised against the real broker in test_traffic_kafka.py."""

from __future__ import annotations

import pytest

from schemas.codec import decode
from schemas.registry import ModelHealthEvent, ModelManifest, ModelRoute, ModelVersionRecord, RegistryState
from services.auditor.traffic import CanaryGuard, ErrorWindows, TrafficCounter, stop_canary

from .factories import make_event


def _version(version: str, desired: str = "loaded") -> ModelVersionRecord:
    manifest = ModelManifest(name="tiny", version=version, format="echo", location="", serving={"engine": "echo"})
    return ModelVersionRecord(manifest=manifest, desired=desired)


def _state(canary: dict[str, float], mirror: dict[str, float] | None = None) -> RegistryState:
    state = RegistryState()
    for record in (
        _version("1"),
        _version("2"),
        _version("3"),
        ModelRoute(name="tiny", default_version="1", canary=canary, mirror=mirror or {}),
    ):
        state.apply(record.key, record)
    return state


def _event(i: int, served_id: str = "tiny@2", assignment: str | None = "canary", error: bool = False, **extra):
    return make_event(
        i,
        model="tiny",
        model_version=served_id,
        assignment=assignment,
        finish_reason="error" if error else "stop",
        **extra,
    )


def test_counts_by_version_assignment_and_errors_start_from_the_ledger_rows():
    counter = TrafficCounter()
    counter.load([("tiny@1", "default", "stop", 7), ("tiny@1", "default", "error", 2), ("other@1", None, "stop", 1)])
    counter.observe(_event(1))
    counter.observe(_event(2, error=True))
    counter.observe(_event(3, served_id="tiny@1", assignment="pinned"))
    changed = {c.name: c for c in counter.take_changed()}
    assert set(changed) == {"tiny", "other"}
    assert changed["tiny"].counts == {"tiny@1": {"default": 9, "pinned": 1}, "tiny@2": {"canary": 2}}
    assert changed["tiny"].errors == {"tiny@1": 2, "tiny@2": 1}
    assert changed["other"].counts == {"other@1": {"unassigned": 1}} and changed["other"].errors == {}
    assert counter.take_changed() == []  # nothing new: nothing to publish
    counter.observe(_event(4, served_id="tiny@3", assignment="mirror", shadow_of="req-1"))
    assert [c.counts["tiny@3"] for c in counter.take_changed()] == [{"mirror": 1}]


def test_an_error_window_trips_only_when_full_and_past_the_bound():
    windows = ErrorWindows(size=10, max_error_rate=0.2)
    verdicts = [windows.observe(_event(i, error=i < 3)) for i in range(9)]
    assert verdicts == [None] * 9  # 3 errors, but fewer than 10 requests yet
    assert "30%" in windows.observe(_event(9))  # 3 of 10 > 20%
    windows.reset("tiny@2")
    assert [windows.observe(_event(i, error=i < 2)) for i in range(10)] == [None] * 10  # 2 of 10 is the bound


def test_a_request_that_timed_out_counts_as_an_error():
    """A canary that hangs until its requests' deadlines fails as surely as one that errs."""
    windows = ErrorWindows(size=2, max_error_rate=0.4)
    counter = TrafficCounter()
    for i in range(2):
        event = make_event(i, model="tiny", model_version="tiny@2", assignment="canary", finish_reason="timeout")
        verdict = windows.observe(event)
        counter.observe(event)
    assert verdict is not None and "100%" in verdict
    assert [c.errors for c in counter.take_changed()] == [{"tiny@2": 2}]


def test_mirror_copies_do_not_count_against_a_version():
    windows = ErrorWindows(size=2, max_error_rate=0.0)
    assert windows.observe(_event(1, assignment="mirror", shadow_of="req-0", error=True)) is None
    assert windows.observe(_event(2, assignment="mirror", shadow_of="req-0", error=True)) is None
    assert windows.windows == {}


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        ErrorWindows(size=0, max_error_rate=0.2)
    with pytest.raises(ValueError):
        ErrorWindows(size=5, max_error_rate=1.0)


def test_stop_canary_sets_only_that_canary_to_zero_and_keeps_the_rest():
    state = _state({"2": 5.0}, mirror={"3": 100.0})
    [route] = stop_canary(state, "tiny@2", "error rate 50%", by="auditor-x")
    assert isinstance(route, ModelRoute)
    assert (route.default_version, route.canary, route.mirror) == ("1", {"2": 0.0}, {"3": 100.0})
    assert "tiny@2 stopped: error rate 50%" in route.reason and "auditor-x" in route.reason
    assert stop_canary(state, "tiny@1", "x", by="a") == []  # the default is no canary
    assert stop_canary(state, "tiny@3", "x", by="a") == []  # a mirror is no canary
    state.apply(route.key, route)
    assert stop_canary(state, "tiny@2", "again", by="a") == []  # already at 0


class _Bus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []

    async def publish(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append((topic, key, value))


async def test_the_guard_stops_a_failing_canary_once_and_records_why():
    state = _state({"2": 10.0})
    bus = _Bus()
    guard = CanaryGuard(ErrorWindows(4, 0.2), lambda: state, bus.publish, "p.models", "p.health", by="auditor-1")
    for i in range(4):
        guard.observe(_event(i, error=i % 2 == 0))  # 2 of 4 err
        guard.observe(
            _event(100 + i, served_id="tiny@1", assignment="default", error=True)
        )  # the default: never stopped
    assert await guard.act() == 1
    assert [(t, k) for t, k, _ in bus.sent] == [("p.models", b"route:tiny"), ("p.health", b"tiny@2")]
    health = decode(ModelHealthEvent, bus.sent[1][2])
    assert (health.model, health.event, health.worker_id) == ("tiny@2", "canary_stopped", "auditor-1")
    assert "50%" in health.detail
    assert await guard.act() == 0


async def test_a_golden_failure_stops_a_canary_but_not_a_default_or_an_unknown_version():
    state = _state({"2": 10.0})
    bus = _Bus()
    guard = CanaryGuard(ErrorWindows(20, 0.2), lambda: state, bus.publish, "p.models", "p.health", by="auditor-1")
    guard.on_health(ModelHealthEvent(worker_id="w1", model="tiny@1", event="golden_failed", detail="bad"))
    guard.on_health(ModelHealthEvent(worker_id="w1", model="nope@9", event="golden_failed", detail="bad"))
    guard.on_health(ModelHealthEvent(worker_id="w1", model="tiny@2", event="golden_passed"))
    assert await guard.act() == 0 and bus.sent == []
    guard.on_health(ModelHealthEvent(worker_id="w1", model="tiny@2", event="golden_failed", detail="token 3 differs"))
    assert await guard.act() == 1
    assert "golden check failed on w1: token 3 differs" in decode(ModelHealthEvent, bus.sent[1][2]).detail


async def test_a_failed_publish_leaves_the_stop_due():
    state = _state({"2": 10.0})

    async def broken(topic: str, key: bytes, value: bytes) -> None:
        raise ConnectionError("broker away")

    guard = CanaryGuard(ErrorWindows(20, 0.2), lambda: state, broken, "p.models", "p.health", by="a")
    guard.on_health(ModelHealthEvent(worker_id="w1", model="tiny@2", event="golden_failed"))
    with pytest.raises(ConnectionError):
        await guard.act()
    assert "tiny@2" in guard.pending
