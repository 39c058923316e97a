"""A sentence encoder exported to ONNX (onnx_export.py), run with onnxruntime: texts -> unit vectors.

    encode(texts)      token ids of each text, special tokens aside
    fragment(ids)      pieces that fit the model's window, each wrapped in [CLS] ... [SEP]
    run(fragments)     one session call, padded to the longest: the mean-pooled state of each
    pool(sums, n)      token-weighted fragment means -> L2-normalised float32 vectors

The worker's EmbeddingEngine (dynamic batching across requests) and the TextFingerprinter (the
worker's audit SimHashes, the auditor's lookups) both embed through these, so a text gets the same
vector wherever it is embedded.

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
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson
from tokenizers import Tokenizer

from weir.embedding.onnx_export import MANIFEST, file_sha256

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_FRAGMENTS = 64
# Padded tokens per session call. On a GPU a big call is cheap and bounds attention memory; on
# the CPU the cost is per token anyway, and a smaller call keeps a step (during which cancels and
# deadlines wait) short.
DEFAULT_MAX_BATCH_TOKENS = {"CUDAExecutionProvider": 16384, "CPUExecutionProvider": 4096}


def open_session(onnx_path: Path, use_cuda: bool, num_threads: int = 0) -> ort.InferenceSession:
    """An onnxruntime session on CUDA when asked, offered and loadable; on the CPU otherwise."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    # Idle pool threads would spin on a CPU shared with the broker and the other services.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            session = ort.InferenceSession(
                str(onnx_path), options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
            )
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


def pool(sums: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    """Token-weighted fragment sums -> L2-normalised vectors.

    sums: [n, dim] float64, each input's sum of len(fragment) * fragment mean; num_tokens: [n].
    Returns [n, dim] float32.
    """
    pooled = sums / num_tokens[:, None]
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True).clip(min=1e-12)
    return pooled.astype(np.float32)


def as_json_floats(vectors: np.ndarray) -> list[list[float]]:
    """float32 vectors as /v1/embeddings sends them: float32's shortest decimals (~12 JSON bytes
    each), read back as Python floats. SimHashes are computed from these values too."""
    return orjson.loads(orjson.dumps(vectors.astype(np.float32), option=orjson.OPT_SERIALIZE_NUMPY))


def take_in_order(fragments: list[list[int]], max_batch_fragments: int, max_batch_tokens: int) -> list[list[list[int]]]:
    """`fragments` cut in order into session calls of at most max_batch_fragments and, padded to
    their longest, max_batch_tokens (a single fragment always gets a call)."""
    batches: list[list[list[int]]] = []
    batch: list[list[int]] = []
    longest = 0
    for ids in fragments:
        width = max(longest, len(ids))
        if batch and (len(batch) == max_batch_fragments or (len(batch) + 1) * width > max_batch_tokens):
            batches.append(batch)
            batch, width = [], len(ids)
        batch.append(ids)
        longest = width
    return batches + [batch] if batch else batches


class SentenceEmbedder:
    """One ONNX sentence encoder: its tokenizer, window and onnxruntime session. Called from one
    thread at a time (the worker's engine thread, the fingerprint thread, the auditor's lock)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        use_cuda: bool = False,
        num_threads: int = 0,
        max_fragment_tokens: int | None = None,
        onnx_file: str = "model.onnx",
    ) -> None:
        model_dir = self.model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        # Tokens per fragment, [CLS] and [SEP] included: the model's window, or less when asked.
        self.window = min(int(config["max_position_embeddings"]), max_fragment_tokens or 1 << 30)
        if self.window < 3:
            raise ValueError(f"{max_fragment_tokens=} must leave room for a token between [CLS] and [SEP]")
        self.dimensions = int(config["hidden_size"])
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_truncation()  # tokenizer.json ships truncation and padding at 128
        self.tokenizer.no_padding()
        self.cls_id, self.sep_id, self.pad_id = (self._token_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
        # onnx_file: the float32 export, or (an absolute path) its int8 quantization, kept outside the
        # export (onnx_export.ensure_int8): model_dir / an absolute path is that path
        self.session = open_session(model_dir / onnx_file, use_cuda, num_threads)
        self.provider = self.session.get_providers()[0]
        self.default_max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS.get(self.provider, 4096)
        self.weights_sha256 = (
            _onnx_sha256(model_dir) if onnx_file == "model.onnx" else file_sha256(model_dir / onnx_file)
        )
        self.num_session_calls = 0
        self.num_fragments_run = 0

    def _token_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"the tokenizer has no {token} token; the onnx engine serves BERT-style encoders")
        return found

    def encode(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each text, without [CLS]/[SEP], untruncated."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def fragment(self, ids: list[int]) -> list[list[int]]:
        """`ids` split to fit the window, each piece wrapped in [CLS] ... [SEP] (one fragment for [])."""
        return [[self.cls_id, *piece, self.sep_id] for piece in split_fragments(ids, self.window - 2)]

    def run(self, fragments: list[list[int]]) -> np.ndarray:
        """One session call: fragments padded to the longest; returns their mean-pooled states
        [len(fragments), dim] float32 (not normalised)."""
        width = max(len(ids) for ids in fragments)
        input_ids = np.full((len(fragments), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(fragments), width), dtype=np.int64)
        for row, ids in enumerate(fragments):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        self.num_session_calls += 1
        self.num_fragments_run += len(fragments)
        return self.session.run(["sentence_embedding"], {"input_ids": input_ids, "attention_mask": mask})[0]

    def embed(
        self,
        texts: list[str],
        *,
        max_tokens: int | None = None,
        max_batch_fragments: int = DEFAULT_MAX_BATCH_FRAGMENTS,
        max_batch_tokens: int | None = None,
    ) -> np.ndarray:
        """The L2-normalised embedding of each text, [len(texts), dim] float32.

        Fragments run in order, in calls of at most max_batch_fragments and max_batch_tokens
        padded tokens (the provider's default when None): the calls the EmbeddingEngine makes
        for one request alone. Raises ValueError when a text has more than max_tokens tokens,
        [CLS]/[SEP] of each fragment included.
        """
        fragments: list[tuple[int, list[int]]] = []  # (text index, fragment ids)
        for index, ids in enumerate(self.encode(texts)):
            pieces = self.fragment(ids)
            num_tokens = sum(len(piece) for piece in pieces)
            if max_tokens is not None and num_tokens > max_tokens:
                raise ValueError(f"input {index} has {num_tokens} tokens; this model takes at most {max_tokens}")
            fragments.extend((index, piece) for piece in pieces)
        sums = np.zeros((len(texts), self.dimensions))  # float64
        num_tokens_of = np.zeros(len(texts))
        max_batch_tokens = max_batch_tokens or self.default_max_batch_tokens
        batches = take_in_order([ids for _, ids in fragments], max_batch_fragments, max_batch_tokens)
        start = 0
        for batch in batches:
            for (index, ids), vector in zip(fragments[start : start + len(batch)], self.run(batch), strict=True):
                sums[index] += len(ids) * vector.astype(np.float64)
                num_tokens_of[index] += len(ids)
            start += len(batch)
        return pool(sums, num_tokens_of)


def _onnx_sha256(model_dir: Path) -> str:
    try:
        return str(json.loads((model_dir / MANIFEST).read_text())["onnx_sha256"])
    except (OSError, ValueError, KeyError):
        return file_sha256(model_dir / "model.onnx")
