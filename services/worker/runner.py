"""Runs an engine on its own thread; the event loop talks to it through queues only.

The model step is CPU/GPU-bound and must never block the asyncio loop that keeps the Kafka
clients alive (heartbeats, fetches, commits). vLLM v1 keeps its busy loop behind queues the same
way.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from schemas.messages import EmbedRequest, GenerateRequest, now_ms
from services.worker.sequence import EngineOutput

log = logging.getLogger(__name__)


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


class EngineRunner:
    """One engine, one thread. Outputs are handed to `on_outputs` on the event loop."""

    def __init__(
        self, engine: EngineLike, loop: asyncio.AbstractEventLoop, on_outputs: Callable[[list[EngineOutput]], None]
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.num_pending = 0  # requests submitted and not finished (read by the loop thread)
        self.stats: dict[str, float] = engine.stats()
        self.failure: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerateRequest | EmbedRequest) -> None:
        """Queue a request for the engine (thread-safe, never blocks)."""
        self.num_pending += 1
        self._inbox.put(("add", request))

    def cancel(self, request_id: str) -> None:
        """Ask the engine to abort a request (thread-safe)."""
        self._inbox.put(("cancel", request_id))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                outputs: list[EngineOutput] = []
                if not self._apply_commands(outputs, wait=not self.engine.has_work):
                    return
                if self.engine.has_work:
                    outputs.extend(self.engine.step(now_ms()))
                self.stats = self.engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # device lost, or a bug: the process must not go on half-alive
            log.exception("engine thread died")
            self.failure = exc
            self._loop.call_soon_threadsafe(self._deliver, [])

    def _apply_commands(self, outputs: list[EngineOutput], wait: bool) -> bool:
        """Apply every queued command; with `wait`, first block until one comes. False on stop."""
        while True:
            try:
                kind, arg = self._inbox.get(block=wait)
            except queue.Empty:
                return True
            wait = False
            if kind == "stop":
                return False
            if kind == "add":
                out = self.engine.add(arg, now_ms())  # type: ignore[arg-type]
            else:
                out = self.engine.cancel(arg, now_ms())  # type: ignore[arg-type]
            if out is not None:
                outputs.append(out)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        self.num_pending -= sum(1 for o in outputs if o.is_final)
        self._on_outputs(outputs)
