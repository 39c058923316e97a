"""Health of each model version against its own baseline and its output SLA (docs/design.md,
"Observability"; "Structured output, tools and logprobs").

Per version (`name@version`, the version that served: a mirror copy's outputs are its own
version's health), two drift signals from the audit stream, output entropy (AuditEvent
.mean_token_entropy, nats) and watermark strength (AuditEvent.watermark_z); its error rate (the
share of the window's outputs whose finish_reason is "error", against a fixed bound: no baseline);
and from the registry, freshness (now - the manifest's created_ms: when the version was pushed).

A drift signal's baseline is the mean of the version's first `baseline_outputs` values by
finished_ms (then event_id): the outputs it gave once loaded. Its current value is the mean of its
last `window_outputs` values (only those finished within `window_s`, when set). Both are the
ledger's order, not arrival order, so the auditor computes the same baseline after a restart
(`HealthMonitor.load` starts from the ledger's rows) and a late record lands where it belongs. No
drift is judged before the baseline is complete and the window holds `min_window_outputs` values.

A signal whose drift (|current - baseline|, absolute or relative to the baseline) passes its bound
is raised; it is cleared when the drift is back under `clear_ratio` of that bound (no flapping
around the bound). Each transition is one HealthAlert on Topics.health. The state a transition is
judged from is the topic's latest alert per (version, signal), which the app follows from the
topic's beginning, so a restart neither repeats an alert nor forgets an open one. An alert_id
derives from the previous alert's, so two auditors that see the same transition write the same id.
A forged alert on the topic costs nothing lasting: a state it fakes differs from the judged one, so
the next tick publishes the truth again.

Two signals count outcomes rather than drift from a baseline (docs/design.md, "Structured output,
tools and logprobs": the output SLA is measured, not assumed). `structured`: of each constrained
output that ended stop, whether it was valid (AuditEvent.structured_valid, the worker's check).
`determinism`: of each comparison of equal requests served by two workers
(services/auditor/determinism.py), whether the outputs were the same. The SLA is every one: any bad
outcome in the window raises at once (threshold 1.0, the good share below which it is raised; not
a setting), and it clears once the window holds at least `min_window_outputs` outcomes, none bad
(so after `window_outputs` good ones in a row, or once the bad one is older than `window_s`). The
alert's value is the window's good share and its counts the outcomes behind it. The structured
outcomes come back from the ledger after a restart (Ledger.drift_rows); the comparisons are made
again from the ledger's last comparable events (Ledger.comparable_events).

One auditor replica is assumed, as for the traffic counts: with several, each would judge only
the outputs of its partitions of the audit topic.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from schemas.codec import DecodeError, decode
from schemas.messages import AuditEvent
from schemas.registry import RegistryState
from schemas.telemetry import HealthAlert, HealthSignal
from services.auditor.determinism import DeterminismProbe, Result

if TYPE_CHECKING:
    from services.auditor.config import AuditorSettings

log = logging.getLogger(__name__)

DriftSignal = Literal["entropy", "watermark"]
DRIFT_SIGNALS: tuple[DriftSignal, ...] = ("entropy", "watermark")
OutcomeSignal = Literal["structured", "determinism"]
# Each outcome signal's point values: 1.0 for the good outcome, 0.0 for the bad; named as counted.
OUTCOMES: dict[OutcomeSignal, tuple[str, str]] = {
    "structured": ("valid", "invalid"),
    "determinism": ("same", "differs"),
}
WindowSignal = Literal["entropy", "watermark", "error_rate", "structured", "determinism"]
WINDOW_SIGNALS: tuple[WindowSignal, ...] = (*DRIFT_SIGNALS, "error_rate", *OUTCOMES)
_FIELD: dict[DriftSignal, str] = {"entropy": "mean_token_entropy", "watermark": "watermark_z"}
ERROR = "error"  # the finish_reason counted by error_rate (as the canary guard's: services/auditor/traffic.py)
_TINY = 1e-9  # a baseline this close to 0 has no relative drift

Point = tuple[int, str, float]  # (finished_ms, event_id, value): the ledger's order


@dataclass(frozen=True)
class Bound:
    """How far a drift signal may move from its baseline: absolute (its unit) and relative (a
    share of |baseline|); None: that bound is not checked."""

    max_abs: float | None
    max_rel: float | None


@dataclass(frozen=True)
class HealthPolicy:
    """The thresholds and windows (services/auditor/config.py: WEIR_HEALTH_*)."""

    baseline_outputs: int = 50
    window_outputs: int = 50
    window_s: float = 0.0  # 0: the last window_outputs values, however old
    min_window_outputs: int = 10
    entropy: Bound = Bound(max_abs=None, max_rel=0.3)
    watermark: Bound = Bound(max_abs=2.0, max_rel=None)
    max_age_s: float | None = 30 * 86400.0
    max_error_rate: float | None = 0.2  # share of the window's outputs that ended in an error
    clear_ratio: float = 0.8
    determinism_keys: int = 10_000  # recent (version, prompt, params, seed) keys held for the comparison

    def __post_init__(self) -> None:
        if not 0 < self.min_window_outputs <= self.window_outputs:
            raise ValueError("min_window_outputs must be between 1 and window_outputs")
        if self.baseline_outputs < 1:
            raise ValueError("baseline_outputs must be at least 1")
        if not 0 < self.clear_ratio <= 1:
            raise ValueError("clear_ratio must be in (0, 1]")

    @classmethod
    def from_settings(cls, settings: AuditorSettings) -> HealthPolicy:
        return cls(
            baseline_outputs=settings.health_baseline_outputs,
            window_outputs=settings.health_window_outputs,
            window_s=settings.health_window_s,
            min_window_outputs=settings.health_min_window_outputs,
            entropy=Bound(settings.health_entropy_max_abs, settings.health_entropy_max_rel),
            watermark=Bound(settings.health_watermark_max_abs, settings.health_watermark_max_rel),
            max_age_s=settings.health_max_age_s,
            max_error_rate=settings.health_max_error_rate,
            clear_ratio=settings.health_clear_ratio,
            determinism_keys=settings.health_determinism_keys,
        )

    def bound(self, signal: DriftSignal) -> Bound:
        return self.entropy if signal == "entropy" else self.watermark


class Series:
    """One signal's values of one version: its first `n` and its last `m` points in ledger order."""

    def __init__(self, n: int, m: int) -> None:
        self.n, self.m = n, m
        self.first: list[Point] = []
        self.last: list[Point] = []

    def add(self, point: Point) -> None:
        """Take one point (a point already held, e.g. read from the ledger and then redelivered, once)."""
        _keep(self.first, point, self.n, drop_last=True)
        _keep(self.last, point, self.m, drop_last=False)

    def baseline(self) -> float | None:
        """Mean of the first n values; None until there are n."""
        return _mean(self.first) if len(self.first) == self.n else None

    def current(self, now_ms: int, window_s: float) -> tuple[float | None, int]:
        """(mean, count) of the last m values, those finished within window_s of now when window_s > 0."""
        points = self.window(now_ms, window_s)
        return (_mean(points) if points else None), len(points)

    def window(self, now_ms: int, window_s: float) -> list[Point]:
        """The last m points, those finished within window_s of now when window_s > 0."""
        return self.last if window_s <= 0 else [p for p in self.last if p[0] >= now_ms - window_s * 1000]


