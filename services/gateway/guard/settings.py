"""Settings of the gateway's guard: authentication, rate limits, validation, admission control.

A mixin of GatewaySettings (services/gateway/config.py reads the environment; env prefix WEIR_,
e.g. WEIR_AUTH_MODE, WEIR_JWT_KEYS, WEIR_TENANT_LIMITS). Every gateway instance of a deployment
must be given the same values: limits are enforced across instances only when they agree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

AuthMode = Literal["required", "open"]
InputGuardAction = Literal["block", "flag"]


class TenantLimits(BaseModel):
    """Per-minute limits of one tenant (all its keys and tokens together)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_requests_per_min: int | None = Field(None, ge=1, description="Requests per minute; None: no limit.")
    max_tokens_per_min: int | None = Field(None, ge=1, description="Tokens per minute; None: no limit.")


class GuardSettings(BaseSettings):
    """What the gateway checks before a request reaches Kafka."""

    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore", protected_namespaces=())

    auth_mode: AuthMode = Field(
        "required",
        description="required: every API request needs an API key or a JWT; open: no credentials "
        "(local use only; `weir up` sets it and says so).",
    )
    jwt_keys: str | None = Field(
        None, description="JWKS (HS256 'oct' and RS256 'RSA' keys) as inline JSON or the path of a JSON file."
    )
    jwt_issuer: str | None = Field(None, description="Required `iss` of JWTs; unset: not checked.")
    jwt_audience: str | None = Field(None, description="Required `aud` of JWTs; unset: tokens with an aud are refused.")
    jwt_tenant_claim: str = Field("tenant", description="JWT claim holding the tenant.")
    jwt_models_claim: str = Field("models", description="JWT claim listing allowed models (absent: all).")
    jwt_leeway_s: float = Field(30.0, ge=0, description="Clock skew allowed on exp/nbf.")
    jwt_max_requests_per_min: int | None = Field(
        None, ge=1, description="Requests per minute of one JWT subject unless its `rpm` claim says otherwise."
    )
    jwt_max_tokens_per_min: int | None = Field(
        None, ge=1, description="Tokens per minute of one JWT subject unless its `tpm` claim says otherwise."
    )
    default_tenant: str = Field("default", description="Tenant of open access and of JWTs without a tenant claim.")
    tenant_limits: dict[str, TenantLimits] = Field(
        default_factory=dict,
        description='Per-tenant limits as JSON, e.g. {"acme": {"max_requests_per_min": 600}}; key "*" '
        "applies to tenants not listed.",
    )
    usage_flush_ms: int = Field(
        100, ge=10, le=10_000, description="How often this instance publishes its rate-limit usage to the others."
    )
    usage_replay_s: float = Field(
        60.0, ge=0, description="At startup, usage records this recent are applied (one limit window)."
    )
    keys_catch_up_s: float = Field(
        10.0, ge=0, description="How long startup waits to read the keys topic and recent usage to their ends."
    )
    max_in_flight_interactive: int = Field(
        256, ge=1, description="Interactive requests in flight per model in this instance; more is 429."
    )
    max_in_flight_bulk: int = Field(64, ge=1, description="Bulk requests in flight per model in this instance.")
    is_breaker_enabled: bool = Field(
        True, description="Refuse a model's requests with 503 while no worker of it has a live heartbeat."
    )
    overload_waiting_ratio: float = Field(
        2.0, gt=0, description="A worker is overloaded when num_waiting >= ratio * max_num_seqs; all overloaded → 429."
    )
    max_input_tokens: int | None = Field(
        None, ge=1, description="Cap on prompt tokens below the model's max_model_len."
    )
    max_stop_sequences: int = Field(16, ge=0, le=16, description="Most stop strings a request may set.")
    input_guard: Literal["on", "off"] = Field(
        "on", description="on: every prompt is screened for prompt injection (rules + classifier) before Kafka."
    )
    input_guard_action: InputGuardAction = Field(
        "flag",
        description="What a high-risk prompt gets, for tenants not in input_guard_tenant_actions: "
        "block (400 prompt_injection_detected) or flag (served; counted, logged, and towards a review).",
    )
    input_guard_tenant_actions: dict[str, InputGuardAction] = Field(
        default_factory=dict, description='Per-tenant action as JSON, e.g. {"acme": "block", "lab": "flag"}.'
    )
    review_threshold: int = Field(
        5, ge=1, description="High-risk detections of one principal within review_window_s that flag it for review."
    )
    review_window_s: float = Field(3600.0, gt=0, description="The sliding window of review_threshold, seconds.")
