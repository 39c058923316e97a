"""Runs an engine beside the event loop; the loop talks to it through queues only.

The model step is CPU/GPU-bound and must never block the asyncio loop that keeps the Kafka
clients alive (heartbeats, fetches, commits). EngineProcess runs it in a child process (the
default), EngineRunner on a thread of the worker (the echo engine, and WEIR_ENGINE_ISOLATION=thread).
Both drive the engine with the same loop (drive), which also runs golden checks between steps
(services/worker/hosts/goldens.py) and the fault hook (services/worker/hosts/faults.py) when asked.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
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
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

from schemas.messages import EmbedRequest, GenerateRequest, now_ms
from schemas.registry import GoldenCase
from services.worker.engine import EngineLike, EngineOutput
from services.worker.hosts.faults import FaultHookError, corrupt
from services.worker.hosts.goldens import GoldenChecks
from services.worker.hosts.hardware import engine_label
from services.worker.hosts.memory import engine_used_bytes
from services.worker.hosts.mirror_pacing import PRESSURE, LivePressure, MirrorPacer, Pacing
from weir.heap import freeze_heap
from weir.supervision import describe_exit

if TYPE_CHECKING:
    from schemas.model_repo import ModelConfig
    from services.worker.config import WorkerSettings

log = logging.getLogger(__name__)


class CommandQueue(Protocol):
    """Where an engine loop reads its commands: a queue.Queue (thread), or _Inbox (child process)."""

    def get(self, block: bool = True, timeout: float | None = None) -> tuple[str, object]: ...


Answer = Callable[[int, bool, object], None]  # (token of the question, ok, result or error message)


def drive(
    engine: EngineLike,
    commands: CommandQueue,
    emit: Callable[[list[EngineOutput], dict[str, float]], None],
    answer: Answer,
    pacing: Pacing | None = None,
) -> None:
    """The engine loop: apply every queued command (waiting for one while there is nothing to
    do), step, and emit the step's outputs with the engine's stats. Returns on a stop command.

    Golden checks step beside the clients' sequences (each sequence samples from its own
    generator, so they change no client's tokens); their outputs are taken out before emit, so
    they never reach a reply topic, and `answer` hears each check's result. While live work runs
    elsewhere in the worker, an engine holding only mirror copies steps at most every
    `pacing.yield_ms` and drops copies held too long (mirror_pacing.py)."""
    goldens = GoldenChecks(engine, answer)
    pacer = MirrorPacer(pacing or Pacing(), lambda: goldens.is_running)
    while True:
        outputs: list[EngineOutput] = []
        pause_s = pacer.wait_s(now_ms()) if engine.has_work else None  # None: nothing to do but wait
        if not _apply_commands(engine, commands, outputs, goldens, answer, pacer, pause_s):
            return
        now = now_ms()
        if engine.has_work and pacer.may_step(now):
            outputs.extend(engine.step(now))
        outputs.extend(pacer.drop_expired(engine, now))
        pacer.ended(outputs)
        emit(goldens.take(outputs), engine.stats())


def _apply_commands(
    engine: EngineLike,
    commands: CommandQueue,
    outputs: list[EngineOutput],
    goldens: GoldenChecks,
    answer: Answer,
    pacer: MirrorPacer,
    wait_s: float | None,
) -> bool:
    """Apply every queued command; first wait up to `wait_s` for one (None: until one comes).
    False on stop."""
    wait = wait_s is None or wait_s > 0
    while True:
        try:
            kind, arg = commands.get(block=wait, timeout=wait_s if wait else None)
        except queue.Empty:
            return True
        wait = False
        out = None
        if kind == "stop":
            return False
        if kind == "add":
            pacer.added(arg, now_ms())  # type: ignore[arg-type]  # the command's kind types its arg
            out = engine.add(arg, now_ms())  # type: ignore[arg-type]  # the command's kind types its arg
        elif kind == PRESSURE:
            pacer.is_pressed = bool(arg)
        elif kind == "cancel":
            out = engine.cancel(arg, now_ms())  # type: ignore[arg-type]  # the command's kind types its arg
        elif kind == "golden":
            goldens.start(*arg)  # type: ignore[misc]  # (token, cases)
        elif kind == "record":
            goldens.record(*arg)  # type: ignore[misc]  # (token, (prompts, max_tokens))
        elif kind == "corrupt":
            _corrupt(engine, arg, answer)  # type: ignore[arg-type]  # the command's kind types its arg
        if out is not None:
            outputs.append(out)


def _corrupt(engine: EngineLike, token: int, answer: Answer) -> None:
    try:
        answer(token, True, corrupt(engine))
    except FaultHookError as exc:
        answer(token, False, str(exc))


class _Host:
    """What a ModelServer sees of an engine, wherever it runs: submit and cancel from the event
    loop (never blocking), outputs handed to `on_outputs` on the loop, the engine's last stats,
    the requests in it, and a failure once it died. Golden checks and the fault hook are asked
    of the engine's own loop and answered on the event loop.

    `engine_label` is the runtime actually in use ('torch-cpu', 'onnxruntime-cuda'...: what
    heartbeats report as VersionStatus.engine), `used_bytes()` the memory the engine holds.
    With a LivePressure attached (`attach_pressure`), the live requests it runs count there and
    the engine hears when live work runs in the process (services/worker/hosts/mirror_pacing.py)."""

    def __init__(
        self,
        on_outputs: Callable[[list[EngineOutput]], None],
        weights_sha256: str,
        stats: dict[str, float],
        fault_hooks: bool,
    ) -> None:
        self._on_outputs = on_outputs
        self.weights_sha256 = weights_sha256
        self.stats = stats
        self.num_pending = 0  # requests submitted and not finished (read on the loop)
        self.failure: BaseException | None = None
        self.engine_label = ""
        self._used_bytes = 0
        self.fault_hooks = fault_hooks
        self._tokens = itertools.count()
        self._questions: dict[int, asyncio.Future[tuple[bool, object]]] = {}
        self._pressure: LivePressure | None = None
        self._live: Counter[str] = Counter()  # live (not mirror) requests submitted and not ended
        self.num_mirrors_dropped = 0  # copies the engine ended as mirror_dropped (held back too long)

    def attach_pressure(self, pressure: LivePressure) -> None:
        self._pressure = pressure
        pressure.attach(self)

    def press(self, is_pressed: bool) -> None:
        """Tell the engine whether live work runs in this worker process (LivePressure calls it)."""
        self._send((PRESSURE, is_pressed))

    def _release_pressure(self) -> None:
        """The engine stops: what it held no longer presses, and it hears nothing more."""
        if self._pressure is not None:
            self._pressure.detach(self)
            self._pressure.ended(sum(self._live.values()))
            self._live.clear()
            self._pressure = None

    def used_bytes(self) -> int:
        """Bytes the engine holds: weights as loaded plus its KV cache (services/worker/hosts/memory.py)."""
        return self._used_bytes

    async def check_goldens(self, cases: list[GoldenCase]) -> str | None:
        """Run `cases` in the engine, between its steps, while it keeps serving: the first
        problem (naming the case, expected vs got), or None when every case passed."""
        if not cases:
            return None
        problem = await self._ask("golden", cases)
        assert problem is None or isinstance(problem, str)
        return problem

    async def record_goldens(self, prompts: list[str], max_tokens: int) -> list[GoldenCase]:
        """Record goldens of `prompts` in the engine, as `weir models push` does (greedy, between its
        steps): for a version registered without goldens, on the device that serves it."""
        cases = await self._ask("record", (prompts, max_tokens))
        assert isinstance(cases, list)
        return cases

    async def corrupt_weights(self) -> None:
        """The fault hook: perturb the engine's weights in memory (services/worker/hosts/faults.py).
        FaultHookError unless WorkerSettings.fault_hooks (WEIR_FAULT_HOOKS) is set."""
        if not self.fault_hooks:
            raise FaultHookError("fault hooks are off: set WEIR_FAULT_HOOKS=1 to allow corrupting weights")
        done = await self._ask("corrupt", None)
        log.warning("fault hook: %s", done)

    async def _ask(self, kind: str, arg: object) -> object:
        if self.failure is not None:
            raise RuntimeError(f"the engine has failed: {self.failure}")
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._questions[token] = future
        self._send((kind, token if arg is None else (token, arg)))
        try:
            ok, value = await future
        finally:
            self._questions.pop(token, None)
        if not ok:
            raise FaultHookError(str(value)) if kind == "corrupt" else RuntimeError(str(value))
        return value

    def _on_answer(self, token: int, ok: bool, value: object) -> None:
        future = self._questions.get(token)
        if future is not None and not future.done():
            future.set_result((ok, value))

    def _fail_questions(self, why: str | None = None) -> None:
        """End every question in flight: the engine that would answer is gone."""
        for future in self._questions.values():
            if not future.done():
                future.set_exception(RuntimeError(why or f"the engine has failed: {self.failure}"))

    def submit(self, request: GenerateRequest | EmbedRequest) -> None:
        """Queue a request for the engine."""
        self.num_pending += 1
        if self._pressure is not None and request.shadow_of is None:
            self._live[request.request_id] += 1
            self._pressure.started()
        self._send(("add", request))

    def cancel(self, request_id: str) -> None:
        """Ask the engine to abort a request."""
        self._send(("cancel", request_id))

    def _send(self, command: tuple[str, object]) -> None:
        raise NotImplementedError

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        self.num_pending -= sum(1 for o in outputs if o.is_final)
        self.num_mirrors_dropped += sum(1 for o in outputs if o.error is not None and o.error.code == "mirror_dropped")
        ended = [o.request_id for o in outputs if o.is_final and self._live[o.request_id] > 0]
        for rid in ended:
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
        if ended and self._pressure is not None:
            self._pressure.ended(len(ended))
        self._on_outputs(outputs)


class EngineRunner(_Host):
    """One engine, one thread of this process.

    The engine's Python (scheduling, sampling, detokenizing) and the event loop's then share one
    GIL; EngineProcess avoids that for engines with real work.
    """

    def __init__(
        self,
        engine: EngineLike,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[EngineOutput]], None],
        fault_hooks: bool = False,
        pacing: Pacing | None = None,
    ) -> None:
        super().__init__(on_outputs, engine.weights_sha256, engine.stats(), fault_hooks)
        self.engine = engine
        self.pacing = pacing
        self.engine_label = engine_label(engine)
        self._used_bytes = engine_used_bytes(engine)
        self._loop = loop
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._release_pressure()
        self._send(("stop", None))
        self._thread.join(timeout_s)
        self._fail_questions("the engine was stopped")

    def _send(self, command: tuple[str, object]) -> None:
        self._inbox.put(command)  # thread-safe, never blocks

    def _run(self) -> None:
        try:
            drive(self.engine, self._inbox, self._emit, self._answer, self.pacing)
        except BaseException as exc:  # device lost, or a bug: the process must not go on half-alive
            log.exception("engine thread died")
            self.failure = exc
            self._loop.call_soon_threadsafe(self._fail_questions)
            self._loop.call_soon_threadsafe(self._deliver, [])

    def _answer(self, token: int, ok: bool, value: object) -> None:
        self._loop.call_soon_threadsafe(self._on_answer, token, ok, value)

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
        self,
        config: ModelConfig,
        settings: WorkerSettings,
        device: str,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[EngineOutput]], None],
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(on_outputs, "", {}, settings.fault_hooks)  # the rest comes with the child's "ready"
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
            name=f"weir-engine-{self.name}",
            daemon=True,
        )
        self._process.start()  # from the loop's thread: PR_SET_PDEATHSIG follows the creating thread
        commands_in.close()  # the child's ends: closing ours lets each side see the other's EOF
        events_out.close()
        self._commands, _ = await self._loop.connect_write_pipe(asyncio.Protocol, commands_out)
        await self._loop.connect_read_pipe(lambda: _FrameReader(self._on_event, self._on_eof), events_in)
        kind, *rest = await self._ready
        if kind != "ready":
            raise ValueError(rest[0])
        self.weights_sha256, self.stats, self.engine_label, self._used_bytes = rest

    def start(self) -> None:
        """Nothing to start: events are read by the loop since open()."""

    def stop(self, timeout_s: float = 5.0) -> None:
        self._is_stopping = True
        self._release_pressure()
        self._fail_questions("the engine was stopped")
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
        elif kind == "answer":
            self._on_answer(*rest)
        elif not self._ready.done():
            self._ready.set_result(event)  # ("ready", ...) or ("error", message) while loading
        elif kind == "error":
            self._fail(RuntimeError(f"engine process of {self.name} failed: {rest[0]}"))

    def _on_eof(self) -> None:
        if self._process is not None:  # its pipe closes just before it is reaped: wait for the code (was "None")
            self._process.join(1.0)
        exitcode = self._process.exitcode if self._process is not None else None
        message = f"engine process of {self.name} exited ({describe_exit(exitcode)})"  # e.g. killed by SIGKILL
        if not self._ready.done():
            self._ready.set_result(("error", f"{message} while loading"))
        elif not self._is_stopping and self.failure is None:
            self._fail(RuntimeError(message))

    def _fail(self, exc: BaseException) -> None:
        log.error("%s", exc)
        self.failure = exc
        self._fail_questions()
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

    def get(self, block: bool = True, timeout: float | None = None) -> tuple[str, object]:
        if (not block or timeout is not None) and not self._connection.poll(timeout if block else 0):
            raise queue.Empty
        try:
            return self._connection.recv()
        except EOFError:  # the worker closed the pipe, or is gone
            return ("stop", None)


def serve_engine(
    config: ModelConfig,
    settings: WorkerSettings,
    device: str,
    parent_pid: int,
    commands: Connection,
    events: Connection,
) -> None:
    """The engine child's main: build, warm up, say ready, then drive the engine until stopped."""
    _die_with_parent(parent_pid)
    # A Ctrl-C in a terminal reaches the whole process group: the worker stops this child through
    # the pipe, so the child ignores it rather than die with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s engine[{config.name}] %(levelname)s %(name)s: %(message)s"
    )
    try:
        import torch

        from services.worker.hosts.engine_factory import build_engine, build_step, warm_up
        from services.worker.hosts.hardware import cpu_threads, engine_label
        from services.worker.hosts.memory import engine_used_bytes

        torch.set_num_threads(cpu_threads(settings.threads))
        logging.getLogger(__name__).info(
            "engine threads: %d (WEIR_ENGINE_THREADS=%s, %d cores)",
            torch.get_num_threads(),
            settings.threads or "0: default",
            os.cpu_count() or 1,
        )
        events.send(("status", build_step(config)))
        engine = build_engine(config, settings, torch.device(device))
        events.send(("status", "warming up"))
        warm_up(engine, config, settings.grammar_prewarm)
        freeze_heap(f"engine of {config.name}")
    except Exception as exc:  # noqa: BLE001 - reported to the worker, which refuses to start
        events.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    events.send(("ready", engine.weights_sha256, engine.stats(), engine_label(engine), engine_used_bytes(engine)))
    try:
        drive(
            engine,
            _Inbox(commands),
            lambda outputs, stats: events.send(("out", outputs, stats)),
            lambda token, ok, value: events.send(("answer", token, ok, value)),
            Pacing.of(settings),
        )
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
