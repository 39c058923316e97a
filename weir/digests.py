"""sha256 of files, remembered by the files' identity so that unchanged weights are not re-read at
every start.

Every start of a worker hashes each model's weights (their sha256 names the weights in every
audit record) and the embedding model's source (to know its ONNX export is current), twice for
that one: in the worker, for its fingerprints, and in the engine's process. The same bytes, every
time. A cache entry is keyed on the files' real paths and holds each file's device, inode, size,
mtime and ctime in nanoseconds: a write changes mtime and ctime, and ctime cannot be set back by
a user, so a file that changed is hashed again. The cache is $WEIR_HOME/cache/sha256.json,
replaced atomically; two processes writing at once lose one entry, which costs one re-hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from weir.home import weir_home

CACHE_FILE = Path("cache") / "sha256.json"  # under $WEIR_HOME


def _identity(path: Path) -> list[int]:
    info = path.stat()
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def cached_sha256(files: Sequence[Path], cache: Path | None = None, min_age_s: float = 2.0) -> str:
    """sha256 (hex) of the files' bytes, one after another; read from the cache when no file
    changed since it was stored there, else computed, and stored when every file is older than
    `min_age_s`: the kernel stamps times at a clock tick of some milliseconds, so a file written
    again within the tick of its last change could keep its times (git's "racily clean" entries)."""
    cache = cache if cache is not None else weir_home() / CACHE_FILE
    key = "\n".join(str(Path(f).resolve()) for f in files)
    identity = [_identity(Path(f)) for f in files]
    entries = _load(cache)
    found = entries.get(key)
    if isinstance(found, dict) and found.get("identity") == identity and isinstance(found.get("sha256"), str):
        return str(found["sha256"])
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    newest_ns = max((max(i[3], i[4]) for i in identity), default=0)
    is_settled = time.time_ns() - newest_ns > min_age_s * 1e9
    if is_settled and [_identity(Path(f)) for f in files] == identity:  # unchanged while read: safe to remember
        entries = _load(cache)
        entries[key] = {"identity": identity, "sha256": digest.hexdigest()}
        _store(cache, entries)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 (hex) of one file's bytes, through the cache."""
    return cached_sha256([path])


def _load(cache: Path) -> dict[str, object]:
    try:
        entries = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _store(cache: Path, entries: dict[str, object]) -> None:
    # Files that are gone (a test's temporary model, an old export) leave the cache.
    entries = {key: value for key, value in entries.items() if all(Path(p).exists() for p in key.split("\n"))}
    with contextlib.suppress(OSError):  # a read-only home: no cache, only the cost of hashing
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(staging, cache)
