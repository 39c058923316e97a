"""Model manifests: pack a model directory into a ModelManifest, verify files against one.

A manifest (schemas/registry.py) names every file of a version with its sha256 and size. A
worker verifies every file against it before it loads anything (docs/design.md, invariant 10):
a missing, extra-sized or changed file refuses the load with a message naming the file. Hashes
go through weir/digests.py's cache, which a write to a file invalidates (its mtime and ctime
change, and ctime cannot be set back).

For a version whose files come from somewhere Weir builds them (a GGUF `source` imported into a
directory, an ONNX export of a package), the directory is built first (weir/models/sources.py)
and then packed: the manifest is of what the worker will load.

`weir models pack` writes a manifest file, `<name>@<version>.manifest.json` (next to the model
directory by default). A file with that suffix is never part of a model: packing and verifying
leave it out, so a manifest written inside the directory it describes changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import orjson
from pydantic import ValidationError

from schemas.model_repo import ModelConfig
from schemas.registry import ManifestFile, ManifestSignature, ModelManifest
from weir.digests import file_sha256

_SKIPPED = {".lock", ".weir-import.lock"}  # build locks (weir/built_dirs.py), not part of the model
MANIFEST_SUFFIX = ".manifest.json"  # manifest files (`weir models pack`), never part of the model


class ManifestError(ValueError):
    """A model directory does not match its manifest, or cannot be packed; names the file."""


def _format(config: ModelConfig) -> str:
    if config.engine == "echo":
        return "echo"
    if config.engine == "onnx":
        return "onnx"
    return "safetensors"


def _is_not_model(rel: Path) -> bool:
    """A build lock, a manifest file, or a hidden (staging) file or folder."""
    return rel.name in _SKIPPED or rel.name.endswith(MANIFEST_SUFFIX) or any(p.startswith(".") for p in rel.parts)


def model_files(directory: Path) -> list[Path]:
    """Every regular file under `directory`, sorted, without build locks, manifest files and
    hidden staging files."""
    files = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if path.is_symlink():
            raise ManifestError(f"{path}: a symbolic link; a model directory holds plain files only")
        if not path.is_file() or _is_not_model(rel):
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
                         location=str(where.resolve()), files=files, serving=serving)


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
                                f"{entry.sha256[:16]}...: the file changed since the version was packed")
    extra = [p.relative_to(where).as_posix() for p in model_files(where) if p.relative_to(where).as_posix() not in listed]
    if extra:
        raise ManifestError(f"{manifest.served_id}: {extra[0]} in {where} is not in the manifest")


def manifest_file_name(manifest: ModelManifest) -> str:
    """`<name>@<version>.manifest.json`."""
    return manifest.served_id + MANIFEST_SUFFIX


def write_manifest_file(path: Path, manifest: ModelManifest, signature: ManifestSignature | None) -> None:
    """Write `{"manifest": ..., "signature": ...}` (indented JSON) to `path`."""
    body = {"manifest": manifest.model_dump(mode="json"), "signature": signature.model_dump(mode="json") if signature else None}
    Path(path).write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def read_manifest_file(path: Path) -> tuple[ModelManifest, ManifestSignature | None]:
    """The manifest and signature a manifest file holds; ManifestError naming the file."""
    try:
        body = orjson.loads(Path(path).read_bytes())
        if not isinstance(body, dict) or set(body) != {"manifest", "signature"}:
            raise ValueError('expected an object with the keys "manifest" and "signature"')
        manifest = ModelManifest.model_validate(body["manifest"])
        signature = ManifestSignature.model_validate(body["signature"]) if body["signature"] is not None else None
    except (OSError, ValueError, ValidationError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise ManifestError(f"{path}: not a manifest file ({exc})") from exc
    return manifest, signature
