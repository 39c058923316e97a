"""The auditor's /metrics: OpenTelemetry instruments (weir/metrics.py), exported by OpenTelemetry's
Prometheus exporter (docs/design.md, "Observability"; no exposition text written here).

Counted from the audit stream: requests by model, tenant and finish reason, generated tokens, and
the distribution of output entropy (the workers' per-request mean token entropy) and watermark
strength (z-score of watermarked outputs) per model, over the records this auditor appended since
it started (a redelivered event or flag counts once); the review flags raised by the gateways'
input guards, by tenant and reason; the shadow comparison's join outcomes.

Read at scrape time from the health monitor (services/auditor/drift.py), per model version
(label `model_name`, the served name@version, as vLLM's): its freshness, its output entropy and
watermark z for the baseline and the current window, its window's error rate, 1 per signal while
an alert is raised (0 once cleared); and the alerts this auditor published, by signal and state.
The output SLA (docs/design.md, "Structured output, tools and logprobs"): the valid share of a
version's window of constrained outputs that ended stop, and the determinism comparisons this
auditor made since it started, by version and result (same, differs: services/auditor/determinism.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from schemas.messages import AuditEvent, ReviewFlag, now_ms
from schemas.telemetry import HealthAlert
from services.auditor.determinism import Result
from services.auditor.drift import DriftSignal, HealthMonitor
from weir.metrics import Labels, ServiceMetrics, TenantLabels

ENTROPY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)  # nats
# No negative bound: prometheus_client drops a histogram's _sum and _count when its first bound is < 0.
WATERMARK_Z_BUCKETS = (0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0)


class HealthMetrics:
    """The auditor's instruments; `observe` each new record, `render` for Prometheus."""

    def __init__(self, clock: Callable[[], int] = now_ms) -> None:
        self.service = ServiceMetrics("auditor")
        self.clock = clock
        self.shadow_join: dict[str, int] = {}  # the comparison's ShadowJoin.counts (outcome -> count)
        self.monitor: HealthMonitor | None = None  # the app's, read at scrape time (None: health alerts off)
        self.tenants = TenantLabels()  # tenant labels bounded: the top 50 by records, the rest "other"
        service = self.service
        self.events = service.counter("weir_audit_events", "Audit events appended by this auditor since it started.")
        self.requests = service.counter("weir_audit_requests", "Audited requests by model, tenant and finish reason.")
        self.completion_tokens = service.counter("weir_audit_completion_tokens", "Generated tokens by model.")
        self.review_flags = service.counter(
            "weir_audit_review_flags", "Principals flagged for review, by tenant and reason."
        )
        self.entropy = service.histogram(
            "weir_audit_output_entropy_nats",
            "Mean per-request token entropy of outputs (nats), by model.",
            ENTROPY_BUCKETS,
        )
        self.watermark_z = service.histogram(
            "weir_audit_watermark_z", "Watermark z-score of watermarked outputs, by model.", WATERMARK_Z_BUCKETS
        )
        self.alerts = service.counter("weir_model_alerts", "HealthAlerts this auditor published, by signal and state.")
        self.determinism = service.counter(
            "weir_determinism_checks",
            "Outputs of equal version, prompt, parameters and "
            "seed from two workers compared, by result (same, differs).",
        )
        service.meter.create_observable_counter(
            "weir_audit_shadow_join",
            callbacks=[self._observe_join],
            description="Shadow comparison join: pairs joined, halves expired unmatched or evicted, deltas after their end.",
        )
        service.gauge("weir_model_freshness_seconds", "Seconds since a registered version was pushed.", self._freshness)
        service.gauge(
            "weir_model_output_entropy_nats",
            "Mean output entropy of a version (nats): its baseline (first outputs) and its current window.",
            self._drift("entropy"),
        )
        service.gauge(
            "weir_model_watermark_z",
            "Mean watermark z of a version: its baseline and its current window.",
            self._drift("watermark"),
        )
        service.gauge(
            "weir_model_error_rate", "Share of a version's current window that ended in an error.", self._error_rate
        )
        service.gauge(
            "weir_model_alert", "1 while a version's health signal is raised, 0 once cleared.", self._alert_states
        )
        service.gauge(
            "weir_model_structured_valid_rate",
            "Share of a version's window of constrained outputs that ended stop which were valid.",
            self._structured,
        )

    def observe(self, event: AuditEvent) -> None:
        """Count one appended AuditEvent (called by the auditor's handler on the event loop)."""
        model = {"model": event.model_version}
        self.events.add(1)
        self.tenants.count(event.tenant)
        self.requests.add(1, {**model, "tenant": self.tenants.of(event.tenant), "finish_reason": event.finish_reason})
        self.completion_tokens.add(event.completion_tokens, model)
        if event.mean_token_entropy is not None:
            self.entropy.record(event.mean_token_entropy, model)
        if event.watermark_z is not None:
            self.watermark_z.record(event.watermark_z, model)

    def observe_flag(self, flag: ReviewFlag) -> None:
        """Count one appended ReviewFlag (called by the auditor's handler on the event loop)."""
        self.tenants.count(flag.tenant)
        self.review_flags.add(1, {"tenant": self.tenants.of(flag.tenant), "reason": flag.reason})

    def compared(self, model_version: str, result: Result) -> None:
        """Count one determinism comparison of the health monitor's."""
        self.determinism.add(1, {"model_name": model_version, "result": result})

    def published(self, alert: HealthAlert) -> None:
        """Count one HealthAlert this auditor published."""
        self.alerts.add(1, {"signal": alert.signal, "state": alert.state})

    def render(self) -> str:
        """The Prometheus text exposition of every instrument."""
        return self.service.render()

    def shutdown(self) -> None:
        self.service.shutdown()

    def _observe_join(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"outcome": outcome}) for outcome, n in sorted(self.shadow_join.items())]

    def _freshness(self) -> list[tuple[float, Labels]]:
        if self.monitor is None:
            return []
        now = self.clock()
        readings = [(served_id, self.monitor.freshness(served_id, now)) for served_id in self.monitor.versions()]
        return [(r.value, {"model_name": served_id}) for served_id, r in readings if r.value is not None]

    def _error_rate(self) -> list[tuple[float, Labels]]:
        if self.monitor is None:
            return []
        now = self.clock()
        readings = [(served_id, self.monitor.error_rate(served_id, now)) for served_id in self.monitor.versions()]
        return [(r.value, {"model_name": served_id}) for served_id, r in readings if r.value is not None]

    def _structured(self) -> list[tuple[float, Labels]]:
        if self.monitor is None:
            return []
        now = self.clock()
        readings = [
            (served_id, self.monitor.outcome(served_id, "structured", now)) for served_id in self.monitor.versions()
        ]
        return [(r.value, {"model_name": served_id}) for served_id, r in readings if r.value is not None]

    def _drift(self, signal: DriftSignal) -> Callable[[], list[tuple[float, Labels]]]:
        def observe() -> list[tuple[float, Labels]]:
            if self.monitor is None:
                return []
            now, out = self.clock(), []
            for served_id in self.monitor.versions():
                reading = self.monitor.drift(served_id, signal, now)
                for window, value in (("baseline", reading.baseline), ("current", reading.value)):
                    if value is not None:
                        out.append((value, {"model_name": served_id, "window": window}))
            return out

        return observe

    def _alert_states(self) -> list[tuple[float, Labels]]:
        if self.monitor is None:
            return []
        return [
            (1.0 if alert.state == "raised" else 0.0, {"model_name": served_id, "signal": signal})
            for (served_id, signal), alert in sorted(self.monitor.alerts.items())
        ]
