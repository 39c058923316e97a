"""Health signals read off the audit stream, as Prometheus text (GET /metrics on the auditor).

Per model: output entropy (the workers' per-request mean token entropy), watermark strength (mean
z-score of watermarked outputs) and the request mix (by tenant and finish reason). A model whose
entropy collapses or whose watermark z drops shows it here first. Also the review flags raised by
the gateways' input guards, by tenant and reason. Counted over the records this auditor appended
since it started (a redelivered event or flag counts once).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from schemas.messages import AuditEvent, ReviewFlag


@dataclass
class _Mean:
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1


class HealthMetrics:
    """Running aggregates of AuditEvents; `observe` each new record, `render` for Prometheus."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)  # (model, tenant, finish) -> count
        self.entropy: dict[str, _Mean] = defaultdict(_Mean)
        self.watermark_z: dict[str, _Mean] = defaultdict(_Mean)
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.num_events = 0
        self.review_flags: dict[tuple[str, str], int] = defaultdict(int)  # (tenant, reason) -> count
        self.shadow_join: dict[str, int] = {}  # the comparison's ShadowJoin.counts (outcome -> count)

    def observe(self, event: AuditEvent) -> None:
        """Count one appended AuditEvent (called by the auditor's handler on the event loop)."""
        self.num_events += 1
        self.requests[(event.model_version, event.tenant, event.finish_reason)] += 1
        self.completion_tokens[event.model_version] += event.completion_tokens
        if event.mean_token_entropy is not None:
            self.entropy[event.model_version].add(event.mean_token_entropy)
        if event.watermark_z is not None:
            self.watermark_z[event.model_version].add(event.watermark_z)

    def observe_flag(self, flag: ReviewFlag) -> None:
        """Count one appended ReviewFlag (called by the auditor's handler on the event loop)."""
        self.review_flags[(flag.tenant, flag.reason)] += 1

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4) of every aggregate."""
        lines = [
            "# HELP weir_audit_events_total Audit events appended by this auditor since it started.",
            "# TYPE weir_audit_events_total counter",
            f"weir_audit_events_total {self.num_events}",
            "# HELP weir_audit_requests_total Audited requests by model, tenant and finish reason.",
            "# TYPE weir_audit_requests_total counter",
        ]
        for (model, tenant, finish), n in sorted(self.requests.items()):
            lines.append(f"weir_audit_requests_total{{{_labels(model=model, tenant=tenant, finish_reason=finish)}}} {n}")
        lines += ["# HELP weir_audit_completion_tokens_total Generated tokens by model.",
                  "# TYPE weir_audit_completion_tokens_total counter"]
        lines += [f"weir_audit_completion_tokens_total{{{_labels(model=m)}}} {n}"
                  for m, n in sorted(self.completion_tokens.items())]
        lines += ["# HELP weir_audit_review_flags_total Principals flagged for review, by tenant and reason.",
                  "# TYPE weir_audit_review_flags_total counter"]
        lines += [f"weir_audit_review_flags_total{{{_labels(tenant=t, reason=r)}}} {n}"
                  for (t, r), n in sorted(self.review_flags.items())]
        lines += ["# HELP weir_audit_shadow_join_total Shadow comparison join: pairs joined, halves expired "
                  "unmatched or evicted, deltas after their end.", "# TYPE weir_audit_shadow_join_total counter"]
        lines += [f"weir_audit_shadow_join_total{{{_labels(outcome=k)}}} {n}" for k, n in sorted(self.shadow_join.items())]
        for name, table, help_ in (
            ("weir_audit_output_entropy_nats", self.entropy, "Mean per-request token entropy of outputs (nats)."),
            ("weir_audit_watermark_z", self.watermark_z, "Mean watermark z-score of watermarked outputs."),
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} summary"]
            for model, mean in sorted(table.items()):
                lines.append(f"{name}_sum{{{_labels(model=model)}}} {mean.total:.6g}")
                lines.append(f"{name}_count{{{_labels(model=model)}}} {mean.count}")
        return "\n".join(lines) + "\n"


def _labels(**labels: str) -> str:
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return ",".join(f'{k}="{v}"' for k, v in escaped.items())
