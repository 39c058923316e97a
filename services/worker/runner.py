"""Runs an engine beside the event loop; the loop talks to it through queues only.

The model step is CPU/GPU-bound and must never block the asyncio loop that keeps the Kafka
clients alive (heartbeats, fetches, commits). EngineProcess runs it in a child process (the
default), EngineRunner on a thread of the worker (the echo engine, and WEIR_ENGINE_ISOLATION=thread).
Both drive the engine with the same loop (drive).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

from schemas.messages import EmbedRequest, GenerateRequest, now_ms
from services.worker.engine import EngineLike, EngineOutput

if TYPE_CHECKING:
    from schemas.model_repo import ModelConfig
    from services.worker.config import WorkerSettings

log = logging.getLogger(__name__)


class CommandQueue(Protocol):
    """Where an engine loop reads its commands: a queue.Queue (thread), or _Inbox (child process)."""

    def get(self, block: bool = True) -> tuple[str, object]: ...


def drive(engine: EngineLike, commands: CommandQueue, emit: Callable[[list[EngineOutput], dict[str, float]], None]) -> None:
    """The engine loop: apply every queued command (waiting for one while there is nothing to
    do), step, and emit the step's outputs with the engine's stats. Returns on a stop command."""
    while True:
        outputs: list[EngineOutput] = []
        if not _apply_commands(engine, commands, outputs, wait=not engine.has_work):
            return
        if engine.has_work:
            outputs.extend(engine.step(now_ms()))
        emit(outputs, engine.stats())


def _apply_commands(engine: EngineLike, commands: CommandQueue, outputs: list[EngineOutput], wait: bool) -> bool:
    """Apply every queued command; with `wait`, first block until one comes. False on stop."""
    while True:
        try:
            kind, arg = commands.get(block=wait)
        except queue.Empty:
            return True
        wait = False
        if kind == "stop":
            return False
        if kind == "add":
            out = engine.add(arg, now_ms())  # type: ignore[arg-type]
        else:
            out = engine.cancel(arg, now_ms())  # type: ignore[arg-type]
        if out is not None:
            outputs.append(out)


class _Host:
    """What a ModelServer sees of an engine, wherever it runs: submit and cancel from the event
    loop (never blocking), outputs handed to `on_outputs` on the loop, the engine's last stats,
    the requests in it, and a failure once it died."""

    def __init__(self, on_outputs: Callable[[list[EngineOutput]], None], weights_sha256: str,
                 stats: dict[str, float]) -> None:  # fmt: skip
        self._on_outputs = on_outputs
        self.weights_sha256 = weights_sha256
        self.stats = stats
        self.num_pending = 0  # requests submitted and not finished (read on the loop)
        self.failure: BaseException | None = None

    def submit(self, request: GenerateRequest | EmbedRequest) -> None:
        """Queue a request for the engine."""
        self.num_pending += 1
        self._send(("add", request))

    def cancel(self, request_id: str) -> None:
        """Ask the engine to abort a request."""
        self._send(("cancel", request_id))

    def _send(self, command: tuple[str, object]) -> None:
        raise NotImplementedError

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        self.num_pending -= sum(1 for o in outputs if o.is_final)
        self._on_outputs(outputs)


class EngineRunner(_Host):
    """One engine, one thread of this process.

    The engine's Python (scheduling, sampling, detokenizing) and the event loop's then share one
    GIL; EngineProcess avoids that for engines with real work.
    """

    def __init__(
        self, engine: EngineLike, loop: asyncio.AbstractEventLoop, on_outputs: Callable[[list[EngineOutput]], None]
    ) -> None:
        super().__init__(on_outputs, engine.weights_sha256, engine.stats())
        self.engine = engine
        self._loop = loop
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._send(("stop", None))
        self._thread.join(timeout_s)

    def _send(self, command: tuple[str, object]) -> None:
        self._inbox.put(command)  # thread-safe, never blocks

    def _run(self) -> None:
        try:
            drive(self.engine, self._inbox, self._emit)
        except BaseException as exc:  # device lost, or a bug: the process must not go on half-alive
            log.exception("engine thread died")
            self.failure = exc
            self._loop.call_soon_threadsafe(self._deliver, [])

    def _emit(self, outputs: list[EngineOutput], stats: dict[str, float]) -> None:
        self.stats = stats
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)


class EngineProcess(_Host):
    """One engine in a child process of its own, spoken to over two pipes.

    A model step is mostly torch (which drops the GIL) but also Python: scheduling, sampling,
    detokenizing. On a thread of the worker it takes turns on the GIL with the event loop that
    encodes and produces every token's delta; measured on this repository's default model, a
    sibling thread spending the loop's 140 us per token cut the engine from 1,308 to 1,002
    tokens/s at 16 sequences. vLLM v1 runs its EngineCore in a separate process for the same
    reason. The child is spawned (never forked: torch and CUDA do not survive a fork), builds and
    warms up its engine, then runs drive() as EngineRunner's thread does.

    The worker's side is the event loop itself, with no thread in between: the events pipe is
    an asyncio read pipe and the commands pipe an asyncio write pipe (never blocks the loop, so
    the two processes cannot deadlock on full pipes). Messages are multiprocessing.Connection
    frames (4-byte length, pickle), which the child reads and writes with plain Connections.
    The child stops when the worker closes the commands pipe or dies, even by kill -9
    (PR_SET_PDEATHSIG).
    """

    def __init__(
        self, config: ModelConfig, settings: WorkerSettings, device: str, loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[EngineOutput]], None], on_status: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(on_outputs, "", {})  # the hash and stats come with the child's "ready"
        self._on_status = on_status  # what the child is doing while it loads (the worker's /readyz)
        self._config = config
        self._settings = settings
        self._device = device
        self._loop = loop
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: asyncio.WriteTransport | None = None
        self._ready: asyncio.Future[tuple] = loop.create_future()
        self._is_stopping = False
        self.name = config.name

    async def open(self) -> None:
        """Spawn the child and return once its engine is built and warmed up.

        Raises ValueError with the child's own message when the engine cannot be built (a bad
        model directory, too small a KV cache): the worker refuses to start, as it would in-process.
        """
        context = multiprocessing.get_context("spawn")
        commands_out, commands_in = context.Pipe(duplex=False)[::-1]  # (writer, reader)
        events_out, events_in = context.Pipe(duplex=False)[::-1]
        self._process = context.Process(
            target=serve_engine,
            args=(self._config, self._settings, self._device, os.getpid(), commands_in, events_out),
            name=f"weir-engine-{self.name}", daemon=True,
        )  # fmt: skip
        self._process.start()  # from the loop's thread: PR_SET_PDEATHSIG follows the creating thread
        commands_in.close()  # the child's ends: closing ours lets each side see the other's EOF
        events_out.close()
        self._commands, _ = await self._loop.connect_write_pipe(asyncio.Protocol, commands_out)
        await self._loop.connect_read_pipe(lambda: _FrameReader(self._on_event, self._on_eof), events_in)
        kind, *rest = await self._ready
        if kind != "ready":
            raise ValueError(rest[0])
        self.weights_sha256, self.stats = rest

    def start(self) -> None:
        """Nothing to start: events are read by the loop since open()."""

    def stop(self, timeout_s: float = 5.0) -> None:
        self._is_stopping = True
        if self._process is None:
            return
        if self._commands is not None and self._process.is_alive():
            self._send(("stop", None))
            self._commands.close()  # flushes what is buffered, then the child reads EOF
            self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(1.0)

    def _send(self, command: tuple[str, object]) -> None:
        # Never blocks: the pipe transport buffers.
        if self._commands is None or self._commands.is_closing():
            return  # stopping, or the child is gone (failure says so)
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._commands.write(struct.pack("!i", len(payload)) + payload)

    def _on_event(self, event: tuple) -> None:
        kind, *rest = event
        if kind == "status":
            if self._on_status is not None:
                self._on_status(rest[0])
        elif kind == "out":
            outputs, self.stats = rest
            if outputs:
                self._deliver(outputs)
        elif not self._ready.done():
            self._ready.set_result(event)  # ("ready", ...) or ("error", message) while loading
        elif kind == "error":
            self._fail(RuntimeError(f"engine process of {self.name} failed: {rest[0]}"))

    def _on_eof(self) -> None:
        exitcode = self._process.exitcode if self._process is not None else None
        message = f"engine process of {self.name} exited (code {exitcode})"
        if not self._ready.done():
            self._ready.set_result(("error", f"{message} while loading"))
        elif not self._is_stopping and self.failure is None:
            self._fail(RuntimeError(message))

    def _fail(self, exc: BaseException) -> None:
        log.error("%s", exc)
        self.failure = exc
        self._deliver([])  # publish() sees the failure and stops the worker


class _FrameReader(asyncio.Protocol):
    """Splits a pipe's bytes into multiprocessing.Connection frames and unpickles each."""

    def __init__(self, on_message: Callable[[tuple], None], on_eof: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_eof = on_eof
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 4:
            (size,) = struct.unpack_from("!i", self._buffer)
            if size < 0:  # Connection's header of a frame over 2 GiB: never sent by the child
                raise ValueError("engine event frame over 2 GiB")
            if len(self._buffer) < 4 + size:
                return
            message = pickle.loads(self._buffer[4 : 4 + size])
            del self._buffer[: 4 + size]
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()


class _Inbox:
    """The child's end of the commands pipe, read the way drive() reads a queue."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def get(self, block: bool = True) -> tuple[str, object]:
        if not block and not self._connection.poll():
            raise queue.Empty
        try:
            return self._connection.recv()
        except EOFError:  # the worker closed the pipe, or is gone
            return ("stop", None)


def serve_engine(
    config: ModelConfig, settings: WorkerSettings, device: str, parent_pid: int,
    commands: Connection, events: Connection,
) -> None:  # fmt: skip
    """The engine child's main: build, warm up, say ready, then drive the engine until stopped."""
    _die_with_parent(parent_pid)
    # A Ctrl-C in a terminal reaches the whole process group: the worker stops this child through
    # the pipe, so the child ignores it rather than die with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine[{config.name}] %(levelname)s %(name)s: %(message)s")
    try:
        import torch

        from services.worker.engine_factory import build_engine, build_step, warm_up
        from services.worker.hardware import cpu_threads

        torch.set_num_threads(cpu_threads(settings.torch_threads))
        events.send(("status", build_step(config)))
        engine = build_engine(config, settings, torch.device(device))
        events.send(("status", "warming up"))
        warm_up(engine, config)
    except Exception as exc:  # noqa: BLE001 - reported to the worker, which refuses to start
        events.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    events.send(("ready", engine.weights_sha256, engine.stats()))
    try:
        drive(engine, _Inbox(commands), lambda outputs, stats: events.send(("out", outputs, stats)))
    except BaseException:  # device lost, or a bug: the worker stops rather than go on half-alive
        events.send(("error", traceback.format_exc(limit=8)))
        raise


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the worker dies, however it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the worker died before the line above
        os._exit(1)


EngineHost = EngineRunner | EngineProcess  # what a ModelServer drives
