from pathlib import Path

import pytest

from .factories import make_model_dir


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("qwen2") / "m", "qwen2")
