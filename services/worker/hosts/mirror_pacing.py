"""Mirror copies yield to live work (docs/design.md, "Traffic policies").

A mirror version's engine runs in the same worker process as the live version's, on the same
cores; copies are bulk and the batcher drops them first when it is loaded, but once in a worker
they would compete with live requests for the CPU (measured: live TTFT p95 1.85x with a 100%
mirror). Two halves, one per side of the engine pipe:

- LivePressure (the worker's event loop): how many live requests (not mirror copies) the engines
  of this process hold. It tells every engine host "live work runs" when the count leaves 0, and
  "live work is idle" once it has stayed 0 for `idle_ms` (a gap between two requests of a steady
  load is not idleness).
- MirrorPacer (each engine's own loop, services/worker/hosts/runner.py: drive): while live work runs
  somewhere in the process, an engine whose requests are all mirror copies steps at most once per
  `yield_ms` (0: not at all), and a copy it has held for `max_wait_ms` is ended `rejected`
  (`mirror_dropped`): a terminal event on the shadow reply topic, never lost silently
  (docs/design.md, invariant 3). An engine that holds a live request steps as usual (its copies
  are bulk: its scheduler runs them last).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from schemas.messages import EmbedRequest, ErrorInfo, GenerateRequest
from services.worker.engine import EngineLike, EngineOutput

if TYPE_CHECKING:
    from services.worker.config import WorkerSettings

PRESSURE = "pressure"  # the command an engine loop reads: ("pressure", True | False)


@dataclass(frozen=True)
class Pacing:
    """How mirror copies yield (WorkerSettings: mirror_yield_ms, mirror_max_wait_ms)."""

    yield_ms: int = 200
    max_wait_ms: int = 30_000

    @classmethod
    def of(cls, settings: WorkerSettings) -> Pacing:
        return cls(settings.mirror_yield_ms, settings.mirror_max_wait_ms)


class MirrorPacer:
    """An engine loop's view of its own requests (which are mirror copies) and of the process's
    live pressure; decides when it may step and which copies have waited too long. Pure: time
    comes in as an argument."""

    def __init__(self, pacing: Pacing, is_checking: Callable[[], bool] = lambda: False) -> None:
        self.pacing = pacing
        self._is_checking = is_checking  # golden checks run in the engine: never held back (their timeout)
        self.is_pressed = False  # live work runs somewhere in this worker process
        self.num_dropped = 0
        self._mirrors: dict[str, int] = {}  # copy id -> when this engine took it
        self._live: Counter[str] = Counter()  # live request ids in this engine (a redo may add one twice)
        self._last_step_ms = 0

    def added(self, request: GenerateRequest | EmbedRequest, now_ms: int) -> None:
        if request.shadow_of is not None:
            self._mirrors[request.request_id] = now_ms
        else:
            self._live[request.request_id] += 1

    def ended(self, outputs: list[EngineOutput]) -> None:
        """Forget the requests whose terminal event is among `outputs`."""
        for out in outputs:
            if not out.is_final:
                continue
            if self._mirrors.pop(out.request_id, None) is None and self._live[out.request_id] > 0:
                self._live[out.request_id] -= 1
                if not self._live[out.request_id]:
                    del self._live[out.request_id]

    @property
    def is_yielding(self) -> bool:
        """Live work runs elsewhere in the process and this engine holds only mirror copies (no
        live request, no golden check)."""
        return self.is_pressed and bool(self._mirrors) and not self._live and not self._is_checking()

    def wait_s(self, now_ms: int) -> float:
        """How long the loop may wait for a command before its next step or drop (0: step now)."""
        if not self.is_yielding:
            return 0.0
        due = [min(self._mirrors.values()) + self.pacing.max_wait_ms]
        if self.pacing.yield_ms > 0:
            due.append(self._last_step_ms + self.pacing.yield_ms)
        return max(0.0, (min(due) - now_ms) / 1000)

    def may_step(self, now_ms: int) -> bool:
        if self.is_yielding and (self.pacing.yield_ms == 0 or now_ms - self._last_step_ms < self.pacing.yield_ms):
            return False
        self._last_step_ms = now_ms
        return True

    def drop_expired(self, engine: EngineLike, now_ms: int) -> list[EngineOutput]:
        """While yielding: end every copy held `max_wait_ms` or longer, in the engine (its KV
        blocks freed) and with a terminal `rejected` (`mirror_dropped`) event."""
        if not self.is_yielding:
            return []
        limit = self.pacing.max_wait_ms
        outputs = []
        for rid in [r for r, since in self._mirrors.items() if now_ms - since >= limit]:
            cancelled = engine.cancel(rid, now_ms)
            del self._mirrors[rid]
            if cancelled is None:
                continue
            self.num_dropped += 1
            why = f"mirror copy held {limit} ms (WEIR_MIRROR_MAX_WAIT_MS) while live work ran in its worker"
            outputs.append(
                dataclasses.replace(
                    cancelled, finish_reason="rejected", error=ErrorInfo(code="mirror_dropped", message=why)
                )
            )
        return outputs


class PressureSink(Protocol):
    """What LivePressure tells: an engine host (services/worker/hosts/runner.py: _Host.press)."""

    def press(self, is_pressed: bool) -> None: ...


class LivePressure:
    """Live requests held by the engines of this worker process, told to every engine host as
    "live work runs" (count above 0) or "idle" (0 for `idle_ms`). Lives on the event loop."""

    def __init__(self, idle_ms: int) -> None:
        self.idle_ms = idle_ms
        self.num_live = 0
        self.is_pressed = False
        self._sinks: set[PressureSink] = set()
        self._idle: asyncio.TimerHandle | None = None

    def attach(self, sink: PressureSink) -> None:
        self._sinks.add(sink)
        if self.is_pressed:
            sink.press(True)

    def detach(self, sink: PressureSink) -> None:
        self._sinks.discard(sink)

    def started(self) -> None:
        """A live request was submitted to an engine of this process."""
        self.num_live += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if not self.is_pressed:
            self._tell(True)

    def ended(self, count: int = 1) -> None:
        """`count` live requests ended (their terminal event came, or their engine stopped)."""
        if count <= 0:
            return
        self.num_live = max(0, self.num_live - count)
        if self.num_live or not self.is_pressed or self._idle is not None:
            return
        if self.idle_ms <= 0:
            self._tell(False)
        else:
            self._idle = asyncio.get_running_loop().call_later(self.idle_ms / 1000, self._go_idle)

    def _go_idle(self) -> None:
        self._idle = None
        if not self.num_live:
            self._tell(False)

    def _tell(self, is_pressed: bool) -> None:
        self.is_pressed = is_pressed
        for sink in list(self._sinks):
            sink.press(is_pressed)
