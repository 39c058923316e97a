"""weir/digests.py: file sha256s remembered by file identity, recomputed when a file changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from weir.digests import cached_sha256, file_sha256


def test_the_digest_is_sha256_of_the_bytes_in_order(tmp_path: Path) -> None:
    a, b, cache = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "cache.json"
    a.write_bytes(b"first" * 1000)
    b.write_bytes(b"second")
    assert cached_sha256([a, b], cache) == hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest()
    assert cached_sha256([a], cache) == hashlib.sha256(a.read_bytes()).hexdigest()


def test_a_remembered_digest_is_used_until_the_file_changes(tmp_path: Path) -> None:
    weights, cache = tmp_path / "model.safetensors", tmp_path / "cache.json"
    weights.write_bytes(b"a" * 4096)
    first = cached_sha256([weights], cache, min_age_s=0)
    stored = json.loads(cache.read_text())
    assert [entry["sha256"] for entry in stored.values()] == [first]
    # The cache, not the bytes, answers now: a planted digest for the same identity comes back.
    (entry,) = stored.values()
    entry["sha256"] = "f" * 64
    cache.write_text(json.dumps(stored))
    assert cached_sha256([weights], cache, min_age_s=0) == "f" * 64
    weights.write_bytes(b"b" * 4097)
    assert cached_sha256([weights], cache, min_age_s=0) == hashlib.sha256(b"b" * 4097).hexdigest()


def test_a_file_written_a_moment_ago_is_hashed_but_not_remembered(tmp_path: Path) -> None:
    weights, cache = tmp_path / "model.safetensors", tmp_path / "cache.json"
    weights.write_bytes(b"fresh")
    assert cached_sha256([weights], cache, min_age_s=3600) == hashlib.sha256(b"fresh").hexdigest()
    assert not cache.exists()


def test_files_that_are_gone_leave_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WEIR_HOME", str(tmp_path / "home"))
    old, new = tmp_path / "old.bin", tmp_path / "new.bin"
    old.write_bytes(b"old")
    new.write_bytes(b"new")
    cached_sha256([old], min_age_s=0)
    old.unlink()
    assert cached_sha256([new], min_age_s=0) == file_sha256(new) == hashlib.sha256(b"new").hexdigest()
    keys = list(json.loads((tmp_path / "home" / "cache" / "sha256.json").read_text()))
    assert keys == [str(new.resolve())]
