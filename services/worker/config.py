"""Worker settings: the only place the worker reads the environment (WEIR_*)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from schemas.watermark import WatermarkConfig, parse_tenants
from weir.audit_key import resolve_audit_key
from weir.bus import BusSettings


class WorkerSettings(BusSettings):
    """Settings of one worker process."""

    model_repo: str = Field("models.toml", description="Model repository TOML file.")
    worker_http_port: int = Field(
        8120, ge=0, le=65535, description="Port of /healthz, /readyz, /metrics (0: any free port)."
    )
    models: str = Field("", description="Comma-separated models to serve; empty serves every model in the repository.")
    device: str = Field("auto", description="auto | cpu | cuda.")
    kv_cache_bytes: int = Field(256 * 1024 * 1024, ge=1 << 20, description="KV-cache budget on the CPU.")
    block_size: int = Field(8, ge=1, description="Tokens per KV-cache block (8 keeps the last-block waste small).")
    max_num_batched_tokens: int = Field(512, ge=16, description="Token budget of one engine step.")
    heartbeat_interval_ms: int = Field(1000, ge=100, description="How often capacity is published.")
    # docs/design.md, "Scale-out and failover": a worker killed -9 keeps its batch partitions until the
    # coordinator has heard nothing from it for this long; then the survivors take them and redo them.
    # 2000 ms measured (docs/worker.md): ~2 s from a kill to the survivor's assignment; the broker must
    # allow it (group.min.session.timeout.ms <= it; `weir kafka up` sets 1000, Kafka's default is 6000).
    worker_session_timeout_ms: int = Field(
        2000,
        ge=1000,
        description="Session timeout of the worker's consumer group membership: how long a "
        "worker that died silently (kill -9, a lost machine) keeps its batch partitions.",
    )
    worker_group_heartbeat_ms: int = Field(
        0,
        ge=0,
        description="Interval of the consumer group heartbeat; 0: a quarter of the session timeout.",
    )
    worker_instance: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Stable name of this worker (e.g. worker-1), its static group membership "
        "(group.instance.id): restarted under the same name it gets its partitions back at once, with no "
        "rebalance. Unset: dynamic membership. Two live workers must never share one.",
    )
    audit_hmac_key: SecretStr | None = Field(
        None,
        description="Key of the audit HMACs ('hex:<digits>' or text); unset: the deployment's key file, "
        "$WEIR_HOME/secrets/audit-hmac.key, made on first start (weir/audit_key.py).",
    )
    echo_step_delay_ms: int = Field(0, ge=0, description="Pause per step of the echo model (tests of cancellation).")
    grammar_prewarm: bool = Field(
        True,
        description="Start a text model's grammar compile child (structured output) "
        "once it is loaded, so the first constrained request does not wait seconds for it.",
    )
    audit_fingerprint_model: str = Field(
        "all-MiniLM-L6-v2", description="Onnx embedding model of the AuditEvents' SimHashes; empty: none."
    )
    audit_fingerprint_precision: Literal["int8", "float32"] = Field(
        "int8",
        description="int8: the fingerprint model quantized, on the CPU (about half float32's CPU; SimHashes "
        "within a few bits of float32's, docs/worker.md); float32: the export as is. On a CUDA worker, float32 on the GPU.",
    )
    watermark_tenants: str = Field(
        "", description='Green-list watermark per tenant, JSON {tenant: {"gamma", "delta", "key"}}; empty: off.'
    )
    engine_isolation: Literal["process", "thread"] = Field(
        "process",
        description="process: each engine runs in a child process (no GIL shared with the Kafka loop); "
        "thread: on a thread of the worker. The echo engine, which computes nothing, always runs on a thread.",
    )
    model_trusted_keys: str = Field(
        "",
        description="Directory of the Ed25519 public keys (*.pub PEM) whose manifest signatures the worker "
        "trusts (weir/models/signing.py); empty: none.",
    )
    require_signed_models: bool = Field(
        False, description="Refuse to load a model version whose manifest is not signed by a trusted key."
    )
    fault_hooks: bool = Field(
        False,
        description="Allow the fault hook that corrupts a loaded engine's weights in memory (tests and demos "
        "of the golden canaries); off in production.",
    )
    engine_threads: int = Field(
        0,
        ge=0,
        description="Threads each engine computes with on the CPU (torch intra-op threads, which the "
        "quantized kernels share); 0: the cores the worker owns less one for its own loop, at least one "
        "(services/worker/hosts/hardware.py: cpu_threads); a machine whose cores are the engine's alone sets all of "
        "them. Printed when the engine starts.",
    )
    torch_threads: int = Field(
        0, ge=0, description="The former name of engine_threads (WEIR_TORCH_THREADS), used when that is 0."
    )

    @property
    def threads(self) -> int:
        """engine_threads, else torch_threads (0: cpu_threads' default)."""
        return self.engine_threads or self.torch_threads

    worker_memory_bytes: int = Field(
        0,
        ge=0,
        description="Memory the model versions of this worker may take in all (weights + KV caches); "
        "0: worker_memory_fraction of the device's memory. A version that does not fit is refused.",
    )
    worker_memory_fraction: float = Field(
        0.95,
        gt=0,
        le=1,
        description="With worker_memory_bytes 0: the share of the device's memory (GPU, else RAM) "
        "the model versions may take. High, because a torch engine on CUDA sizes its KV cache to 85% of the free "
        "memory (services/worker/hosts/memory.py counts it): a lower share would refuse the first version.",
    )
    drain_quiet_ms: int = Field(
        2000,
        ge=0,
        description="A version being unloaded keeps reading its batch topic until nothing ran and no "
        'batch came for this long (docs/design.md, "The model registry").',
    )
    golden_interval_s: float = Field(
        60.0, ge=0, description="How often each ready version's golden requests run again; 0: only at load."
    )
    rollback_window_s: float = Field(
        600.0,
        ge=0,
        description="A default version promoted this recently is rolled back when its goldens fail.",
    )
    rollback_warm_timeout_s: float = Field(
        120.0,
        ge=0,
        description="A rollback switches the route back once the previous version is ready on the "
        'worker that rolls back, or after this long anyway (docs/design.md, "The model registry").',
    )
    mirror_yield_ms: int = Field(
        0,
        ge=0,
        description="While live requests run in this worker, an engine holding only mirror copies steps "
        "at most once per this many ms; 0 (default): not at all until live work is idle (docs/design.md, "
        '"Traffic policies": 200 ms still cost live TTFT p95 1.7x here, 0 cost 1.02x).',
    )
    mirror_max_wait_ms: int = Field(
        30_000,
        ge=1,
        description="A mirror copy held back this long by live work is ended rejected (mirror_dropped) "
        "on the shadow reply topic.",
    )
    mirror_idle_ms: int = Field(
        100,
        ge=0,
        description="Live work is idle once no live request has run in this worker for this long: "
        "mirror-only engines step freely again.",
    )

    @model_validator(mode="after")
    def _group_heartbeat_below_session(self) -> WorkerSettings:
        if self.worker_group_heartbeat_ms >= self.worker_session_timeout_ms:
            raise ValueError(
                f"WEIR_WORKER_GROUP_HEARTBEAT_MS ({self.worker_group_heartbeat_ms}) must be below "
                f"WEIR_WORKER_SESSION_TIMEOUT_MS ({self.worker_session_timeout_ms})"
            )
        return self

    def group_heartbeat_ms(self) -> int:
        """The consumer group heartbeat interval: the setting, else a quarter of the session."""
        return self.worker_group_heartbeat_ms or max(100, self.worker_session_timeout_ms // 4)

    def serves(self, name: str) -> bool:
        """Whether this worker serves model `name` (WEIR_MODELS, or every name when it is empty)."""
        return not self.models.strip() or name in {m.strip() for m in self.models.split(",")}

    def hmac_key(self) -> bytes:
        """The audit key's bytes (made on first use when it comes from the key file); AuditKeyError
        (a ValueError naming the file and the fix) when the key file is unsafe or malformed."""
        setting = self.audit_hmac_key.get_secret_value() if self.audit_hmac_key is not None else None
        return resolve_audit_key(setting, create=True)

    def watermarks(self) -> dict[str, WatermarkConfig]:
        """The tenants' watermarks (WEIR_WATERMARK_TENANTS); ValueError naming the setting."""
        return parse_tenants(self.watermark_tenants)
