"""Traffic counts and the canary guard against the real broker (docs/design.md, "Traffic policies"):
the auditor publishes TrafficCounts on the compacted traffic topic, counting each event once and
from its ledger across restarts; a canary whose error rate passes the bound, or whose golden check
fails on Topics.model_health, is taken to 0% in the registry and the event recorded."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from schemas.codec import DecodeError, decode, encode
from schemas.registry import ModelHealthEvent, ModelManifest, ModelRoute, ModelVersionRecord
from schemas.topics import Topics
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from tests.waiting import until
from weir.bus import BusSettings
from weir.bus import read_topic as _read_topic
from weir.models.registry_cli import read_traffic
from weir.registry import publish, read_registry

from .factories import make_event
from .test_auditor_kafka import produce

pytestmark = pytest.mark.kafka


@pytest.fixture
def topics(audit_topics: Topics) -> Topics:
    """The audit topics with the registry's, model health's and traffic's (conftest.py)."""
    return audit_topics


def _version(version: str) -> ModelVersionRecord:
    manifest = ModelManifest(name="tiny", version=version, format="echo", location="", serving={"engine": "echo"})
    return ModelVersionRecord(manifest=manifest, desired="loaded")


async def _register(bootstrap: str, topics: Topics, canary: dict[str, float]) -> BusSettings:
    bus = BusSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix)
    await publish(
        bus,
        [
            _version("1"),
            _version("2"),
            _version("3"),
            ModelRoute(name="tiny", default_version="1", canary=canary, mirror={"3": 100.0}),
        ],
    )
    return bus


def _settings(bootstrap: str, topics: Topics, db: Path, **extra) -> AuditorSettings:
    return AuditorSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        audit_db=db,
        traffic_every_s=0.2,
        canary_min_requests=10,
        canary_max_error_rate=0.2,
        **extra,
    )


def _event(i: int, served_id: str, assignment: str, error: bool = False, **extra):
    return make_event(
        i,
        model="tiny",
        model_version=served_id,
        assignment=assignment,
        finish_reason="error" if error else "stop",
        **extra,
    )


async def _health_events(bus: BusSettings) -> list[ModelHealthEvent]:
    out = []
    for _key, value in await _read_topic(bus, bus.topics.model_health):
        with contextlib.suppress(DecodeError):
            out.append(decode(ModelHealthEvent, value))
    return out


async def test_counts_each_event_once_from_the_ledger_and_a_failing_canary_goes_to_zero(
    bootstrap: str, topics: Topics, tmp_path: Path
) -> None:
    bus = await _register(bootstrap, topics, canary={"2": 10.0})
    events = [_event(i, "tiny@2", "canary", error=i % 2 == 0) for i in range(10)]  # half of them err
    events += [_event(100 + i, "tiny@1", "default", error=True) for i in range(12)]  # the default is never stopped
    events += [_event(200 + i, "tiny@3", "mirror", shadow_of=f"req-{i}") for i in range(3)]
    messages = [(e.request_id.encode(), encode(e)) for e in events]
    messages.append((b"req-1", encode(events[1])))  # a redelivery: counted once
    await produce(bootstrap, topics.audit, messages)
    settings = _settings(bootstrap, topics, tmp_path / "audit.sqlite")

    expected = {"tiny@1": {"default": 12}, "tiny@2": {"canary": 10}, "tiny@3": {"mirror": 3}}

    async def counted(counts: dict) -> bool:
        traffic, skipped = await read_traffic(bus, "tiny")
        return skipped == 0 and traffic is not None and traffic.counts == counts

    async def canary_at_zero() -> bool:
        return (await read_registry(bus)).routes["tiny"].canary == {"2": 0.0}

    async with create_app(settings):
        await until(lambda: counted(expected), timeout_s=60, what="the traffic counts")
        await until(canary_at_zero, timeout_s=60, what="the failing canary at 0%")
    traffic, _ = await read_traffic(bus, "tiny")
    assert traffic.errors == {"tiny@1": 12, "tiny@2": 5}
    route = (await read_registry(bus)).routes["tiny"]
    assert (route.default_version, route.mirror) == ("1", {"3": 100.0})  # the rest of the policy stays
    assert "tiny@2 stopped: error rate 50% over its last 10 requests" in route.reason
    stopped = [e for e in await _health_events(bus) if e.event == "canary_stopped"]
    assert [e.model for e in stopped] == ["tiny@2"] and "50%" in stopped[0].detail

    # A restart counts on from its ledger: the earlier records are not lost, nor counted twice.
    await produce(bootstrap, topics.audit, [(b"req-300", encode(_event(300, "tiny@1", "pinned")))])
    async with create_app(settings):
        await until(
            lambda: counted({**expected, "tiny@1": {"default": 12, "pinned": 1}}),
            timeout_s=60,
            what="counts after restart",
        )


async def test_a_golden_failure_stops_the_canary_and_malformed_health_records_harm_nothing(
    bootstrap: str, topics: Topics, tmp_path: Path
) -> None:
    bus = await _register(bootstrap, topics, canary={"2": 5.0})
    failed = ModelHealthEvent(worker_id="worker-9", model="tiny@2", event="golden_failed", detail="token 2 differs")
    default_failed = failed.model_copy(update={"model": "tiny@1"})
    settings = _settings(bootstrap, topics, tmp_path / "audit.sqlite")

    async def stopped_or_sent_again() -> bool:
        if (await read_registry(bus)).routes["tiny"].canary == {"2": 0.0}:
            return True
        await produce(
            bootstrap,
            topics.model_health,
            [
                (b"x", b"not json"),
                (b"y", b'{"event": "golden_failed"}'),
                (b"tiny@1", encode(default_failed)),
                (b"tiny@2", encode(failed)),
            ],
        )
        return False

    async with create_app(settings):
        # The guard reads the health topic from its end once it joins: send (each second) until it has acted.
        await until(stopped_or_sent_again, timeout_s=60, interval_s=1.0, what="the failing canary stopped")
    state = await read_registry(bus)
    assert state.routes["tiny"].default_version == "1"  # a default's golden failure is the worker's rollback, not ours
    stopped = [e for e in await _health_events(bus) if e.event == "canary_stopped"]
    assert len(stopped) == 1 and stopped[0].model == "tiny@2"
    assert "golden check failed on worker-9: token 2 differs" in stopped[0].detail
