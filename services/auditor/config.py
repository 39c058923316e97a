"""Settings of the auditor: the only module of the service that reads the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, SecretStr, field_validator, model_validator

from weir.audit_key import resolve_audit_key, resolve_checkpoint_key
from weir.bus import BusSettings
from weir.home import weir_home


class AuditorSettings(BusSettings):
    """Kafka settings plus where the ledger lives and how it is served (env WEIR_AUDIT_*,
    WEIR_WATERMARK_TENANTS, WEIR_MODEL_REPO)."""

    audit_db: Path = Field(
        default_factory=lambda: weir_home() / "audit.sqlite",
        description="SQLite file of the hash-chained audit log; default $WEIR_HOME/audit.sqlite, beside the "
        "deployment's keys (var/audit.sqlite in a checkout).",
    )
    audit_hmac_key: SecretStr | None = Field(
        None,
        description="Key the workers' fingerprints are made with ('hex:<digits>' or UTF-8 text); unset: the "
        "deployment's key file, $WEIR_HOME/secrets/audit-hmac.key. Only lookups of a text need it.",
    )
    audit_checkpoint_key: SecretStr | None = Field(
        None,
        description="Key of the checkpoints' and Kafka anchors' MACs ('hex:<digits>', 16+ bytes); unset: the "
        "deployment's key file, $WEIR_HOME/secrets/audit-checkpoint.key, made at the auditor's first start.",
    )
    audit_retry_backoff_s: float = Field(
        1.0, ge=0, description="Wait before an event whose ledger write failed is redelivered."
    )
    audit_dsn: SecretStr | None = Field(
        None, description="PostgreSQL DSN (postgresql://...) of the ledger; when set it replaces WEIR_AUDIT_DB."
    )
    audit_batch_max_records: int = Field(
        500,
        ge=1,
        le=10_000,
        description="Most audit-topic records appended in one group commit (one fsync per chain, one offset commit).",
    )
    audit_checkpoint_every_records: int = Field(1000, ge=1, description="A chain's Merkle checkpoint every N records.")
    audit_checkpoint_every_s: float = Field(
        60.0, gt=0, description="... or T seconds after its oldest uncheckpointed record, whichever comes first."
    )
    audit_api_port: int = Field(
        8100, ge=0, le=65535, description="Port of /healthz, /readyz, /metrics and the lookup API (0: any free port)."
    )
    audit_admin_token: SecretStr | None = Field(
        None, description="Bearer token of POST /v1/audit/*; unset: those endpoints answer 503."
    )
    watermark_tenants: str = Field(
        "", description='Watermark keys per tenant, JSON {tenant: {"gamma", "delta", "key"}} (as the workers).'
    )
    comparison_ttl_s: float = Field(
        300.0,
        gt=0,
        description="How long a mirror reply or live answer waits for its other half before it is "
        "dropped (counted) by the shadow comparison.",
    )
    comparison_max_pending: int = Field(
        10_000,
        ge=1,
        description="Most mirror replies, and most live answers, the comparison holds while they wait.",
    )
    comparison_embedding_model: str = Field(
        "all-MiniLM-L6-v2",
        description="onnx model of the model repository whose embeddings give the comparison's "
        "similarity (the fingerprint model); empty: no similarity is measured.",
    )
    canary_guard: bool = Field(
        True,
        description='Take failing canaries to 0% (docs/design.md, "Traffic policies"): follows the registry '
        "and Topics.model_health, writes routes. Off: traffic counts only.",
    )
    canary_max_error_rate: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="A canary whose live requests err more than this share of its last "
        'WEIR_CANARY_MIN_REQUESTS is taken to 0% (docs/design.md, "Traffic policies").',
    )
    canary_min_requests: int = Field(
        20, ge=1, le=100_000, description="How many recent requests the error rate is over."
    )
    traffic_every_s: float = Field(
        2.0, gt=0, le=3600, description="How often changed traffic counts are published and due canaries stopped."
    )
    # Health of model versions against their baseline (services/auditor/drift.py; docs/design.md, "Observability").
    health_alerts: bool = Field(
        True,
        description="Judge each version's drift and freshness and publish HealthAlerts on Topics.health "
        "(follows the registry and that topic). Off: /metrics only has the audit counts.",
    )
    health_baseline_outputs: int = Field(
        50,
        ge=1,
        le=100_000,
        description="A version's baseline: the mean of its first N audited outputs (by finished_ms).",
    )
    health_window_outputs: int = Field(
        50, ge=1, le=100_000, description="Current value: the mean of its last M outputs."
    )
    health_window_s: float = Field(
        0.0, ge=0, description="... of those finished in the last T seconds (0: however old)."
    )
    health_min_window_outputs: int = Field(
        10, ge=1, le=100_000, description="Fewest outputs in the window before its drift is judged (at most M)."
    )
    # Each bound below: empty or "off" means not checked.
    health_entropy_max_abs: float | None = Field(
        None, gt=0, description="Raise when |current - baseline| output entropy passes this (nats)."
    )
    health_entropy_max_rel: float | None = Field(0.3, gt=0, description="... or this share of the baseline.")
    health_watermark_max_abs: float | None = Field(
        2.0, gt=0, description="Raise when |current - baseline| watermark z passes this."
    )
    health_watermark_max_rel: float | None = Field(None, gt=0, description="... or this share of the baseline.")
    health_max_age_s: float | None = Field(
        30 * 86400.0,
        gt=0,
        description="Raise freshness when a loaded version was pushed longer ago than this (s).",
    )
    health_max_error_rate: float | None = Field(
        0.2,
        gt=0,
        le=1,
        description="Raise error_rate when more than this share of a version's window ended in an error.",
    )
    health_clear_ratio: float = Field(
        0.8, gt=0, le=1, description="A raised drift clears when back under this share of its bound (no flapping)."
    )
    health_every_s: float = Field(10.0, gt=0, le=3600, description="How often drift and freshness are judged.")
    health_determinism_keys: int = Field(
        10_000,
        ge=1,
        le=10_000_000,
        description="Recent (version, prompt, parameters, seed) keys held to compare "
        "equal requests' outputs across workers (services/auditor/determinism.py).",
    )

    @field_validator(
        "health_entropy_max_abs",
        "health_entropy_max_rel",
        "health_watermark_max_abs",
        "health_watermark_max_rel",
        "health_max_age_s",
        "health_max_error_rate",
        mode="before",
    )
    @classmethod
    def _off(cls, value: object) -> object:
        """A bound set to '' or 'off' is not checked (None)."""
        return None if isinstance(value, str) and value.strip().lower() in ("", "off", "none") else value

    @model_validator(mode="after")
    def _health_window(self) -> Self:
        if self.health_min_window_outputs > self.health_window_outputs:
            raise ValueError("WEIR_HEALTH_MIN_WINDOW_OUTPUTS must not exceed WEIR_HEALTH_WINDOW_OUTPUTS")
        return self

    model_repo: str = Field(
        "models.toml",
        description="Model repository: where the watermark detector finds "
        "tokenizers, and the token prices ([prices.<model>], services/auditor/usage.py).",
    )
    usage_every_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="How often the token totals of the keys new audit events touched are "
        'recomputed from the ledger and published (docs/design.md, "Observability").',
    )
    usage_rate_every_s: float = Field(60.0, gt=0, le=86_400, description="How often the rate cards are published.")
    usage_rate_window_s: float = Field(
        3600.0, gt=0, le=30 * 86_400, description="The window a rate card's tokens per hour are measured over."
    )
    hardware_cost_per_hour: float | None = Field(
        None,
        ge=0,
        description="USD per hour of the hardware serving a model version (WEIR_HARDWARE_COST_PER_HOUR): "
        "with the measured tokens per hour, each rate card's cost per 1M tokens; unset: no such cost.",
    )

    def ledger_target(self) -> str | Path:
        """Where the ledger is: the PostgreSQL DSN when set, else the SQLite file."""
        if self.audit_dsn is not None and self.audit_dsn.get_secret_value():
            return self.audit_dsn.get_secret_value()
        return self.audit_db

    def hmac_key(self, create: bool = True) -> bytes:
        """The fingerprint key as bytes: WEIR_AUDIT_HMAC_KEY, else the deployment's key file (made
        first when `create`; `weir audit lookup` passes False). AuditKeyError (a ValueError) says why not."""
        setting = self.audit_hmac_key.get_secret_value() if self.audit_hmac_key is not None else None
        return resolve_audit_key(setting, create=create)

    def checkpoint_key(self, create: bool = True) -> bytes:
        """The checkpoint key as bytes: WEIR_AUDIT_CHECKPOINT_KEY, else the deployment's key file
        (made first when `create`; `weir audit verify` passes False). AuditKeyError (a ValueError) says why not."""
        setting = self.audit_checkpoint_key.get_secret_value() if self.audit_checkpoint_key is not None else None
        return resolve_checkpoint_key(setting, create=create)
