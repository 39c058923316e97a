"""Settings of the batcher: the only place it reads the environment (env prefix WEIR_)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.batcher.mirroring import DEFAULT_MIRROR_MAX_QUEUED
from services.batcher.planner import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_RECENT
from services.batcher.routing import DEFAULT_PREFIX_CHARS
from weir.bus import BusSettings


class BatcherSettings(BusSettings):
    """Batcher settings; each field reads WEIR_<FIELD_NAME>, e.g. WEIR_MODEL_REPO."""

    batcher_http_port: int = Field(
        8110, ge=0, le=65535, description="Port of /healthz, /readyz, /metrics (0: any free port)."
    )
    model_repo: Path = Field(
        Path("models.toml"),
        description="Model repository TOML: seeds the model registry with the versions it does not hold yet.",
    )
    max_idle_wait_ms: int = Field(
        100,
        ge=1,
        le=10_000,
        description="Longest one loop round waits for records; bounds cancel and shutdown latency when idle.",
    )
    control_lookback_ms: int = Field(
        15 * 60_000,
        ge=0,
        description="On start, read the control topic from this long ago, so cancels that beat their request count.",
    )
    max_recent_ids: int = Field(
        DEFAULT_MAX_RECENT, ge=1, description="Request ids remembered for deduplication after they leave."
    )
    max_batch_bytes: int = Field(
        DEFAULT_MAX_BATCH_BYTES, ge=1024, description="Byte budget of one Batch record (producer limit is 1 MiB)."
    )
    max_poll_records: int = Field(500, ge=1, description="Most request records taken per loop round.")
    worker_timeout_ms: int = Field(
        3000,
        ge=100,
        description="A worker whose latest heartbeat is older than this gets no batches (3 x the workers' "
        "heartbeat interval).",
    )
    prefix_affinity_chars: int = Field(
        DEFAULT_PREFIX_CHARS,
        ge=1,
        description="Leading characters of a prompt (or a chat's system message) hashed to pick its worker.",
    )
    mirror_max_queued: int = Field(
        DEFAULT_MIRROR_MAX_QUEUED,
        ge=0,
        description="Most mirror copies held at once; a copy beyond it is dropped (counted, ended on the shadow "
        "reply topic), as are all held copies while an interactive request waits for worker room.",
    )
    lag_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often the consumer lag of the deployment's groups is polled for /metrics (weir/lag.py).",
    )
