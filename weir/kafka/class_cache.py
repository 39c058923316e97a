"""The broker JVM's class-data sharing (CDS) archive: Kafka's classes parsed and verified once,
then mapped from a file at every later start.

The broker loads some thousands of classes from its 45 jars at every start, the same ones each
time. The first start that finds no archive runs with -XX:ArchiveClassesAtExit and writes one
when it stops cleanly (into its own data dir, then moved next to the jars once the JVM has exited,
so an interrupted dump is never used); later starts map it with -XX:SharedArchiveFile. Measured on
the development machine (2 busy cores), from the JVM's launch to the broker's port open: 13-19 s
without, 9.4-14 s with. An archive is only valid for the JVM and jars that made it: its name
carries the java binary's identity, the jars are per Kafka version, and a JVM that finds it
unusable says so in the broker log and starts without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

ARCHIVE_PARTIAL = "classes.jsa.partial"  # in the broker's data dir while its JVM may write it
# The dump reports each class it cannot archive (old class file versions of slf4j, ...) at warning
# level: noise in the broker log, once.
QUIET = "-Xlog:cds=off,cds+dynamic=off"


def archive_path(lib: Path, java: str) -> Path:
    """Where the archive of the jars in `lib` for the JVM `java` is kept (beside `lib`)."""
    real = Path(java).resolve()
    info = real.stat()
    ident = hashlib.sha256(f"{real}:{info.st_size}:{info.st_mtime_ns}".encode()).hexdigest()[:12]
    return lib.parent / f"classes-{ident}.jsa"


def jvm_options(data_dir: Path, lib: Path, java: str) -> list[str]:
    """Map the archive when there is one; else ask this JVM to write one when it exits."""
    final = archive_path(lib, java)
    if final.is_file():
        return [f"-XX:SharedArchiveFile={final}", QUIET]
    return [f"-XX:ArchiveClassesAtExit={data_dir / ARCHIVE_PARTIAL}", QUIET]


def keep_archive(data_dir: Path, lib: Path, java: str, is_clean_exit: bool) -> None:
    """After the broker's JVM has exited: keep what it dumped when it stopped cleanly (a SIGKILL
    may have cut the dump short), else drop it."""
    partial = data_dir / ARCHIVE_PARTIAL
    if not partial.exists():
        return
    with contextlib.suppress(OSError):
        final = archive_path(lib, java)
        if is_clean_exit and partial.stat().st_size > 0 and not final.exists():
            os.replace(partial, final)  # atomic: a starting broker sees all of it or none
            return
        partial.unlink()
