"""Import a GGUF file (llama.cpp, Ollama) as a Hugging Face-format model directory Weir serves.

    weir models import-gguf model.gguf --name my-model     # or import_gguf(src, out) from Python

The directory it writes:

    config.json              LlamaForCausalLM / Qwen2ForCausalLM config from the GGUF metadata
    model.safetensors        every tensor dequantized (weir/models/dequant.py), in float32 unless
                             asked otherwise, with llama.cpp's Q/K row permutation undone
    tokenizer.json           rebuilt from the GGUF vocabulary (weir/models/gguf_tokenizer.py)
    tokenizer_config.json    the GGUF's chat template, special tokens, BOS/EOS flags
    generation_config.json   bos/eos token ids
    weir-manifest.json       what it was made from (source, its sha256) and the sha256 and size
                             of every file above

It is written beside the target and renamed into place, so a reader never sees half a model and a
failed import leaves nothing behind. An import whose manifest names the same source sha256 and
dtype, with its files the sizes the manifest says, is reused (`force` redoes it).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weir.built_dirs import build_into, exclusive
from weir.models.dequant import UnsupportedQuantization, dequantize, type_name
from weir.models.gguf_config import ArchSpec, arch_spec, hf_config
from weir.models.gguf_file import GGUFError, GGUFFile, GGUFTensor, read_gguf
from weir.models.gguf_tokenizer import build_tokenizer, tokenizer_config
from weir.models.safetensors_writer import DTYPES, SafetensorsWriter

MANIFEST = "weir-manifest.json"
MANIFEST_FORMAT = 1
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the output: where it comes from and how it is turned into HF's layout."""

    hf_name: str
    source: GGUFTensor
    unpermute_heads: int | None  # llama.cpp permuted its rows for RoPE with this many heads
    group: str  # progress is reported per group ("embeddings", "layer 3", ...)
    order: int  # groups are written in this order: embeddings, layers 0..n-1, final norm and output


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(out: Path) -> dict[str, Any] | None:
    """The import's manifest when `out` holds a complete import (every file, of its recorded size)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        files = manifest["files"]
        if all((out / name).stat().st_size == files[name]["bytes"] for name in FILES):
            return manifest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def import_gguf(
    src: str | Path, out: str | Path, *, source: str | None = None, dtype: str = "float32",
    force: bool = False, progress: Progress = _quiet,
) -> Path:
    """Import `src` into the directory `out` (reused when it already holds this import); returns `out`.

    Raises GGUFError naming the file and the problem for a file that cannot be imported, and
    FileExistsError for an `out` that holds something other than a Weir import.
    """
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    progress(f"hashing {src} ...")
    digest = _source_sha256(src)
    if not force and _is_current(out, digest, dtype):
        progress(f"{out} already holds this import (source sha256 {digest[:12]}); reused")
        return out
    if out.exists() and not (out / MANIFEST).exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a Weir import (no {MANIFEST}); choose another --out")
    with exclusive(out):
        if not force and _is_current(out, digest, dtype):  # another process imported it meanwhile
            progress(f"{out} was imported meanwhile by another process; reused")
            return out
        build_into(out, lambda tmp: _write_import(src, tmp, source or str(src), digest, dtype, progress),
                   lambda done: _is_current(done, digest, dtype))
    return out


def _is_current(out: Path, digest: str, dtype: str) -> bool:
    manifest = read_manifest(out)
    return manifest is not None and (manifest.get("source_sha256"), manifest.get("dtype")) == (digest, dtype)


def _source_sha256(src: Path) -> str:
    try:
        return file_sha256(src)
    except OSError as exc:
        raise GGUFError(f"{src}: cannot read ({exc.strerror or exc})") from exc


def _write_import(src: Path, tmp: Path, source: str, digest: str, dtype: str, progress: Progress) -> None:
    started = time.monotonic()
    gguf = read_gguf(src)
    spec = arch_spec(gguf)
    config = hf_config(gguf, spec, dtype)
    plans = plan_tensors(gguf, spec, config)
    counts = Counter(type_name(p.source.ggml_type) for p in plans)
    progress(f"importing {src.name}: {spec.hf_architecture}, {config['num_hidden_layers']} layers, "
             f"{len(plans)} tensors ({', '.join(f'{n} {t}' for t, n in counts.most_common())}) -> {dtype}")
    tokenizer = build_tokenizer(gguf)  # before the weights: a bad vocabulary fails fast
    write_weights(plans, tmp / "model.safetensors", dtype, progress)
    tokenizer.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "tokenizer_config.json", tokenizer_config(gguf))
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    _write_json(tmp / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
    files = {name: {"sha256": file_sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in FILES}
    _write_json(tmp / MANIFEST, {
        "format": MANIFEST_FORMAT, "source": source, "source_file": src.name, "source_sha256": digest,
        "source_bytes": src.stat().st_size, "dtype": dtype, "architecture": spec.gguf_architecture,
        "gguf_name": gguf.get("general.name"), "quantizations": dict(counts), "files": files,
    })
    progress(f"imported {src.name} in {time.monotonic() - started:.1f} s")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def plan_tensors(gguf: GGUFFile, spec: ArchSpec, config: dict[str, Any]) -> list[TensorPlan]:
    """Every tensor of the file with its HF name; GGUFError for a tensor that has no place."""
    plans = []
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in gguf.tensors.values():
        parts = tensor.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit():
            layer, role, leaf = int(parts[1]), parts[2], parts[3]
            if role not in LAYER_TENSORS or leaf not in ("weight", "bias"):
                raise GGUFError(f"{gguf.path}: tensor {tensor.name!r} has no place in a {spec.hf_architecture}")
            hf = f"model.layers.{layer}.{LAYER_TENSORS[role]}.{leaf}"
            permute = heads.get(role) if spec.permuted_qk else None
            plans.append(TensorPlan(hf, tensor, permute, f"layer {layer}", layer))
        elif tensor.name in TOP_TENSORS:
            first = tensor.name == "token_embd.weight"
            group = "embeddings" if first else "final norm and output"
            plans.append(TensorPlan(TOP_TENSORS[tensor.name], tensor, None, group, -1 if first else 1 << 30))
        elif tensor.name == "rope_freqs.weight":
            continue  # llama3 RoPE factors; hf_config turned them into rope_scaling
        else:
            raise GGUFError(f"{gguf.path}: tensor {tensor.name!r} has no place in a {spec.hf_architecture}")
    return sorted(plans, key=lambda p: p.order)  # stable: a layer's tensors keep the file's order


TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def write_weights(plans: list[TensorPlan], path: Path, dtype: str, progress: Progress) -> None:
    """Dequantize each planned tensor and append it to `path`, reporting each group as it ends."""
    writer = SafetensorsWriter(path, [(p.hf_name, p.source.shape) for p in plans], dtype)
    try:
        groups = list(dict.fromkeys(p.group for p in plans))
        for i, plan in enumerate(plans):
            writer.write(plan.hf_name, hf_tensor(plan))
            if i + 1 == len(plans) or plans[i + 1].group != plan.group:
                progress(f"  [{groups.index(plan.group) + 1:>3}/{len(groups)}] {plan.group}")
    finally:
        writer.close()


def hf_tensor(plan: TensorPlan) -> np.ndarray:
    """The float32 values of a planned tensor, in HF's layout."""
    tensor = plan.source
    try:
        values = dequantize(tensor.raw, tensor.ggml_type, tensor.shape)
    except UnsupportedQuantization as exc:
        raise GGUFError(f"tensor {tensor.name!r}: {exc}") from exc
    if plan.unpermute_heads is not None:
        values = unpermute_rows(values, plan.unpermute_heads)
    return values


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute() of a q/k projection (weights or bias, rows = heads x head_dim).

    llama.cpp stores each head's rows interleaved for its rotate-pairs RoPE: HF's row order per
    head is [first halves..., second halves...], llama.cpp's [x0, x(d/2), x1, x(d/2+1), ...]
    (convert_hf_to_gguf.py: reshape(heads, 2, d/2).swapaxes(1, 2)); this is its inverse.
    """
    rows = weights.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise GGUFError(f"cannot unpermute {rows} rows into {num_heads} heads of an even size")
    return weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
