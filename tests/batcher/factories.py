"""Factories for batcher tests: model repositories and requests with explicit times."""

from __future__ import annotations

from itertools import count

from schemas.messages import GenerateRequest
from schemas.model_repo import ModelConfig, ModelRepository

T0_MS = 1_700_000_000_000  # a fixed "now" in epoch ms
_ids = count()


def make_repo(**bounds: tuple[int, int]) -> ModelRepository:
    """A repository of echo models: make_repo(a=(max_batch_size, max_wait_ms), ...)."""
    models = {
        name: ModelConfig(name=name, engine="echo", max_batch_size=size, max_wait_ms=wait)
        for name, (size, wait) in bounds.items()
    }
    return ModelRepository(models=models)


def make_request(
    model: str = "a",
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
        priority=priority,  # type: ignore[arg-type]
        reply_to=reply_to,
        created_ms=T0_MS,
    )
