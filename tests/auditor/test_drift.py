"""Health of model versions against their baseline (services/auditor/drift.py): the baseline is the
first N outputs by finished_ms, the window the last M; a drift past its bound raises, a return
under clear_ratio of it clears, once per transition; nothing is judged before the baseline is
complete; freshness from the registry; the same baseline from the ledger after a restart."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas.codec import encode
from schemas.registry import ModelManifest, ModelVersionRecord, RegistryState
from schemas.telemetry import HealthAlert
from services.auditor.config import AuditorSettings
from services.auditor.drift import WINDOW_SIGNALS, Bound, HealthMonitor, HealthPolicy, Series, judge_drift
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger
from weir.metrics import value

from .factories import T0_MS, make_event

SID = "tiny@1"
DAY_MS = 86400 * 1000
POLICY = HealthPolicy(
    baseline_outputs=5,
    window_outputs=4,
    min_window_outputs=3,
    entropy=Bound(max_abs=None, max_rel=0.3),
    watermark=Bound(max_abs=2.0, max_rel=None),
    max_age_s=30 * 86400.0,
    clear_ratio=0.8,
)


def event(i: int, entropy: float | None = 2.0, z: float | None = None, served_id: str = SID, **extra):
    return make_event(
        i, model_version=served_id, mean_token_entropy=entropy, watermark_z=z, finished_ms=T0_MS + i * 1000, **extra
    )


def registry(*records: ModelVersionRecord) -> RegistryState:
    state = RegistryState()
    for record in records:
        state.apply(record.key, record)
    return state


def version(created_ms: int, desired: str = "loaded") -> ModelVersionRecord:
    manifest = ModelManifest(name="tiny", version="1", format="echo", location="", created_ms=created_ms)
    return ModelVersionRecord(manifest=manifest, desired=desired)


def monitor(state: RegistryState | None = None, policy: HealthPolicy = POLICY) -> HealthMonitor:
    held = state or RegistryState()
    return HealthMonitor(policy, lambda: held, by="auditor-t")


def publish(mon: HealthMonitor, now_ms: int) -> list[HealthAlert]:
    """What the app does at each tick: evaluate, publish (here: nothing), hold."""
    alerts = mon.evaluate(now_ms)
    for alert in alerts:
        mon.hold(alert)
    return alerts


def test_series_baseline_is_the_first_n_by_finish_time_whatever_the_arrival_order() -> None:
    points = [(T0_MS + i, f"ev-{i}", float(i)) for i in range(10)]
    shuffled = points[:]
    random.Random(3).shuffle(shuffled)
    series = Series(n=4, m=3)
    for point in [*shuffled, points[2]]:  # a repeat is held once
        series.add(point)
    assert series.first == points[:4] and series.baseline() == pytest.approx(1.5)
    assert series.last == points[-3:] and series.current(T0_MS + 100, 0) == (pytest.approx(8.0), 3)
    assert series.current(T0_MS + 10, window_s=0.0025) == (pytest.approx(8.5), 2)  # only those of the last 2.5 ms
    assert Series(n=4, m=3).baseline() is None


def test_judge_drift_absolute_relative_and_the_clear_ratio() -> None:
    bound = Bound(max_abs=1.0, max_rel=0.3)
    assert judge_drift(2.0, 1.5, bound, raised=False, clear_ratio=0.8)[0] is False  # 0.5 abs, 25% rel
    crossed, threshold, why = judge_drift(2.0, 1.3, bound, raised=False, clear_ratio=0.8)
    assert crossed and threshold == 0.3 and "relative drift 0.35" in why
    assert judge_drift(2.0, 0.9, bound, raised=False, clear_ratio=0.8)[:2] == (True, 1.0)  # absolute first
    assert judge_drift(2.0, 1.5, bound, raised=True, clear_ratio=0.8)[0] is True  # 25% > 0.8 * 30%: still raised
    assert judge_drift(2.0, 1.6, bound, raised=True, clear_ratio=0.8)[0] is False  # 20% < 24%: cleared
    assert judge_drift(0.0, 0.2, Bound(None, 0.3), raised=False, clear_ratio=1)[0] is False  # no relative drift of 0


def test_no_alert_before_the_baseline_is_complete() -> None:
    mon = monitor()
    for i, entropy in enumerate((2.0, 2.0, 0.1, 0.1)):  # a wild start, and a window of 4 >= min 3
        mon.observe(event(i, entropy=entropy))
    for i in range(4, 12):
        mon.observe(event(i, entropy=0.1, served_id="other@1"))  # another version's outputs are not this one's
    assert mon.drift(SID, "entropy", T0_MS).baseline is None
    assert publish(mon, T0_MS) == []  # 4 of 5 baseline outputs: nothing is judged
    assert [(a.model_version, a.state) for a in publish(monitor(), T0_MS)] == []
    for i in range(4, 8):
        mon.observe(event(i, entropy=0.1))  # baseline (2+2+0.1+0.1+0.1)/5 = 0.86; window 0.1: collapsed
    [raised] = publish(mon, T0_MS)
    assert (raised.signal, raised.state, raised.baseline) == ("entropy", "raised", pytest.approx(0.86))


def test_collapse_raises_once_and_recovery_clears() -> None:
    mon = monitor()
    for i in range(5):
        mon.observe(event(i, entropy=2.0, z=6.0))
    assert publish(mon, T0_MS) == [] and not mon.alerts
    for i in range(5, 9):
        mon.observe(event(i, entropy=0.2, z=6.5))  # entropy collapses; watermark within 2.0 of 6.0
    [raised] = publish(mon, T0_MS)
    assert (raised.model_version, raised.signal, raised.state) == (SID, "entropy", "raised")
    assert raised.baseline == pytest.approx(2.0) and raised.value == pytest.approx(0.2) and raised.threshold == 0.3
    assert "relative drift" in raised.detail and "auditor-t" in raised.detail
    assert publish(mon, T0_MS) == []  # once per transition
    for i in range(9, 13):
        mon.observe(event(i, entropy=1.9, z=3.0))  # entropy back; watermark z drops by 3
    alerts = publish(mon, T0_MS)
    assert {(a.signal, a.state) for a in alerts} == {("entropy", "cleared"), ("watermark", "raised")}
    cleared = next(a for a in alerts if a.signal == "entropy")
    assert cleared.threshold == raised.threshold and cleared.alert_id != raised.alert_id
    assert mon.drift(SID, "entropy", T0_MS).baseline == pytest.approx(2.0)  # the baseline never moves


def test_a_window_under_min_outputs_is_not_judged() -> None:
    mon = monitor()
    for i in range(5):
        mon.observe(event(i, entropy=2.0))
    # T seconds: only outputs of the last 2.5 s count; the five are older than that at T0 + 10 s
    timed = HealthPolicy(**{**POLICY.__dict__, "window_s": 2.5})
    mon.policy = timed
    mon.observe(event(8, entropy=0.1))
    mon.observe(event(9, entropy=0.1))
    assert mon.drift(SID, "entropy", T0_MS + 10_000).crossed is None  # two values in the window: not judged
    mon.observe(event(10, entropy=0.1))
    assert mon.drift(SID, "entropy", T0_MS + 10_000).crossed is True


def test_an_error_rate_past_its_bound_raises_and_clears_under_the_clear_ratio() -> None:
    mon = monitor()  # max_error_rate 0.2, window 4, at least 3
    mon.observe(event(0, finish_reason="error"))
    mon.observe(event(1))
    assert mon.error_rate(SID, T0_MS).crossed is None and publish(mon, T0_MS) == []  # 2 of at least 3
    mon.observe(event(2))
    [raised] = publish(mon, T0_MS)  # 1 of 3
    assert (raised.signal, raised.state, raised.value, raised.baseline, raised.threshold) == (
        "error_rate",
        "raised",
        pytest.approx(1 / 3),
        None,
        0.2,
    )
    for i in range(3, 6):
        mon.observe(event(i))  # the window: 1, 2 (stop), 3, 4, 5 -> last 4 without the error
    [cleared] = publish(mon, T0_MS)
    assert (cleared.signal, cleared.state, cleared.value) == ("error_rate", "cleared", 0.0)
    assert mon.error_rate("nobody@1", T0_MS).value is None


def test_freshness_raises_past_its_bound_and_clears_when_the_version_is_unloaded() -> None:
    now = T0_MS + 40 * DAY_MS
    state = registry(version(created_ms=T0_MS + 20 * DAY_MS))
    mon = monitor(state)
    assert publish(mon, now) == []  # 20 days old
    state.apply(version(T0_MS).key, version(created_ms=T0_MS))  # re-pushed record of 40 days ago
    [raised] = publish(mon, now)
    assert (raised.signal, raised.state, raised.threshold, raised.baseline) == (
        "freshness",
        "raised",
        30 * 86400.0,
        None,
    )
    assert raised.value == pytest.approx(40 * 86400.0)
    state.apply(version(T0_MS).key, version(created_ms=T0_MS, desired="unloaded"))
    [cleared] = publish(mon, now)
    assert (cleared.signal, cleared.state) == ("freshness", "cleared") and "no longer loaded" in cleared.detail


def test_state_comes_from_the_topic_so_a_restart_neither_repeats_nor_forgets() -> None:
    first = monitor()
    for i in range(5):
        first.observe(event(i, entropy=2.0))
    for i in range(5, 9):
        first.observe(event(i, entropy=0.2))
    [raised] = publish(first, T0_MS)

    again = monitor()  # a restart: the same events, and the health topic as it is
    for i in range(9):
        again.observe(event(i, entropy=0.2 if i >= 5 else 2.0))
    again.on_alert(b"x", b"not json")
    again.on_alert(b"x", b'{"alert_id": "a", "signal": "mood"}')
    again.on_alert(SID.encode(), encode(raised))
    assert again.num_skipped == 2
    assert publish(again, T0_MS) == []  # already raised: not again
    for i in range(9, 13):
        again.observe(event(i, entropy=2.0))
    [cleared] = publish(again, T0_MS)
    assert cleared.state == "cleared"
    # a second auditor that saw the same transition writes the same alert_id
    twin = monitor()
    for i in range(13):
        twin.observe(event(i, entropy=0.2 if 5 <= i < 9 else 2.0))
    twin.on_alert(SID.encode(), encode(raised))
    assert [a.alert_id for a in publish(twin, T0_MS)] == [cleared.alert_id]


def test_the_ledger_gives_the_same_baseline_and_window_after_a_restart(tmp_path: Path) -> None:
    events = [
        event(
            i,
            entropy=1.0 + i / 10,
            z=None if i % 4 == 0 else 4.0 + i,
            served_id=SID if i % 3 else "tiny@2",
            finish_reason="error" if i % 5 == 0 else "stop",
            structured_valid=(i % 7 != 0) if i % 2 else None,
        )
        for i in range(30)
    ]
    random.Random(5).shuffle(events)  # arrival order is not finish order
    live = monitor()
    with Ledger(tmp_path / "audit.sqlite", checkpoint_key=b"k" * 32) as ledger:
        for offset, e in enumerate(events):
            assert ledger.append(e, partition=offset % 2, offset=offset)
            live.observe(e)
        rows = ledger.drift_rows(POLICY.baseline_outputs, POLICY.window_outputs)
    restarted = monitor()
    restarted.load(rows)
    for key, series in live.series.items():
        assert restarted.series[key].first == series.first and restarted.series[key].last == series.last, key
    # every window signal but determinism (made again from Ledger.comparable_events: its own test)
    signals = set(WINDOW_SIGNALS) - {"determinism"}
    assert set(restarted.series) == set(live.series) == {(s, g) for s in (SID, "tiny@2") for g in signals}
    ordered = sorted((e for e in events if e.model_version == SID), key=lambda e: e.finished_ms)
    assert live.drift(SID, "entropy", T0_MS).baseline == pytest.approx(
        sum(e.mean_token_entropy for e in ordered[:5]) / 5
    )


def test_gauges_show_baseline_current_freshness_and_the_open_alert() -> None:
    metrics = HealthMetrics(clock=lambda: T0_MS + 40 * DAY_MS)
    mon = monitor(registry(version(created_ms=T0_MS)))
    metrics.monitor = mon
    for i in range(5):
        mon.observe(event(i, entropy=2.0, z=6.0))
    for i in range(5, 9):
        mon.observe(event(i, entropy=0.2, z=6.0))
    for alert in publish(mon, T0_MS + 40 * DAY_MS):
        metrics.published(alert)
    text = metrics.render()
    assert value(text, "weir_model_alert", model_name=SID, signal="entropy") == 1
    assert value(text, "weir_model_alert", model_name=SID, signal="freshness") == 1
    assert value(text, "weir_model_alert", model_name=SID, signal="watermark") is None  # never raised
    assert value(text, "weir_model_alerts_total", signal="entropy", state="raised") == 1
    assert value(text, "weir_model_output_entropy_nats", model_name=SID, window="baseline") == pytest.approx(2.0)
    assert value(text, "weir_model_output_entropy_nats", model_name=SID, window="current") == pytest.approx(0.2)
    assert value(text, "weir_model_watermark_z", model_name=SID, window="current") == pytest.approx(6.0)
    assert value(text, "weir_model_freshness_seconds", model_name=SID) == pytest.approx(40 * 86400.0)
    assert value(text, "weir_model_error_rate", model_name=SID) == 0


def test_settings_make_the_policy_and_one_that_cannot_work_is_refused() -> None:
    settings = AuditorSettings(
        health_entropy_max_rel="off", health_max_age_s="", health_watermark_max_abs=3, health_baseline_outputs=7
    )
    policy = HealthPolicy.from_settings(settings)
    assert (policy.entropy, policy.watermark, policy.max_age_s, policy.baseline_outputs) == (
        Bound(None, None),
        Bound(3.0, None),
        None,
        7,
    )
    with pytest.raises(ValidationError, match="MIN_WINDOW_OUTPUTS must not exceed"):
        AuditorSettings(health_window_outputs=5, health_min_window_outputs=6)
    with pytest.raises(ValueError, match="min_window_outputs"):
        HealthPolicy(window_outputs=5, min_window_outputs=6)
