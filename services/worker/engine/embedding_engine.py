"""The embedding engine: a sentence encoder exported to ONNX, run with onnxruntime, batched dynamically.

    add(request)   tokenize each input; split it into fragments that fit the model's window
    step()         one session call over the queued fragments of every request (padded to the
                   longest), then pool: fragments -> inputs -> L2-normalised vectors

Same contract as Engine and EchoEngine (contract.py: add, cancel, step, has_work, stats,
weights_sha256), so the worker's runner (services/worker/hosts/runner.py) drives it like any engine. The
embedding math (tokenizer, fragments, session, pooling) is weir/embedding/embedder.py's
SentenceEmbedder, shared with the audit fingerprints; this module is what serving adds to it:
request queue, round-robin batches, cancels and deadlines.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas import context_length
from schemas.messages import EmbedRequest, ErrorInfo, FinishReason, GenerateRequest
from services.worker.engine.sequence import EngineOutput
from weir.embedding.embedder import DEFAULT_MAX_BATCH_FRAGMENTS, SentenceEmbedder, as_json_floats, pool

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One EmbedRequest in the engine: its fragments still to run and the pooled sums so far."""

    request: EmbedRequest
    received_ms: int
    pending: deque[tuple[int, list[int]]]  # (input index, fragment ids with [CLS]/[SEP])
    sums: np.ndarray  # [num_inputs, dim] float64: token-count-weighted sum of fragment means
    num_tokens: np.ndarray  # [num_inputs] tokens embedded so far per input
    total_tokens: int = 0


