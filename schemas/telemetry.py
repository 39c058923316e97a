"""Wire types of observability: spans, token accounting and health alerts (docs/design.md, "Observability").

Three topics carry them; every record is JSON like every other wire type, and none holds raw text
(prompts and outputs never leave the request path: invariant 7).

    <prefix>.traces        SpanRecord, keyed `<request_id>/<span_id>` (or `-/<span_id>` for a span of
                           no request); compacted and deleted after TRACE_RETENTION_MS, so a span
                           written twice (a retried export) is kept once. `weir trace REQUEST_ID`
                           reads it from any machine and prints that request's tree.
    <prefix>.usage.tokens  UsageTotals, compacted, keyed by UsageTotals.key(): per day (UTC), tenant,
                           principal and model version, the running totals the auditor folded from
                           the audit stream (the only bookkeeping: the services keep none).
                           RateCard records (key `rate:<model_version>`) beside them: the measured
                           tokens per hour and the cost per 1M tokens derived from the hardware cost.
    <prefix>.health        HealthAlert: a model version's drift, staleness, structured-output SLA or
                           determinism crossed a threshold (raised) or came back (cleared). From the auditor.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from schemas.messages import _Wire, now_ms

TRACE_RETENTION_MS = 24 * 3600 * 1000
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_DAY = r"^\d{4}-\d{2}-\d{2}$"

AttributeValue = str | int | float | bool | list[str] | list[int] | list[float] | list[bool]


class SpanEvent(_Wire):
    """A timed point in a span (e.g. `first_token`)."""

    name: str = Field(max_length=128)
    time_ns: int = Field(ge=0)
    attributes: dict[str, AttributeValue] = Field(default_factory=dict)


class SpanRecord(_Wire):
    """One finished OpenTelemetry span, as the Kafka exporter writes it to `<prefix>.traces`."""

    trace_id: str = Field(description="32 lowercase hex (W3C trace-id).")
    span_id: str = Field(description="16 lowercase hex.")
    parent_span_id: str | None = Field(None, description="16 lowercase hex; None for a root span.")
    name: str = Field(
        max_length=256, description="Span name, e.g. 'POST /v1/chat/completions', 'weir.batches publish'."
    )
    kind: Literal["internal", "server", "client", "producer", "consumer"] = "internal"
    service: str = Field(
        max_length=64, description="service.name of the process that ended it: gateway, batcher, worker, auditor."
    )
    instance: str = Field("", max_length=128, description="Which instance of the service (worker_id, gateway_id, ...).")
    request_id: str | None = Field(None, max_length=128, description="The request it belongs to, when one.")
    start_ns: int = Field(ge=0, description="Start, epoch ns.")
    end_ns: int = Field(ge=0, description="End, epoch ns.")
    status: Literal["unset", "ok", "error"] = "unset"
    status_message: str = Field("", max_length=1024)
    attributes: dict[str, AttributeValue] = Field(
        default_factory=dict, description="OpenTelemetry attributes (messaging.*, gen_ai.*, weir.*)."
    )
    events: list[SpanEvent] = Field(default_factory=list)
    links: list[str] = Field(
        default_factory=list, description="Linked spans as '<trace_id>/<span_id>' (a batch links its requests)."
    )

    @field_validator("trace_id")
    @classmethod
    def _trace_id(cls, value: str) -> str:
        if not _HEX32.fullmatch(value) or value == "0" * 32:
            raise ValueError("trace_id must be 32 lowercase hex digits, not all zero")
        return value

    @field_validator("span_id", "parent_span_id")
    @classmethod
    def _span_id(cls, value: str | None) -> str | None:
        if value is not None and (not _HEX16.fullmatch(value) or value == "0" * 16):
            raise ValueError("span ids must be 16 lowercase hex digits, not all zero")
        return value

    def key(self) -> str:
        return f"{self.request_id or '-'}/{self.span_id}"


class UsageTotals(_Wire):
    """Running token totals of one (day, tenant, principal, model version), from the audit stream.

    Each record replaces the previous one of its key (compacted topic): the auditor publishes the
    new totals after folding audit events, so a reader needs only the latest record per key.
    Mirror copies (AuditEvent.shadow_of) are not billed and not counted here.
    """

    kind: Literal["usage"] = "usage"
    day: str = Field(pattern=_DAY, description="UTC day of the requests' finish, YYYY-MM-DD.")
    tenant: str = Field(max_length=256)
    principal: str = Field(max_length=256)
    model_version: str = Field(max_length=256, description="name@version that served them.")
    requests: int = Field(0, ge=0)
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    cached_prompt_tokens: int = Field(0, ge=0, description="Prompt tokens served from the prefix cache.")
    cost_usd: float | None = Field(
        None,
        allow_inf_nan=False,
        ge=0,
        description="From the price table (per 1M input/output tokens); None: no price for this model.",
    )
    updated_ms: int = Field(default_factory=now_ms)

    def key(self) -> str:
        return usage_key(self.day, self.tenant, self.principal, self.model_version)


def usage_key(day: str, tenant: str, principal: str, model_version: str) -> str:
    # '\x1f' (unit separator) cannot appear in a tenant or principal the gateway accepts.
    return "\x1f".join(("usage", day, tenant, principal, model_version))


class RateCard(_Wire):
    """What a model version costs to run, measured: on `<prefix>.usage.tokens` keyed `rate:<model_version>`."""

    kind: Literal["rate"] = "rate"
    model_version: str = Field(max_length=256)
    tokens_per_hour: float = Field(
        ge=0,
        allow_inf_nan=False,
        description="Tokens (prompt + completion) per hour it served, measured over window_s.",
    )
    window_s: float = Field(gt=0, allow_inf_nan=False)
    hardware_cost_per_hour_usd: float | None = Field(
        None, allow_inf_nan=False, ge=0, description="Configured cost of the hardware serving it."
    )
    cost_per_1m_tokens_usd: float | None = Field(
        None, allow_inf_nan=False, ge=0, description="hardware_cost_per_hour / tokens_per_hour * 1e6."
    )
    updated_ms: int = Field(default_factory=now_ms)

    def key(self) -> str:
        return f"rate:{self.model_version}"


HealthSignal = Literal["freshness", "entropy", "watermark", "error_rate", "golden", "structured", "determinism"]


class HealthAlert(_Wire):
    """A model version's health signal crossed its threshold (`raised`) or came back (`cleared`), on `<prefix>.health`."""

    alert_id: str = Field(max_length=128, description="Idempotency key.")
    model_version: str = Field(max_length=256)
    signal: HealthSignal
    state: Literal["raised", "cleared"]
    value: float = Field(
        allow_inf_nan=False, description="The signal's current value (seconds for freshness; nats, z, ratio otherwise)."
    )
    baseline: float | None = Field(
        None, allow_inf_nan=False, description="The value recorded when the version was loaded; None for freshness."
    )
    threshold: float = Field(description="The configured bound that was crossed.", allow_inf_nan=False)
    detail: str = Field("", max_length=1024, description="For a person.")
    counts: dict[str, int] = Field(
        default_factory=dict,
        max_length=8,
        description="A signal of counted outcomes: the counts behind `value` (structured: valid, invalid; "
        "determinism: same, differs).",
    )
    created_ms: int = Field(default_factory=now_ms)