def _keep(points: list[Point], point: Point, limit: int, drop_last: bool) -> None:
    """Insert `point` into the sorted `points`, then drop from the end (drop_last) or the start down to `limit`."""
    i = bisect.bisect_left(points, point)
    if i < len(points) and points[i][:2] == point[:2]:
        return
    points.insert(i, point)
    if len(points) > limit:
        points.pop(-1 if drop_last else 0)


def _mean(points: list[Point]) -> float:
    return sum(p[2] for p in points) / len(points)


@dataclass(frozen=True)
class Reading:
    """One signal of one version now: value, baseline, and whether it is past its bound (None: not judged)."""

    value: float | None
    baseline: float | None
    crossed: bool | None
    threshold: float = 0.0
    detail: str = ""
    counts: dict[str, int] | None = None  # an outcome signal's counts behind `value`


def judge_drift(
    baseline: float, current: float, bound: Bound, raised: bool, clear_ratio: float
) -> tuple[bool, float, str]:
    """(past the bound, the bound, why) of `current` against `baseline`; a raised signal stays
    raised until its drift is under clear_ratio of the bound."""
    factor = clear_ratio if raised else 1.0
    delta = abs(current - baseline)
    checks = [("absolute", bound.max_abs, delta)]
    if abs(baseline) > _TINY:
        checks.append(("relative", bound.max_rel, delta / abs(baseline)))
    for kind, limit, drift in checks:
        if limit is not None and drift > limit * factor:
            return (
                True,
                limit,
                f"{kind} drift {drift:.3g} > {limit * factor:.3g} (current {current:.4g}, baseline {baseline:.4g})",
            )
    return False, _first_limit(bound), f"current {current:.4g}, baseline {baseline:.4g}: within bounds"


