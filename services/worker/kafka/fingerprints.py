"""Semantic fingerprints of finished requests, computed off the serving hot path, in batches.

The worker holds the text, so it fingerprints it (docs/design.md, invariant 7: text never leaves it).
A finished request's terminal reply goes out at once; its AuditEvent waits for the
FingerprintBatcher, which gathers the prompts and outputs of the requests that finished within a
few milliseconds and hands them, on its own thread, to the TextFingerprinter
(weir/embedding/fingerprints.py: all-MiniLM-L6-v2 through the same ONNX export and embedding code
as /v1/embeddings, then a 64-bit SimHash from schemas/fingerprint.py; the auditor's lookups use the
same one). The batch offset is committed only after the AuditEvent is durable, as before.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from weir.embedding.fingerprints import TextFingerprinter


class FingerprintBatcher:
    """Gathers (prompt, output) pairs for up to `max_wait_ms` or `max_texts`, fingerprints them together."""

    def __init__(self, fingerprinter: TextFingerprinter, max_texts: int = 64, max_wait_ms: float = 20.0) -> None:
        self.fingerprinter = fingerprinter
        self.model = fingerprinter.model
        self.max_texts = max_texts
        self.max_wait_s = max_wait_ms / 1000
        self._queue: asyncio.Queue[tuple[list[str], asyncio.Future[list[str]]]] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fingerprint")

    async def simhash(self, *texts: str) -> list[str]:
        """The SimHashes of `texts`, once their batch ran (called by the worker per finished request)."""
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((list(texts), future))
        return await future

    async def run(self) -> None:
        """Serve batches until cancelled (one task per worker process)."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.max_wait_s
            while sum(len(t) for t, _ in batch) < self.max_texts:
                if not self._queue.empty():  # already here: joins even past the deadline (a stalled loop)
                    batch.append(self._queue.get_nowait())
                    continue
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), remaining_s))
                except TimeoutError:
                    break
            texts = [text for item, _ in batch for text in item]
            try:
                hashes = await loop.run_in_executor(self._executor, self.fingerprinter.simhash, texts)
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the failure, serving goes on
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            start = 0
            for item, future in batch:
                if not future.done():
                    future.set_result(hashes[start : start + len(item)])
                start += len(item)
