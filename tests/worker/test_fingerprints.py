"""The worker's FingerprintBatcher: concurrent requests' texts fingerprinted together, off the hot
path. The fingerprints themselves are tested in tests/weir/embedding/test_fingerprints.py."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.kafka.fingerprints import FingerprintBatcher
from weir.embedding.fingerprints import TextFingerprinter


@pytest.mark.parametrize("precision", ["int8", "float32"])
async def test_batcher_fingerprints_concurrent_requests_together(
    precision: str, request: pytest.FixtureRequest
) -> None:
    fingerprinter: TextFingerprinter = request.getfixturevalue(
        "fingerprinter" if precision == "int8" else "fingerprinter_float32"
    )
    batcher = FingerprintBatcher(fingerprinter, max_texts=64, max_wait_ms=50)
    calls_before = fingerprinter.num_calls
    session_calls_before = fingerprinter.embedder.num_session_calls
    task = asyncio.create_task(batcher.run())
    try:
        pairs = [(f"prompt number {i}", f"output number {i}") for i in range(10)]
        results = await asyncio.gather(*(batcher.simhash(p, o) for p, o in pairs))
    finally:
        task.cancel()
    assert fingerprinter.num_calls - calls_before == 1  # 20 texts, one hand-over to the fingerprint thread
    # float32: one onnxruntime call for all 20; int8 runs each text alone (its activations are
    # quantized per call: docs/worker.md, "Fingerprints"), so a text hashes the same in any batch.
    assert fingerprinter.embedder.num_session_calls - session_calls_before == (20 if precision == "int8" else 1)
    assert results == [fingerprinter.simhash([p, o]) for p, o in pairs]


async def test_batcher_takes_what_is_queued_even_past_its_wait(fingerprinter: TextFingerprinter) -> None:
    # max_wait_ms=0 stands for a loop that stalled past the wait: what is queued still joins.
    batcher = FingerprintBatcher(fingerprinter, max_texts=64, max_wait_ms=0)
    calls_before = fingerprinter.num_calls
    task = asyncio.create_task(batcher.run())
    try:
        await asyncio.gather(*(batcher.simhash(f"prompt {i}", f"output {i}") for i in range(10)))
    finally:
        task.cancel()
    assert fingerprinter.num_calls - calls_before == 1
