"""The worker's FingerprintBatcher: concurrent requests' texts fingerprinted together, off the hot
path. The fingerprints themselves are tested in tests/weir/embedding/test_fingerprints.py."""

from __future__ import annotations

import asyncio

from services.worker.kafka.fingerprints import FingerprintBatcher
from weir.embedding.fingerprints import TextFingerprinter


async def test_batcher_fingerprints_concurrent_requests_together(fingerprinter: TextFingerprinter) -> None:
    batcher = FingerprintBatcher(fingerprinter, max_texts=64, max_wait_ms=50)
    calls_before = fingerprinter.embedder.num_session_calls
    task = asyncio.create_task(batcher.run())
    try:
        pairs = [(f"prompt number {i}", f"output number {i}") for i in range(10)]
        results = await asyncio.gather(*(batcher.simhash(p, o) for p, o in pairs))
    finally:
        task.cancel()
    assert fingerprinter.embedder.num_session_calls - calls_before == 1  # 20 texts, one onnxruntime call
    assert results == [fingerprinter.simhash([p, o]) for p, o in pairs]


async def test_batcher_takes_what_is_queued_even_past_its_wait(fingerprinter: TextFingerprinter) -> None:
    # max_wait_ms=0 stands for a loop that stalled past the wait: what is queued still joins.
    batcher = FingerprintBatcher(fingerprinter, max_texts=64, max_wait_ms=0)
    calls_before = fingerprinter.embedder.num_session_calls
    task = asyncio.create_task(batcher.run())
    try:
        await asyncio.gather(*(batcher.simhash(f"prompt {i}", f"output {i}") for i in range(10)))
    finally:
        task.cancel()
    assert fingerprinter.embedder.num_session_calls - calls_before == 1
