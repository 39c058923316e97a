"""Opening a model version's engines: every instance at once (versions.py opens each version's
while the others load).

Each engine with real work loads in a child process of its own (runner.EngineProcess): a Python
start, a torch or onnxruntime import, the weights, the warmup. One after another they were most
of a worker's start (a second `weir up` on the development machine: the default model's engine
10 s, then the embedding model's 3.6 s). Side by side they overlap each other.

Each engine is opened with its model's sink, given to the loader at construction: the queue its
model server reads once it is built (outputs only come once a server submits requests, and a
queue keeps any until it reads). The loader says which models are still loading for /readyz, and
stops what it opened when the worker gives up before serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from schemas.model_repo import ModelConfig
from services.worker.engine.sequence import EngineOutput
from services.worker.hosts.runner import EngineHost

log = logging.getLogger(__name__)

OnOutputs = Callable[[list[EngineOutput]], None]
OnStatus = Callable[[str], None]
OpenEngine = Callable[[ModelConfig, OnOutputs, OnStatus], Awaitable[EngineHost]]
STARTING = "starting its process"  # until the engine's process says more (it imports torch first)


class EngineLoader:
    """The engines of `configs` (config.instances each), opened concurrently by `open_engine`, each
    with its model's sink in `sinks` (model name -> where its engines' outputs go)."""

    def __init__(self, configs: list[ModelConfig], open_engine: OpenEngine, sinks: Mapping[str, OnOutputs]) -> None:
        missing = [c.name for c in configs if c.name not in sinks]
        if missing:
            raise ValueError(f"no sink for the outputs of {', '.join(missing)}")
        self._configs = configs
        self._open_engine = open_engine
        self._sinks = dict(sinks)
        self.hosts: dict[str, list[EngineHost]] = {c.name: [] for c in configs}
        self.steps: dict[str, str] = {c.name: STARTING for c in configs}  # what each model's loading does now
        self._task: asyncio.Task[dict[str, list[EngineHost]]] | None = None

    def start(self) -> None:
        """Begin opening every engine (on the running loop); `wait` returns them."""
        self._task = asyncio.create_task(self._open_all(), name="open-engines")

    async def wait(self) -> dict[str, list[EngineHost]]:
        """Every model's hosts, once all are built and warmed up; raises the first failure
        (a model that cannot load), after the others were stopped."""
        assert self._task is not None, "start() first"
        return await asyncio.shield(self._task)

    def still_loading(self) -> list[str]:
        """Models some of whose engines are not open yet, in repository order."""
        return [c.name for c in self._configs if len(self.hosts[c.name]) < c.instances]

    def describe(self) -> str:
        """'weir-tiny-py: warming up; all-MiniLM-L6-v2: exporting it to ONNX ...' for the models still loading."""
        return "; ".join(f"{name}: {self.steps[name]}" for name in self.still_loading())

    async def discard(self) -> None:
        """Stop opening, and stop every engine opened so far (the worker stops before serving)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for hosts in self.hosts.values():
            for host in hosts:
                with contextlib.suppress(RuntimeError):  # a thread host that never started: nothing runs
                    host.stop(1.0)

    async def _open_all(self) -> dict[str, list[EngineHost]]:
        started = time.monotonic()
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels (and so stops) the rest
                for config in self._configs:
                    for _ in range(config.instances):
                        group.create_task(self._open(config, started))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the model's own message, as a single engine gave it
        return self.hosts

    async def _open(self, config: ModelConfig, started: float) -> None:
        def note(step: str, model: str = config.name) -> None:
            self.steps[model] = step

        host = await self._open_engine(config, self._sinks[config.name], note)
        self.hosts[config.name].append(host)
        log.info("engine of %s ready, %.1f s after the worker began loading", config.name, time.monotonic() - started)
