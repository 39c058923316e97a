"""Model manifests: pack a model directory into a ModelManifest, verify files against one.

A manifest (schemas/registry.py) names every file of a version with its sha256 and size. A
worker verifies every file against it before it loads anything (docs/design.md, invariant 10):
a missing, extra-sized or changed file refuses the load with a message naming the file. Hashes
go through weir/digests.py's cache, which a write to a file invalidates (its mtime and ctime
change, and ctime cannot be set back).

For a version whose files come from somewhere Weir builds them (a GGUF `source` imported into a
directory, an ONNX export of a package), the directory is built first (weir/models/sources.py)
and then packed: the manifest is of what the worker will load.
"""

from __future__ import annotations

from pathlib import Path

from schemas.model_repo import ModelConfig
from schemas.registry import ManifestFile, ModelManifest
from weir.digests import file_sha256

_SKIPPED = {".lock", ".weir-import.lock"}  # build locks (weir/built_dirs.py), not part of the model


class ManifestError(ValueError):
    """A model directory does not match its manifest, or cannot be packed; names the file."""


def _format(config: ModelConfig) -> str:
    if config.engine == "echo":
        return "echo"
    if config.engine == "onnx":
        return "onnx"
    return "safetensors"


def model_files(directory: Path) -> list[Path]:
    """Every regular file under `directory`, sorted, without build locks and hidden staging files."""
    files = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if path.is_symlink():
            raise ManifestError(f"{path}: a symbolic link; a model directory holds plain files only")
        if not path.is_file() or path.name in _SKIPPED or any(part.startswith(".") for part in rel.parts):
            continue
        files.append(path)
    return files


def pack(config: ModelConfig, directory: Path | None = None) -> ModelManifest:
    """The manifest of `config`'s model directory (`directory`, else config.path) as it is now."""
    serving = config.model_dump(mode="json", exclude={"name", "version", "path"}, exclude_defaults=False)
    if config.engine == "echo":
        return ModelManifest(name=config.name, version=config.version, format="echo", location="", serving=serving)
    where = Path(directory or config.path or "")
    if not where.is_dir():
        raise ManifestError(f"model {config.served_id}: {where} is not a directory")
    files = [
        ManifestFile(path=p.relative_to(where).as_posix(), sha256=file_sha256(p), size_bytes=p.stat().st_size)
        for p in model_files(where)
    ]
    if not files:
        raise ManifestError(f"model {config.served_id}: {where} holds no files")
    return ModelManifest(name=config.name, version=config.version, format=_format(config),
                         location=str(where.resolve()), files=files, serving=serving)  # fmt: skip


def verify_files(manifest: ModelManifest, directory: Path | None = None) -> None:
    """Raise ManifestError naming the first file that is missing, of another size or another
    sha256 than the manifest says, or present but not in the manifest."""
    if manifest.format == "echo":
        return
    where = Path(directory or manifest.location)
    if not where.is_dir():
        raise ManifestError(f"{manifest.served_id}: model directory {where} does not exist")
    listed = {f.path for f in manifest.files}
    for entry in manifest.files:
        path = where / entry.path
        if not path.is_file():
            raise ManifestError(f"{manifest.served_id}: {entry.path} is missing from {where}")
        size = path.stat().st_size
        if size != entry.size_bytes:
            raise ManifestError(f"{manifest.served_id}: {entry.path} is {size} bytes, the manifest says {entry.size_bytes}")
        digest = file_sha256(path)
        if digest != entry.sha256:
            raise ManifestError(f"{manifest.served_id}: {entry.path} has sha256 {digest[:16]}..., the manifest says "
                                f"{entry.sha256[:16]}...: the file changed since the version was packed")  # fmt: skip
    extra = [p.relative_to(where).as_posix() for p in model_files(where) if p.relative_to(where).as_posix() not in listed]
    if extra:
        raise ManifestError(f"{manifest.served_id}: {extra[0]} in {where} is not in the manifest")
