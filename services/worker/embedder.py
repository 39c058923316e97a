"""The embedding engine: a sentence encoder exported to ONNX, run with onnxruntime, batched dynamically.

    add(request)   tokenize each input; split it into fragments that fit the model's window
    step()         one session call over the queued fragments of every request (padded to the
                   longest), then pool: fragments -> inputs -> L2-normalised vectors

Same contract as Engine and EchoEngine (add, cancel, step, has_work, stats, weights_sha256), so the
worker's EngineRunner drives it on its own thread.

Fragments: an input of n tokens (special tokens aside) becomes ceil(n / (window - 2)) fragments
of near-equal size, each wrapped in [CLS] ... [SEP], so none exceeds the window (512 tokens for
MiniLM, from config.json max_position_embeddings). The graph mean-pools each fragment over its
attention mask; the fragments of one input are averaged weighted by their token counts (which is
the mean over all their tokens), then L2-normalised.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson
from tokenizers import Tokenizer

from schemas.messages import EmbedRequest, ErrorInfo, FinishReason, GenerateRequest
from services.worker.onnx_export import MANIFEST, file_sha256
from services.worker.sequence import EngineOutput

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_FRAGMENTS = 64
# Padded tokens per session call. On a GPU a big call is cheap and bounds attention memory; on
# the CPU the cost is per token anyway, and a smaller call keeps a step (during which cancels and
# deadlines wait) short.
DEFAULT_MAX_BATCH_TOKENS = {"CUDAExecutionProvider": 16384, "CPUExecutionProvider": 4096}


@dataclass
class _Job:
    """One EmbedRequest in the engine: its fragments still to run and the pooled sums so far."""

    request: EmbedRequest
    received_ms: int
    pending: deque[tuple[int, list[int]]]  # (input index, fragment ids with [CLS]/[SEP])
    sums: np.ndarray  # [num_inputs, dim] float64: token-count-weighted sum of fragment means
    num_tokens: np.ndarray  # [num_inputs] tokens embedded so far per input
    total_tokens: int = 0


def open_session(onnx_path: Path, use_cuda: bool, num_threads: int = 0) -> ort.InferenceSession:
    """An onnxruntime session on CUDA when asked, offered and loadable; on the CPU otherwise."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    # Idle pool threads would spin on a CPU shared with the broker and the other services.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            session = ort.InferenceSession(str(onnx_path), options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
            if session.get_providers()[0] == "CUDAExecutionProvider":
                return session
            log.warning("onnxruntime did not take the CUDA provider; embedding on the CPU")
        except Exception as exc:  # noqa: BLE001 - a CUDA/cuDNN library mismatch: the CPU still works
            log.warning("onnxruntime's CUDA provider failed to load (%s); embedding on the CPU", exc)
    return ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])