def _first_limit(bound: Bound) -> float:
    return bound.max_abs if bound.max_abs is not None else (bound.max_rel if bound.max_rel is not None else 0.0)


class HealthMonitor:
    """The drift and freshness of every version, and the alert state per (version, signal). Pure:
    time comes in as `now_ms`; `evaluate` returns the transitions for the app to publish."""

    def __init__(self, policy: HealthPolicy, registry: Callable[[], RegistryState], by: str = "auditor") -> None:
        self.policy = policy
        self.registry = registry
        self.by = by
        self.series: dict[tuple[str, WindowSignal], Series] = {}
        self.alerts: dict[tuple[str, HealthSignal], HealthAlert] = {}  # latest per (version, signal)
        self.num_skipped = 0  # records on the health topic that were no HealthAlert
        self.determinism = DeterminismProbe(policy.determinism_keys)

    # -- input -------------------------------------------------------------------------------

    def add(self, model_version: str, signal: WindowSignal, point: Point) -> None:
        key = (model_version, signal)
        if key not in self.series:
            self.series[key] = Series(self.policy.baseline_outputs, self.policy.window_outputs)
        self.series[key].add(point)

    def load(self, rows: Iterable[tuple[str, str, int, str, float]]) -> None:
        """Start from the ledger's (model_version, signal, finished_ms, event_id, value) rows
        (Ledger.drift_rows: each version's first and last values per signal)."""
        for model_version, signal, finished_ms, event_id, value in rows:
            if signal in WINDOW_SIGNALS:
                self.add(model_version, signal, (finished_ms, event_id, value))

    def observe(self, event: AuditEvent) -> Result | None:
        """One new audit event (mirror copies included: keyed by the version that served); its
        determinism comparison's result, if it made one (the app counts it)."""
        point = (event.finished_ms, event.event_id)
        for signal in DRIFT_SIGNALS:
            value = getattr(event, _FIELD[signal])
            if value is not None:
                self.add(event.model_version, signal, (*point, float(value)))
        self.add(event.model_version, "error_rate", (*point, float(event.finish_reason == ERROR)))
        if event.finish_reason == "stop" and event.structured_valid is not None:
            self.add(event.model_version, "structured", (*point, float(event.structured_valid)))
        return self.compare(event)

    def compare(self, event: AuditEvent) -> Result | None:
        """Feed `event` to the determinism comparison; its result joins the version's window.
        Also how the app replays the ledger's last comparable events at start."""
        result = self.determinism.observe(event)
        if result is not None:
            self.add(event.model_version, "determinism", (event.finished_ms, event.event_id, float(result == "same")))
        return result

    def on_alert(self, _key: bytes | None, value: bytes | None) -> None:
        """A record of the health topic (TopicFollower): the latest alert per (version, signal);
        anything else is skipped and counted (docs/design.md, invariant 6)."""
        try:
            alert = decode(HealthAlert, value or b"")
        except DecodeError as exc:
            self.num_skipped += 1
            log.warning("health topic record skipped: %s", exc)
            return
        self.hold(alert)

    def hold(self, alert: HealthAlert) -> None:
        """Take `alert` as the latest of its (version, signal) unless a newer one is held."""
        key = (alert.model_version, alert.signal)
        held = self.alerts.get(key)
        if held is None or alert.created_ms >= held.created_ms:
            self.alerts[key] = alert

    def is_raised(self, model_version: str, signal: HealthSignal) -> bool:
        alert = self.alerts.get((model_version, signal))
        return alert is not None and alert.state == "raised"

    # -- readings ----------------------------------------------------------------------------

    def drift(self, model_version: str, signal: DriftSignal, now_ms: int) -> Reading:
        series = self.series.get((model_version, signal))
        if series is None:
            return Reading(None, None, None)
        baseline = series.baseline()
        current, count = series.current(now_ms, self.policy.window_s)
        if baseline is None or current is None or count < self.policy.min_window_outputs:
            return Reading(current, baseline, None)
        bound = self.policy.bound(signal)
        crossed, threshold, detail = judge_drift(
            baseline, current, bound, self.is_raised(model_version, signal), self.policy.clear_ratio
        )
        return Reading(current, baseline, crossed, threshold, f"{signal} {detail}")

    def error_rate(self, model_version: str, now_ms: int) -> Reading:
        """The share of the window's outputs that ended in an error, against max_error_rate (no baseline)."""
        series = self.series.get((model_version, "error_rate"))
        if series is None:
            return Reading(None, None, None)
        current, count = series.current(now_ms, self.policy.window_s)
        limit = self.policy.max_error_rate
        if current is None or limit is None or count < self.policy.min_window_outputs:
            return Reading(current, None, None)
        bound = limit * (self.policy.clear_ratio if self.is_raised(model_version, "error_rate") else 1.0)
        return Reading(
            current,
            None,
            current > bound,
            limit,
            f"error rate {current:.1%} of the last {count} outputs (bound {bound:.1%})",
        )

    def outcome(self, model_version: str, signal: OutcomeSignal, now_ms: int) -> Reading:
        """The window's good share of an outcome signal: raised by any bad outcome, cleared by a
        window of at least min_window_outputs with none."""
        series = self.series.get((model_version, signal))
        points = [] if series is None else series.window(now_ms, self.policy.window_s)
        if not points:
            return Reading(None, None, None)
        good_name, bad_name = OUTCOMES[signal]
        good = sum(1 for p in points if p[2] > 0)
        bad = len(points) - good
        judged = bad > 0 or len(points) >= self.policy.min_window_outputs
        return Reading(
            good / len(points),
            None,
            (bad > 0) if judged else None,
            1.0,
            f"{signal}: {bad} {bad_name} of the last {len(points)} ({good} {good_name}); every one must be {good_name}",
            {good_name: good, bad_name: bad},
        )

    def freshness(self, model_version: str, now_ms: int) -> Reading:
        """Seconds since the version was pushed; judged only while it is wanted loaded."""
        record = self.registry().versions.get(model_version)
        if record is None:
            return Reading(None, None, None)
        age_s = max(0.0, (now_ms - record.manifest.created_ms) / 1000)
        limit = self.policy.max_age_s
        if record.desired != "loaded":
            return Reading(age_s, None, False, limit or 0.0, f"no longer loaded (desired {record.desired})")
        if limit is None:
            return Reading(age_s, None, None)
        return Reading(
            age_s, None, age_s > limit, limit, f"pushed {age_s / 86400:.1f} days ago (bound {limit / 86400:.1f} days)"
        )

    def versions(self) -> list[str]:
        """Every version with audit values or a registry record."""
        return sorted({served_id for served_id, _ in self.series} | set(self.registry().versions))

    # -- transitions -------------------------------------------------------------------------

    def evaluate(self, now_ms: int) -> list[HealthAlert]:
        """The alerts of every (version, signal) whose judged state differs from its latest alert.
        The app publishes each, then `hold`s it: until then the transition is due again."""
        out = []
        for served_id in self.versions():
            readings: list[tuple[HealthSignal, Reading]] = [("freshness", self.freshness(served_id, now_ms))]
            readings += [(signal, self.drift(served_id, signal, now_ms)) for signal in DRIFT_SIGNALS]
            readings.append(("error_rate", self.error_rate(served_id, now_ms)))
            readings += [(signal, self.outcome(served_id, signal, now_ms)) for signal in OUTCOMES]
            for signal, reading in readings:
                if (
                    reading.crossed is None
                    or reading.value is None
                    or reading.crossed == self.is_raised(served_id, signal)
                ):
                    continue
                if not reading.crossed and (served_id, signal) not in self.alerts:
                    continue  # nothing to clear
                out.append(self._alert(served_id, signal, reading, now_ms))
        return out

    def _alert(self, served_id: str, signal: HealthSignal, reading: Reading, now_ms: int) -> HealthAlert:
        state: Literal["raised", "cleared"] = "raised" if reading.crossed else "cleared"
        previous = self.alerts.get((served_id, signal))
        seed = "\x1f".join((served_id, signal, state, previous.alert_id if previous else ""))
        return HealthAlert(
            alert_id=hashlib.sha256(seed.encode()).hexdigest()[:32],
            model_version=served_id,
            signal=signal,
            state=state,
            value=reading.value,
            baseline=reading.baseline,
            threshold=previous.threshold if previous is not None and state == "cleared" else reading.threshold,
            detail=f"{reading.detail} [{self.by}]"[:1024],
            counts=reading.counts or {},
            created_ms=now_ms,
        )
