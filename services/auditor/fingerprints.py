"""SimHash of an asked text, for semantic lookups: the same model and projection as the workers.

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


def simhash_function(model_repo: str | Path = "models.toml", model_name: str = "all-MiniLM-L6-v2") -> Callable[[str], str | None]:
    """text -> its SimHash, or None when the fingerprint model cannot load (exact lookups still work).

    The model loads on the first call; calls are serialised (one onnxruntime session).
    """
    lock = threading.Lock()
    state: dict[str, TextFingerprinter | None] = {}

    def simhash_of(text: str) -> str | None:
        with lock:
            if "fingerprinter" not in state:
                state["fingerprinter"] = _load(model_repo, model_name)
            fingerprinter = state["fingerprinter"]
            if fingerprinter is None:
                return None
            return fingerprinter.simhash([text])[0]

    return simhash_of


def _load(model_repo: str | Path, model_name: str) -> TextFingerprinter | None:
    try:
        from schemas.model_repo import load_model_repo
        from weir.embedding.fingerprints import build_fingerprinter

        return build_fingerprinter(model_name, load_model_repo(model_repo))
    except Exception as exc:  # noqa: BLE001 - semantic lookups are optional
        log.warning("no semantic lookups: fingerprint model %s cannot load (%s)", model_name, exc)
        return None
