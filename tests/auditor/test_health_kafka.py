"""Health alerts against the real broker (docs/design.md, "Observability"): audit events of a
version with normal, then collapsed output entropy make the auditor publish a raised HealthAlert on
Topics.health and show weir_model_alert 1; a restart does not raise it again; recovery clears it; malformed
records on the health topic harm neither the auditor nor `weir models health`."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import orjson
import pytest

from schemas.codec import DecodeError, decode, encode
from schemas.registry import ModelManifest, ModelRoute, ModelVersionRecord
from schemas.telemetry import HealthAlert
from schemas.topics import Topics
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from services.auditor.health import HealthMetrics
from tests.waiting import stays_false, until
from weir import cli as weir_cli
from weir.bus import BusSettings, read_topic
from weir.metrics import value
from weir.registry import publish

from .factories import T0_MS, make_event
from .test_auditor_kafka import produce

pytestmark = pytest.mark.kafka

SID = "tiny@1"


def _event(i: int, entropy: float, served_id: str = SID, **extra):
    # tiny@2 is a mirror: its outputs are its own health, keyed by the version that served
    return make_event(
        i,
        model="tiny",
        model_version=served_id,
        mean_token_entropy=entropy,
        watermark_z=6.0,
        finished_ms=T0_MS + i * 1000,
        **extra,
    )


async def _alerts(bus: BusSettings) -> list[HealthAlert]:
    """Every HealthAlert on the health topic, in order (the malformed records left out)."""
    out = []
    for _key, record in await read_topic(bus, bus.topics.health):
        with contextlib.suppress(DecodeError):
            out.append(decode(HealthAlert, record))
    return out


# health_every_s=0.2 below: a restarted auditor judges every 0.2 s, so an alert it did not know to
# be open would be raised again at its first tick; ten ticks without one show it read the topic.
TEN_TICKS_S = 2.0


def _settings(bootstrap: str, topics: Topics, db: Path) -> AuditorSettings:
    return AuditorSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        audit_db=db,
        health_every_s=0.2,
        health_baseline_outputs=5,
        health_window_outputs=4,
        health_min_window_outputs=4,
        health_entropy_max_rel=0.3,
        canary_guard=False,
    )


async def test_a_collapse_raises_an_alert_recovery_clears_it_and_a_restart_repeats_nothing(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = audit_topics
    bus = BusSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix)
    manifest = ModelManifest(name="tiny", version="1", format="echo", location="", serving={"engine": "echo"})
    await publish(bus, [ModelVersionRecord(manifest=manifest), ModelRoute(name="tiny", default_version="1")])
    await produce(bootstrap, topics.health, [(b"x", b"not json"), (SID.encode(), b'{"signal": "entropy"}')])
    normal = [_event(i, 2.0) for i in range(5)]
    collapsed = [_event(i, 0.2) for i in range(5, 9)]
    mirror = [_event(100 + i, 0.2, served_id="tiny@2", shadow_of=f"req-{i}") for i in range(9)]  # low, but steady
    await produce(bootstrap, topics.audit, [(e.request_id.encode(), encode(e)) for e in [*normal, *collapsed, *mirror]])
    settings = _settings(bootstrap, topics, tmp_path / "audit.sqlite")
    health = HealthMetrics()

    async def raised() -> bool:
        return any(a.model_version == SID and a.state == "raised" for a in await _alerts(bus))

    async with create_app(settings, health):
        await until(raised, timeout_s=60, what="a raised entropy alert")
        text = health.render()
        assert value(text, "weir_model_alert", model_name=SID, signal="entropy") == 1
        assert value(text, "weir_model_alerts_total", signal="entropy", state="raised") == 1
        assert value(text, "weir_model_output_entropy_nats", model_name=SID, window="baseline") == pytest.approx(2.0)
        assert value(text, "weir_model_output_entropy_nats", model_name=SID, window="current") == pytest.approx(0.2)
        assert value(text, "weir_model_freshness_seconds", model_name=SID) is not None
        # the mirror version's outputs: its own baseline (0.2) and no drift from it
        assert value(text, "weir_model_output_entropy_nats", model_name="tiny@2", window="baseline") == pytest.approx(
            0.2
        )
        assert value(text, "weir_model_alert", model_name="tiny@2", signal="entropy") is None

    # A restart while raised: the same baseline from the ledger, the open alert from the topic, so
    # it is not raised again; recovery then clears it (which needs the alert it read).
    health = HealthMetrics()
    async with create_app(settings, health):
        assert value(health.render(), "weir_model_alert", model_name=SID, signal="entropy") == 1

        async def raised_again() -> bool:
            return [a.state for a in await _alerts(bus) if a.model_version == SID] != ["raised"]

        await stays_false(raised_again, for_s=TEN_TICKS_S, interval_s=0.5, what="the open alert raised again")
        await produce(
            bootstrap,
            topics.audit,
            [(e.request_id.encode(), encode(e)) for e in [_event(i, 1.9) for i in range(9, 13)]],
        )

        async def cleared() -> bool:
            return [a.state for a in await _alerts(bus) if a.model_version == SID] == ["raised", "cleared"]

        await until(cleared, timeout_s=60, what="the entropy alert cleared")
        assert value(health.render(), "weir_model_alert", model_name=SID, signal="entropy") == 0
        assert value(health.render(), "weir_model_alerts_total", signal="entropy", state="cleared") == 1

    [first, second] = [a for a in await _alerts(bus) if a.model_version == SID]
    assert (first.signal, first.baseline, first.value) == ("entropy", pytest.approx(2.0), pytest.approx(0.2))
    assert second.signal == "entropy" and second.threshold == first.threshold == 0.3
    assert second.baseline == pytest.approx(2.0) and second.value == pytest.approx(1.9)

    capsys.readouterr()
    argv = ["models", "health", "tiny", "--json", "--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
    assert await asyncio.to_thread(weir_cli.main, argv) == 0
    view = orjson.loads(capsys.readouterr().out)
    assert view["skipped"] == 2  # the malformed records
    [entry] = [v for v in view["versions"] if v["model_version"] == SID]
    assert entry["open_alerts"] == [] and entry["entropy"]["baseline"] == pytest.approx(2.0)
    assert entry["freshness_s"] is not None and entry["freshness_s"] >= 0
    argv.remove("--json")
    assert await asyncio.to_thread(weir_cli.main, argv) == 0  # as a table
    out = capsys.readouterr().out
    assert SID in out and "2 malformed health record(s) skipped" in out


async def test_an_invalid_structured_output_and_two_workers_that_differ_raise_their_alerts(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The output SLA through the broker (docs/design.md, "Structured output, tools and logprobs")."""
    topics = audit_topics
    bus = BusSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix)
    constrained = [_event(i, 2.0, structured_valid=i != 2) for i in range(4)]
    twins = [
        _event(
            10 + i,
            2.0,
            prompt_hmac="cd" * 32,
            params_sha256="ab" * 32,
            seed=7,
            worker_id=f"w{i}",
            output_hmac=("0" if i == 0 else "1") * 64,
        )
        for i in range(2)
    ]
    await produce(bootstrap, topics.audit, [(e.request_id.encode(), encode(e)) for e in [*constrained, *twins]])
    health = HealthMetrics()

    async def raised() -> bool:
        return {a.signal for a in await _alerts(bus) if a.state == "raised"} == {"structured", "determinism"}

    async with create_app(_settings(bootstrap, topics, tmp_path / "audit.sqlite"), health):
        await until(raised, timeout_s=60, what="raised structured and determinism alerts")
        text = health.render()
        assert value(text, "weir_determinism_checks_total", model_name=SID, result="differs") == 1
        assert value(text, "weir_model_structured_valid_rate", model_name=SID) == pytest.approx(0.75)
        assert value(text, "weir_model_alert", model_name=SID, signal="structured") == 1
        assert value(text, "weir_model_alert", model_name=SID, signal="determinism") == 1

    capsys.readouterr()
    argv = ["models", "health", "tiny", "--json", "--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
    assert await asyncio.to_thread(weir_cli.main, argv) == 0
    [entry] = orjson.loads(capsys.readouterr().out)["versions"]
    assert entry["open_alerts"] == ["structured", "determinism"]
    assert {k: entry["structured"][k] for k in ("rate", "valid", "invalid")} == {"rate": 0.75, "valid": 3, "invalid": 1}
    assert {k: entry["determinism"][k] for k in ("same", "differs")} == {"same": 0, "differs": 1}
    argv.remove("--json")
    assert await asyncio.to_thread(weir_cli.main, argv) == 0
    out = capsys.readouterr().out
    assert "75% (3/4)" in out and "0/1" in out
