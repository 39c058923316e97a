"""Settings of the gateway: the only place in services/gateway that reads the environment."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from services.gateway.guard.settings import GuardSettings
from weir.bus import BusSettings


class GatewaySettings(BusSettings, GuardSettings):
    """Gateway settings (env prefix WEIR_, e.g. WEIR_GATEWAY_PORT, WEIR_MODEL_REPO)."""

    # protected_namespaces=(): `model_repo` is a setting, not a pydantic `model_*` attribute.
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore", protected_namespaces=())

    gateway_host: str = Field("127.0.0.1", description="Interface the HTTP server binds.")
    gateway_port: int = Field(8000, ge=0, le=65535, description="TCP port of the HTTP server; 0 picks one.")
    gateway_id: str | None = Field(
        None, description="Instance id (names the reply topic); a fresh one per process when unset."
    )
    model_repo: str = Field("models.toml", description="Model repository TOML file (WEIR_MODEL_REPO).")
    gateway_admin_token: SecretStr | None = Field(
        None, description="Bearer token of the model admin API (/v2/repository/...); unset: every call is 403."
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body accepted; larger is 413.")
    max_json_depth: int = Field(
        64,
        ge=2,
        le=200,  # the gateway re-encodes bodies with orjson, which stops at 254 levels
        description="Deepest nesting of JSON arrays and objects in a body; deeper is 400.",
    )
    max_headers: int = Field(100, ge=16, description="Most headers one request may carry; more is 431.")
    max_header_bytes: int = Field(
        32 << 10, ge=4096, description="Most bytes of header names and values in one request; more is 431."
    )
    max_timeout_s: float = Field(600.0, gt=0, description="Cap on any request's timeout, client-set or default.")
    batch_max_file_bytes: int = Field(64 << 20, ge=1024, description="Largest batch input file; larger is 413.")
    batch_max_queued_requests: int = Field(
        100_000, ge=1, description="Batch quota: requests a principal may have in live batches (docs/batch.md)."
    )
    batch_max_queued_tokens: int = Field(
        100_000_000,
        ge=1,
        description="Batch quota: tokens (prompts + max_tokens) a principal may have in live batches.",
    )
    reply_grace_s: float = Field(
        2.0, ge=0, description="How long past a request's deadline the gateway waits for its terminal event."
    )
    gap_timeout_s: float = Field(
        5.0, gt=0, description="How long a reply stream waits for a missing seq before skipping the gap."
    )
    resume_grace_s: float = Field(
        0.0,
        ge=0,
        description="How long a stream whose client left stays resumable before it is cancelled, for "
        "requests that do not set X-Weir-Resume-Grace-S; 0: cancel at once (a disconnect stops the worker).",
    )
    max_resume_grace_s: float = Field(300.0, ge=0, description="Largest X-Weir-Resume-Grace-S a client may ask.")
    resume_keep_s: float = Field(
        60.0,
        ge=0,
        description="How long a finished resumable stream can still be read again (a client that missed its tail).",
    )
    max_resumable_streams: int = Field(
        10_000, ge=1, description="Resumable streams kept per instance; the oldest unread go first."
    )
    max_indexed_streams: int = Field(
        100_000,
        ge=1,
        description="Other gateways' resumable streams (weir.streams) known per instance; the oldest go first.",
    )
    max_remote_resumes: int = Field(
        64,
        ge=1,
        description="Streams of other gateways read at once by this one (one reply-topic reader each); 429 past it.",
    )
    output_guard: Literal["redact", "off"] = Field(
        "redact",
        description="redact: personal data in outputs (ID and bank card numbers, phones, e-mails) becomes [REDACTED].",
    )
    output_holdback_chars: int = Field(
        200,
        ge=1,
        description="The output guard's hold-back window: the most text it holds while a match may be forming.",
    )
    heartbeat_live_s: float = Field(10.0, gt=0, description="A worker heartbeat younger than this is live.")
    lag_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often the consumer lag of the deployment's groups is polled for /metrics (weir/lag.py), "
        "and the unread requests of the batch topics for admission (queue_wait.py).",
    )
    startup_timeout_s: float = Field(30.0, gt=0, description="How long startup waits for the Kafka broker.")
    log_level: str = Field("info", description="Log level of the gateway and uvicorn.")

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if not self.model_repo:
            raise ValueError("model_repo='' must name a TOML file; set WEIR_MODEL_REPO")
        if self.gateway_id is not None:  # its reply topic must pass the workers' check of reply_to
            problem = self.topics.reply_to_problem(self.topics.replies(self.gateway_id))
            if problem is not None:
                raise ValueError(
                    f"gateway_id={self.gateway_id[:80]!r} (WEIR_GATEWAY_ID) cannot name a reply topic: {problem}"
                )
        return self
