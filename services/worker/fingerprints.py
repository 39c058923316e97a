"""Semantic fingerprints of finished requests, computed off the serving hot path, in batches.

The worker holds the text, so it fingerprints it (DESIGN.md, invariant 7: text never leaves it).
A finished request's terminal reply goes out at once; its AuditEvent waits for the
FingerprintBatcher, which gathers the prompts and outputs of the requests that finished within a
few milliseconds, embeds them in one call of the all-MiniLM-L6-v2 EmbeddingEngine (the same
ONNX export and onnxruntime session code as /v1/embeddings) on its own thread, and turns each
embedding into a 64-bit SimHash (schemas/fingerprint.py). The batch offset is committed only
after the AuditEvent is durable, as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from schemas.fingerprint import FINGERPRINT_MODEL, simhashes
from schemas.messages import MAX_EMBED_INPUTS, EmbedRequest, now_ms
from schemas.model_repo import ModelRepository
from services.worker.embedder import EmbeddingEngine
from services.worker.onnx_export import ensure_export

log = logging.getLogger(__name__)


class TextFingerprinter:
    """Texts -> SimHashes through an EmbeddingEngine; synchronous (the batcher's thread calls it)."""

    model = FINGERPRINT_MODEL

    def __init__(self, engine: EmbeddingEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()
        self.busy_s = 0.0  # seconds spent fingerprinting, for the benchmark
        self.num_texts = 0

    def simhash(self, texts: list[str]) -> list[str]:
        """The SimHash of each text, in order (empty texts included).

        Texts run in groups of similar length: a session call pads to its longest text, and a
        batch mixes short prompts with long outputs.
        """
        started = time.perf_counter()
        result: list[str] = [""] * len(texts)
        for group in _length_groups(texts):
            for index, value in zip(group, self._simhash_group([texts[i] for i in group]), strict=True):
                result[index] = value
        self.busy_s += time.perf_counter() - started
        self.num_texts += len(texts)
        return result

    def _simhash_group(self, texts: list[str]) -> list[str]:
        result: list[str] = []
        for start in range(0, len(texts), MAX_EMBED_INPUTS):
            chunk = texts[start : start + MAX_EMBED_INPUTS]
            request = EmbedRequest(request_id=f"fingerprint-{next(self._ids)}", model="fingerprint", inputs=chunk,
                                   deadline_ms=now_ms() + 3_600_000, reply_to="-")  # fmt: skip
            final = self.engine.add(request, now_ms())
            while final is None:
                final = next((o for o in self.engine.step(now_ms()) if o.is_final), None)
            if final.embeddings is None:
                raise RuntimeError(f"fingerprint embedding failed: {final.error}")
            result += simhashes(final.embeddings)
        return result


def _length_groups(texts: list[str]) -> list[list[int]]:
    """Indices of `texts` by length, cut where a text is over twice (+64 chars) the group's shortest."""
    groups: list[list[int]] = []
    for index in sorted(range(len(texts)), key=lambda i: len(texts[i])):
        if groups and len(texts[index]) <= 2 * len(texts[groups[-1][0]]) + 64:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


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
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(deadline - loop.time(), 0)))
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


def build_fingerprinter(model_name: str, repo: ModelRepository, num_threads: int = 1) -> TextFingerprinter | None:
    """The fingerprinter over the repository's `model_name` (an onnx embedding model), or None
    (with one log line saying why) when it is switched off or cannot load."""
    if not model_name:
        return None
    config = repo.models.get(model_name)
    if config is None or config.engine != "onnx":
        log.warning("no onnx model %r in the model repository: AuditEvents carry no SimHash", model_name)
        return None
    try:
        engine = EmbeddingEngine(ensure_export(config), max_model_len=config.max_model_len, num_threads=num_threads)
    except Exception as exc:  # noqa: BLE001 - fingerprints are optional; the HMACs still go out
        log.warning("fingerprint model %s cannot load (%s): AuditEvents carry no SimHash", model_name, exc)
        return None
    return TextFingerprinter(engine)
