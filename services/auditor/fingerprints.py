"""SimHash of an asked text, for semantic lookups: the same model and projection as the workers;
and the embeddings of two answers, for the shadow comparison's similarity.

The embedding must match the workers' bit for bit in method (same ONNX export, tokenizer,
fragmenting and pooling), so this uses the TextFingerprinter the workers use, from the shared
weir/embedding package, rather than a second copy. It is imported lazily, on the first lookup:
onnxruntime, torch and the model are a startup cost the auditor only pays when asked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the module itself loads on the first lookup
    from weir.embedding.fingerprints import TextFingerprinter

log = logging.getLogger(__name__)


def simhash_function(
    model_repo: str | Path = "models.toml", model_name: str = "all-MiniLM-L6-v2"
) -> Callable[[str], str | None]:
    """text -> its SimHash, or None when the fingerprint model cannot load (exact lookups still work).

    The model loads on the first call; calls are serialised (one onnxruntime session).
    """
    model = _LazyModel(model_repo, model_name)

    def simhash_of(text: str) -> str | None:
        with model.lock:
            fingerprinter = model.get()
            return None if fingerprinter is None else fingerprinter.simhash([text])[0]

    return simhash_of


def embedding_function(
    model_repo: str | Path = "models.toml", model_name: str = "all-MiniLM-L6-v2"
) -> Callable[[list[str]], list[list[float]] | None]:
    """texts -> their L2-normalised embeddings with the fingerprint model (the shadow comparison's
    similarity: the embedding model Weir already serves), or None when the model cannot load or a
    text is longer than it takes. Loads on the first call, like simhash_function."""
    model = _LazyModel(model_repo, model_name)

    def embed(texts: list[str]) -> list[list[float]] | None:
        with model.lock:
            fingerprinter = model.get()
            if fingerprinter is None:
                return None
            try:
                vectors = fingerprinter.embedder.embed(texts, max_tokens=fingerprinter.max_model_len)
            except ValueError as exc:  # a text over the model's length: no similarity for it
                log.info("no similarity: %s", exc)
                return None
            return [[float(x) for x in row] for row in vectors]

    return embed


class _LazyModel:
    """The fingerprinter, loaded on the first get() (under `lock`, which callers hold)."""

    def __init__(self, model_repo: str | Path, model_name: str) -> None:
        self.lock = threading.Lock()
        self.model_repo = model_repo
        self.model_name = model_name
        self.state: dict[str, TextFingerprinter | None] = {}

    def get(self) -> TextFingerprinter | None:
        if "fingerprinter" not in self.state:
            self.state["fingerprinter"] = _load(self.model_repo, self.model_name)
        return self.state["fingerprinter"]


def _load(model_repo: str | Path, model_name: str) -> TextFingerprinter | None:
    try:
        from schemas.model_repo import load_model_repo
        from weir.embedding.fingerprints import build_fingerprinter

        return build_fingerprinter(model_name, load_model_repo(model_repo))
    except Exception as exc:  # noqa: BLE001 - semantic lookups are optional
        log.warning("no semantic lookups: fingerprint model %s cannot load (%s)", model_name, exc)
        return None
