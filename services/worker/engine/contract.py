"""The engine contract: what the worker's runner needs of an engine, whichever it is.

Engine (llm_engine.py), EchoEngine (echo_engine.py) and EmbeddingEngine (embedding_engine.py)
all fit it. Every method is synchronous and takes the time as an argument; the runner calls them
from one engine thread or child process (services/worker/hosts/runner.py), never from the event loop.
"""

from __future__ import annotations

from typing import Protocol

from schemas.messages import EmbedRequest, GenerateRequest
from services.worker.engine.sequence import EngineOutput

# Request ids the worker keeps for itself (golden canaries, services/worker/hosts/goldens.py): a client
# request under it is refused (services/worker/kafka/refusals.py), so the two can never clash in an engine.
GOLDEN_ID_PREFIX = "\x1fgolden:"


class EngineLike(Protocol):
    """What the runner needs of an engine (Engine, EchoEngine and EmbeddingEngine all fit).

    add refuses, with a terminal event, a request of a kind the engine does not serve.
    """

    weights_sha256: str

    def add(self, request: GenerateRequest | EmbedRequest, now_ms: int) -> EngineOutput | None: ...
    def cancel(self, request_id: str, now_ms: int) -> EngineOutput | None: ...
    def step(self, now_ms: int) -> list[EngineOutput]: ...
    def stats(self) -> dict[str, float]: ...
    @property
    def has_work(self) -> bool: ...