class EmbeddingEngine:
    """Serves one embedding model: add EmbedRequests, step, read terminal events with vectors."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int = 8192,
        max_num_seqs: int = 64,
        max_batch_fragments: int = DEFAULT_MAX_BATCH_FRAGMENTS,
        max_batch_tokens: int | None = None,
        use_cuda: bool = False,
        num_threads: int = 0,
        dimensions: int | None = None,
        max_fragment_tokens: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.embedder = SentenceEmbedder(
            model_dir, use_cuda=use_cuda, num_threads=num_threads, max_fragment_tokens=max_fragment_tokens
        )
        self.window = self.embedder.window
        self.dimensions = self.embedder.dimensions
        if dimensions is not None and dimensions != self.dimensions:
            raise ValueError(
                f"{dimensions=} in the model repository, but {model_dir} makes {self.dimensions}-d vectors"
            )
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_batch_fragments = max_batch_fragments
        self.tokenizer = self.embedder.tokenizer
        self.provider = self.embedder.provider
        self.max_batch_tokens = max_batch_tokens or self.embedder.default_max_batch_tokens
        if self.max_batch_tokens < self.window:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} must be >= the window ({self.window} tokens)")
        self.weights_sha256 = self.embedder.weights_sha256
        self._jobs: dict[str, _Job] = {}  # insertion order = arrival order, for round-robin
        # The fault hook (services/worker/hosts/faults.py): added to every fragment's vector when set.
        self.output_noise: np.ndarray | None = None
        log.info("embedding engine: %s on %s, %d-d, window %d", model_dir, self.provider, self.dimensions, self.window)

    @property
    def num_session_calls(self) -> int:
        return self.embedder.num_session_calls

    @property
    def num_fragments_run(self) -> int:
        return self.embedder.num_fragments_run

    # -- requests in -------------------------------------------------------------------------

    def add(self, request: EmbedRequest | GenerateRequest, now_ms: int) -> EngineOutput | None:
        """Queue a request. Returns its terminal event at once if it is refused, else None."""
        rid = request.request_id
        if not isinstance(request, EmbedRequest):
            return _refused(rid, now_ms, "rejected", "unsupported_request_kind", "this model serves embeddings only")
        if rid in self._jobs:
            return None  # a redelivery while the first copy runs: that one answers
        if request.deadline_ms <= now_ms:
            return _refused(rid, now_ms, "timeout", "deadline_exceeded", "deadline passed before the model ran")
        job = _Job(
            request, now_ms, deque(), np.zeros((len(request.inputs), self.dimensions)), np.zeros(len(request.inputs))
        )
        for index, ids in enumerate(self.embedder.encode(request.inputs)):
            fragments = self.embedder.fragment(ids)  # each with [CLS] and [SEP]
            num_tokens = sum(len(fragment) for fragment in fragments)
            if num_tokens > self.max_model_len:
                message = context_length.input_too_long(self.max_model_len, index, num_tokens)
                return _refused(rid, now_ms, "rejected", "input_too_long", message)
            job.pending.extend((index, fragment) for fragment in fragments)
            job.total_tokens += num_tokens
        self._jobs[rid] = job
        return None

    def cancel(self, request_id: str, now_ms: int) -> EngineOutput | None:
        """Drop a request's fragments. Returns its terminal event, or None if unknown."""
        job = self._jobs.pop(request_id, None)
        if job is None:
            return None
        return self._final(job, "cancelled", now_ms, ErrorInfo(code="cancelled", message="request was cancelled"))

    # -- the loop ----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._jobs)

    def step(self, now_ms: int) -> list[EngineOutput]:
        """Expire, run one session call over queued fragments, pool; returns the finished requests."""
        outputs = self._expire(now_ms)
        batch = self._take_batch()
        if not batch:
            return outputs
        vectors = self.embedder.run([ids for _, _, ids in batch])  # [len(batch), dim]
        if self.output_noise is not None:
            vectors = vectors + self.output_noise
        for (job, index, ids), vector in zip(batch, vectors, strict=True):
            job.sums[index] += len(ids) * vector.astype(np.float64)
            job.num_tokens[index] += len(ids)
        for job in [j for j in self._jobs.values() if not j.pending]:  # all fragments have run
            del self._jobs[job.request.request_id]
            outputs.append(self._final(job, "stop", now_ms))
        return outputs

    def _take_batch(self) -> list[tuple[_Job, int, list[int]]]:
        """Fragments for one call, round-robin over requests in arrival order (a long request does
        not hold up a short one), within max_batch_fragments and max_batch_tokens once padded."""
        batch: list[tuple[_Job, int, list[int]]] = []
        longest = 0
        jobs = [j for j in self._jobs.values() if j.pending]
        while jobs and len(batch) < self.max_batch_fragments:
            for job in list(jobs):
                index, ids = job.pending[0]
                width = max(longest, len(ids))
                if batch and (len(batch) + 1) * width > self.max_batch_tokens:
                    return batch
                job.pending.popleft()
                batch.append((job, index, ids))
                longest = width
                if not job.pending:
                    jobs.remove(job)
                if len(batch) == self.max_batch_fragments:
                    break
        return batch

    def _expire(self, now_ms: int) -> list[EngineOutput]:
        expired = [j for j in self._jobs.values() if j.request.deadline_ms <= now_ms]
        info = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed")
        for job in expired:
            del self._jobs[job.request.request_id]
        return [self._final(job, "timeout", now_ms, info) for job in expired]

    def _final(self, job: _Job, reason: FinishReason, now_ms: int, error: ErrorInfo | None = None) -> EngineOutput:
        vectors = None
        if reason == "stop":
            vectors = as_json_floats(pool(job.sums, job.num_tokens))
        return EngineOutput(
            job.request.request_id,
            0,
            finish_reason=reason,
            error=error,
            prompt_tokens=job.total_tokens,
            received_ms=job.received_ms,
            finished_ms=now_ms,
            prompt_text="\n".join(job.request.inputs),
            output_text="",
            embeddings=vectors,
        )

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Gauges for heartbeats; 'KV blocks' are request slots here, as in EchoEngine."""
        return {
            "num_running": len(self._jobs),
            "num_waiting": 0,
            "free_kv_blocks": max(0, self.max_num_seqs - len(self._jobs)),
            "num_kv_blocks": self.max_num_seqs,
            "prefix_hit_rate": 0.0,
            "num_session_calls": self.num_session_calls,
            "num_fragments_run": self.num_fragments_run,
        }


def _refused(request_id: str, now_ms: int, reason: FinishReason, code: str, message: str) -> EngineOutput:
    return EngineOutput(
        request_id,
        0,
        finish_reason=reason,
        error=ErrorInfo(code=code, message=message),
        received_ms=now_ms,
        finished_ms=now_ms,
    )
