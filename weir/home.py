"""$WEIR_HOME: where one machine's deployment keeps its state (broker data, jars, exports, logs,
the audit key). Every command of a deployment resolves it the same way, so they share it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout, when Weir runs from source


def weir_home() -> Path:
    """$WEIR_HOME, else <repo>/var for a source checkout, else ~/.cache/weir."""
    if env := os.environ.get("WEIR_HOME"):
        return Path(env).expanduser().resolve()
    if (REPO / "pyproject.toml").exists() and os.access(REPO, os.W_OK):
        return REPO / "var"
    return Path.home() / ".cache" / "weir"


def served_model_dir(name: str, path: Path | None, source: str | None) -> Path | None:
    """The Hugging Face directory a torch model entry is served from: its `path`, else where its
    GGUF `source` is imported ($WEIR_HOME/models/<name>, made by weir/models/sources.py on first
    use), else None. It may not exist yet."""
    if path is not None:
        return Path(path)
    return weir_home() / "models" / name if source is not None else None
