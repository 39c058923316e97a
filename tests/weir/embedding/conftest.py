from pathlib import Path

import pytest

from schemas.model_repo import load_model_repo

REPO_TOML = Path(__file__).resolve().parents[3] / "models.toml"
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    """The repository's all-MiniLM-L6-v2, exported once into $WEIR_HOME/models and reused."""
    from weir.embedding.onnx_export import ensure_export

    return ensure_export(load_model_repo(REPO_TOML).models[MODEL])
