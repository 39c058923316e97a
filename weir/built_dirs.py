"""Directories built once and put in place whole: a GGUF import (weir/models/gguf_import.py) and
an ONNX export (weir/embedding/onnx_export.py).

A build is written into a temporary directory beside its target and renamed into place, so a reader
never sees half of one and a failed build leaves nothing behind. Builds of one target take a lock
file beside it: at a first start two processes (the worker's fingerprinter and its engine's
process; `weir models prepare` and a worker) ask for the same build, and the second waits, then
finds the first one's result current instead of spending the same minute of CPU again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """Hold the build lock of `out` (a file beside it) while the block runs."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_into(out: Path, write: Callable[[Path], None], is_current: Callable[[Path], bool]) -> None:
    """Run `write(tmp)` on an empty directory beside `out`, then swap it in for whatever `out` held.

    A rename that fails because another process put its build in place first is fine when that
    build `is_current`; otherwise the error stands.
    """
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    old = out.parent / f".{out.name}.{os.getpid()}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if out.exists():
            os.replace(out, old)  # a stale build (or an empty dir): moved aside, then removed
        try:
            os.replace(tmp, out)
        except OSError:
            if not is_current(out):
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
