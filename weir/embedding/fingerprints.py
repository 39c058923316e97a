"""Texts -> 64-bit SimHashes: the SentenceEmbedder's vectors through schemas/fingerprint.py.

The worker fingerprints every finished request's prompt and output with it (through its
FingerprintBatcher, off the serving hot path); the auditor fingerprints a text it is asked to look
up. Both build it with build_fingerprinter from the same model-repository entry, so the same text
gets the same SimHash on either side: same ONNX export, tokenizer, fragments, pooling and
projection.
"""

from __future__ import annotations

import logging
import time

import onnxruntime as ort

from schemas.fingerprint import FINGERPRINT_MODEL, simhashes
from schemas.messages import MAX_EMBED_INPUTS
from schemas.model_repo import ModelRepository
from weir.embedding.embedder import DEFAULT_MAX_BATCH_FRAGMENTS, SentenceEmbedder, as_json_floats
from weir.embedding.onnx_export import ensure_export, ensure_int8

log = logging.getLogger(__name__)


class TextFingerprinter:
    """Texts -> SimHashes through a SentenceEmbedder; synchronous (one caller thread at a time)."""

    model = FINGERPRINT_MODEL

    def __init__(self, embedder: SentenceEmbedder, max_model_len: int = 8192, precision: str = "float32") -> None:
        self.embedder = embedder
        self.precision = precision  # "int8" (CPU) or "float32"; see build_fingerprinter
        # int8 is quantized dynamically: each MatMul's input gets one scale over the whole tensor of
        # a session call, so a text padded into a call with others would hash differently than
        # alone (or at the auditor). One fragment per call keeps a text's SimHash its own; on the
        # CPU a bigger call saves no CPU per token anyway (`weir bench fingerprints` shows both).
        self.max_batch_fragments = 1 if precision == "int8" else DEFAULT_MAX_BATCH_FRAGMENTS
        self.max_model_len = max_model_len  # tokens per text, as the model entry allows on /v1/embeddings
        self.busy_s = 0.0  # seconds spent fingerprinting, for the benchmark
        self.num_texts = 0
        self.num_calls = 0  # simhash() calls: the batches a FingerprintBatcher handed over

    def simhash(self, texts: list[str]) -> list[str]:
        """The SimHash of each text, in order (empty texts included).

        Texts run in groups of similar length: a session call pads to its longest text, and a
        batch mixes short prompts with long outputs. Raises ValueError when a text is longer than
        max_model_len tokens.
        """
        started = time.perf_counter()
        result: list[str] = [""] * len(texts)
        for group in _length_groups(texts):
            for index, value in zip(group, self._simhash_group([texts[i] for i in group]), strict=True):
                result[index] = value
        self.busy_s += time.perf_counter() - started
        self.num_texts += len(texts)
        self.num_calls += 1
        return result

    def _simhash_group(self, texts: list[str]) -> list[str]:
        result: list[str] = []
        for start in range(0, len(texts), MAX_EMBED_INPUTS):  # the chunks /v1/embeddings would take
            vectors = self.embedder.embed(
                texts[start : start + MAX_EMBED_INPUTS],
                max_tokens=self.max_model_len,
                max_batch_fragments=self.max_batch_fragments,
            )
            result += simhashes(as_json_floats(vectors))  # the vectors as /v1/embeddings returns them
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


PRECISIONS = ("int8", "float32")


def build_fingerprinter(
    model_name: str, repo: ModelRepository, num_threads: int = 1, precision: str = "int8", use_cuda: bool = False
) -> TextFingerprinter | None:
    """The fingerprinter over the repository's `model_name` (an onnx embedding model), exported on
    first use; or None (with one log line saying why) when it is switched off or cannot load.
    Called once at start by the worker, and on the first lookup by the auditor.

    precision "int8" (the default): on the CPU, the int8 quantization of the export (quantized once,
    cached in its own directory beside it, onnx_export.int8_dir: never inside the served export),
    about half the CPU of float32 per text; its SimHashes differ from float32's by a few bits of 64 (`weir bench fingerprints` measures how many, and lookup recall), well inside
    the lookup's distance, so records of either precision match each other. "float32": the export
    as is. With `use_cuda` and onnxruntime's CUDA provider loadable, float32 on the GPU (int8 there
    would run MatMulInteger on the CPU)."""
    if precision not in PRECISIONS:
        raise ValueError(f"fingerprint precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if not model_name:
        return None
    config = repo.models.get(model_name)
    if config is None or config.engine != "onnx":
        log.warning("no onnx model %r in the model repository: AuditEvents carry no SimHash", model_name)
        return None
    try:
        export = ensure_export(config)
        if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
            embedder = SentenceEmbedder(export, use_cuda=True, num_threads=num_threads)
            if embedder.provider == "CUDAExecutionProvider":
                return TextFingerprinter(embedder, max_model_len=config.max_model_len, precision="float32")
        onnx_file = str(ensure_int8(export)) if precision == "int8" else "model.onnx"  # int8: its own dir
        embedder = SentenceEmbedder(export, num_threads=num_threads, onnx_file=onnx_file)
    except Exception as exc:  # noqa: BLE001 - fingerprints are optional; the HMACs still go out
        log.warning("fingerprint model %s cannot load (%s): AuditEvents carry no SimHash", model_name, exc)
        return None
    return TextFingerprinter(embedder, max_model_len=config.max_model_len, precision=precision)