def split_fragments(ids: list[int], max_tokens: int) -> list[list[int]]:
    """Split token ids into the fewest near-equal pieces of at most max_tokens (one, empty, for [])."""
    num = max(1, math.ceil(len(ids) / max_tokens))
    size = math.ceil(len(ids) / num) if ids else 0
    return [ids[i * size : (i + 1) * size] for i in range(num)]


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
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        # Tokens per fragment, [CLS] and [SEP] included: the model's window, or less when asked.
        self.window = min(int(config["max_position_embeddings"]), max_fragment_tokens or 1 << 30)
        if self.window < 3:
            raise ValueError(f"{max_fragment_tokens=} must leave room for a token between [CLS] and [SEP]")
        self.dimensions = int(config["hidden_size"])
        if dimensions is not None and dimensions != self.dimensions:
            raise ValueError(f"{dimensions=} in the model repository, but {model_dir} makes {self.dimensions}-d vectors")
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_batch_fragments = max_batch_fragments
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_truncation()  # tokenizer.json ships truncation and padding at 128
        self.tokenizer.no_padding()
        self.cls_id, self.sep_id, self.pad_id = (self._token_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
        self.session = open_session(model_dir / "model.onnx", use_cuda, num_threads)
        self.provider = self.session.get_providers()[0]
        self.max_batch_tokens = max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS.get(self.provider, 4096)
        if self.max_batch_tokens < self.window:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} must be >= the window ({self.window} tokens)")
        self.weights_sha256 = _onnx_sha256(model_dir)
        self._jobs: dict[str, _Job] = {}  # insertion order = arrival order, for round-robin
        self.num_session_calls = 0
        self.num_fragments_run = 0
        log.info("embedding engine: %s on %s, %d-d, window %d", model_dir, self.provider, self.dimensions, self.window)

    def _token_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"the tokenizer has no {token} token; the onnx engine serves BERT-style encoders")
        return found

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
        body = self.window - 2  # room for [CLS] and [SEP]
        job = _Job(request, now_ms, deque(), np.zeros((len(request.inputs), self.dimensions)), np.zeros(len(request.inputs)))
        for index, encoding in enumerate(self.tokenizer.encode_batch(request.inputs, add_special_tokens=False)):
            ids = encoding.ids
            fragments = split_fragments(ids, body)
            num_tokens = len(ids) + 2 * len(fragments)
            if num_tokens > self.max_model_len:
                message = f"input {index} has {num_tokens} tokens; this model takes at most {self.max_model_len}"
                return _refused(rid, now_ms, "rejected", "input_too_long", message)
            job.pending.extend((index, [self.cls_id, *piece, self.sep_id]) for piece in fragments)
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
        vectors = self._run([ids for _, _, ids in batch])  # [len(batch), dim]
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

    def _run(self, fragments: list[list[int]]) -> np.ndarray:
        """One session call: fragments padded to the longest; returns their mean-pooled states."""
        width = max(len(ids) for ids in fragments)
        input_ids = np.full((len(fragments), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(fragments), width), dtype=np.int64)
        for row, ids in enumerate(fragments):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        self.num_session_calls += 1
        self.num_fragments_run += len(fragments)
        return self.session.run(["sentence_embedding"], {"input_ids": input_ids, "attention_mask": mask})[0]

    def _expire(self, now_ms: int) -> list[EngineOutput]:
        expired = [j for j in self._jobs.values() if j.request.deadline_ms <= now_ms]
        info = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed")
        for job in expired:
            del self._jobs[job.request.request_id]
        return [self._final(job, "timeout", now_ms, info) for job in expired]

    def _final(self, job: _Job, reason: FinishReason, now_ms: int, error: ErrorInfo | None = None) -> EngineOutput:
        vectors = None
        if reason == "stop":
            pooled = job.sums / job.num_tokens[:, None]
            pooled /= np.linalg.norm(pooled, axis=1, keepdims=True).clip(min=1e-12)
            # float32 values, written with float32's shortest decimals (~12 JSON bytes each)
            vectors = orjson.loads(orjson.dumps(pooled.astype(np.float32), option=orjson.OPT_SERIALIZE_NUMPY))
        return EngineOutput(
            job.request.request_id, 0, finish_reason=reason, error=error, prompt_tokens=job.total_tokens,
            received_ms=job.received_ms, finished_ms=now_ms, prompt_text="\n".join(job.request.inputs),
            output_text="", embeddings=vectors,
        )  # fmt: skip

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Gauges for heartbeats; 'KV blocks' are request slots here, as in EchoEngine."""
        return {
            "num_running": len(self._jobs), "num_waiting": 0,
            "free_kv_blocks": max(0, self.max_num_seqs - len(self._jobs)), "num_kv_blocks": self.max_num_seqs,
            "prefix_hit_rate": 0.0, "num_session_calls": self.num_session_calls,
            "num_fragments_run": self.num_fragments_run,
        }  # fmt: skip


def _onnx_sha256(model_dir: Path) -> str:
    try:
        return str(json.loads((model_dir / MANIFEST).read_text())["onnx_sha256"])
    except (OSError, ValueError, KeyError):
        return file_sha256(model_dir / "model.onnx")


def _refused(request_id: str, now_ms: int, reason: FinishReason, code: str, message: str) -> EngineOutput:
    return EngineOutput(
        request_id, 0, finish_reason=reason, error=ErrorInfo(code=code, message=message),
        received_ms=now_ms, finished_ms=now_ms,
    )  # fmt: skip
