"""The grammar compile process (grammar.py, Grammars): compiles specs one at a time and returns
each CompiledGrammar's serialize_json() text, so that a compile that runs too long or too large
can be killed without harming the engine.

    python -m services.worker.engine.grammar_child READ_FD WRITE_FD PARENT_PID MEMORY_BYTES

The first message is (model_path, vocab_size, stop_ids); the child answers ("ready", "") once its
compiler is built, then one reply per spec: ("ok", json) or (error code, message). It runs at
nice 10 (the engine's step comes first), with its address space bounded to MEMORY_BYTES beyond
what its imports map (a MemoryError is answered as grammar_too_complex; a crash is seen by the
parent as the pipe's end), and dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path


def main(argv: list[str]) -> None:
    read_fd, write_fd, parent_pid, memory_bytes = (int(a) for a in argv)
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent stops us
    os.nice(10)
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    model_path, vocab_size, stop_ids = inbox.recv()
    try:
        import xgrammar as xgr

        from schemas.messages import StructuredOutputs
        from services.worker.engine.grammar import tokenizer_info

        info = tokenizer_info(Path(model_path), vocab_size, stop_ids)
        # our LRU (in the parent) is the cache; xgrammar's own would grow without bound
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        _bound_memory(memory_bytes)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the spec
        outbox.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    outbox.send(("ready", ""))
    while True:
        try:
            spec = StructuredOutputs.model_validate(inbox.recv())
        except EOFError:  # the parent closed the pipe or is gone
            return
        outbox.send(_compiled(compiler, spec, memory_bytes))


def _compiled(compiler, spec, memory_bytes: int) -> tuple[str, str]:
    """("ok", the serialized grammar) or (error code, message)."""
    from services.worker.engine.grammar import GrammarError, compile_spec

    try:
        return ("ok", _serialized(compile_spec(compiler, spec)))
    except GrammarError as exc:
        return (exc.code, str(exc))
    except MemoryError:
        return ("grammar_too_complex", f"the constraint's compile ran out of memory ({memory_bytes >> 20} MiB)")
    except Exception as exc:  # noqa: BLE001 - this spec fails, the child goes on
        return ("grammar_error", f"{type(exc).__name__}: {exc}")


def _serialized(compiled) -> str:
    try:
        return compiled.serialize_json()
    except RuntimeError as exc:  # xgrammar's C++ std::bad_alloc under RLIMIT_AS
        if "bad_alloc" in str(exc):
            raise MemoryError from exc
        raise


def _bound_memory(memory_bytes: int) -> None:
    """RLIMIT_AS at what is mapped now plus `memory_bytes` (the imports map ~3 GiB, mostly reserved)."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the engine dies, however it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the engine died before the line above
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
