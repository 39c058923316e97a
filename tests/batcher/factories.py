"""Factories for batcher tests: model repositories and requests with explicit times."""

from __future__ import annotations

from itertools import count

from schemas.messages import GenerateRequest, VersionStatus, WorkerHeartbeat
from schemas.model_repo import ModelConfig, ModelRepository
from schemas.registry import RegistryState
from schemas.topics import Topics, TopicSpec

T0_MS = 1_700_000_000_000  # a fixed "now" in epoch ms
_ids = count()


def make_repo(*configs: ModelConfig, **bounds: tuple[int, int]) -> ModelRepository:
    """A repository of echo models: make_repo(a=(max_batch_size, max_wait_ms), ...), plus any
    entries given whole."""
    models = {
        name: ModelConfig(name=name, engine="echo", max_batch_size=size, max_wait_ms=wait)
        for name, (size, wait) in bounds.items()
    }
    models.update({c.name: c for c in configs})
    return ModelRepository(models=models)


def make_models(*configs: ModelConfig, **bounds: tuple[int, int]) -> RegistryState:
    """A registry state seeded by make_repo(...): each entry's name resolves to `name@1`."""
    return RegistryState(make_repo(*configs, **bounds))


def version_specs(topics: Topics, repo: ModelRepository) -> list[TopicSpec]:
    """The core topics and the batch topic of each entry's version (name@version), as a deployment has them."""
    return topics.core_specs() + [spec for c in repo.models.values() for spec in topics.model_specs(c.served_id)]


def make_request(
    model: str = "a@1",
    *,
    request_id: str | None = None,
    deadline_ms: int = T0_MS + 60_000,
    priority: str = "interactive",
    reply_to: str = "weir.replies.test",
    prompt: str = "hi",
) -> GenerateRequest:
    """A valid GenerateRequest with a unique id unless one is given."""
    return GenerateRequest(
        request_id=request_id or f"r{next(_ids)}",
        model=model,
        prompt=prompt,
        deadline_ms=deadline_ms,
        priority=priority,
        reply_to=reply_to,
        created_ms=T0_MS,
    )


def make_config(name: str = "a", **fields: object) -> ModelConfig:
    """A model entry with any fields set, e.g. make_config(lane_policy="weighted")."""
    fields.setdefault("engine", "torch")
    fields.setdefault("path", "/models/none")
    return ModelConfig(name=name, **fields)


def make_tenant_request(
    tenant: str,
    model: str = "a@1",
    *,
    priority: str = "interactive",
    deadline_ms: int = T0_MS + 60_000,
    prompt: str = "x" * 40,
    max_tokens: int = 10,
) -> GenerateRequest:
    """A request of one tenant; with the defaults it costs 20 tokens (40 chars / 4 + 10)."""
    return GenerateRequest(
        request_id=f"{tenant}-{next(_ids)}",
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        tenant=tenant,
        priority=priority,
        deadline_ms=deadline_ms,
        reply_to="weir.replies.test",
        created_ms=T0_MS,
    )


def make_heartbeat(
    worker_id: str,
    partitions: dict[str, list[int]],
    *,
    free_kv_blocks: int = 100,
    block_size_tokens: int = 16,
    sent_ms: int = T0_MS,
    is_ready: bool = True,
    next_offsets: dict[str, dict[int, int]] | None = None,
    states: dict[str, str] | None = None,
    reasons: dict[str, str] | None = None,
) -> WorkerHeartbeat:
    """A worker's heartbeat: `partitions` keyed by served_id (name@version), each version "ready"
    unless `states` says otherwise (only ready ones are in `models`, as workers report them).
    Room is free_kv_blocks x block_size_tokens tokens. Without next_offsets the router counts
    batches planned after sent_ms against it."""
    states = {**dict.fromkeys(partitions, "ready"), **(states or {})}
    reasons = reasons or {}
    return WorkerHeartbeat(
        worker_id=worker_id,
        models=[served_id for served_id, state in states.items() if state == "ready"],
        is_ready=is_ready,
        num_running=0,
        num_waiting=0,
        max_num_seqs=64,
        free_kv_blocks=free_kv_blocks,
        block_size_tokens=block_size_tokens,
        partitions=partitions,
        sent_ms=sent_ms,
        next_offsets=next_offsets or {},
        versions={
            served_id: VersionStatus(state=state, reason=reasons.get(served_id)) for served_id, state in states.items()
        },
    )
