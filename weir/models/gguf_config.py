"""config.json of a Hugging Face model from a GGUF file's metadata (llama.cpp's key names).

    llama.block_count                     -> num_hidden_layers
    llama.embedding_length                -> hidden_size
    llama.feed_forward_length             -> intermediate_size
    llama.attention.head_count(_kv)       -> num_attention_heads, num_key_value_heads
    llama.attention.key_length            -> head_dim (default hidden / heads)
    llama.attention.layer_norm_rms_epsilon-> rms_norm_eps
    llama.rope.freq_base                  -> rope_theta (default 10000)
    llama.context_length                  -> max_position_embeddings
    llama.rope.scaling.type/factor        -> rope_scaling (linear); a rope_freqs tensor -> llama3
    no output.weight tensor               -> tie_word_embeddings

(`qwen2.*` likewise for a Qwen2.) Mistral files say `llama`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from weir.models.dequant import dequantize
from weir.models.gguf_file import GGUFError, GGUFFile


@dataclass(frozen=True)
class ArchSpec:
    """How a GGUF architecture maps onto a Hugging Face one."""

    gguf_architecture: str
    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp's converter permutes q/k rows for this architecture
    attention_bias: bool


ARCHITECTURES = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", "llama", permuted_qk=True, attention_bias=False),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", "qwen2", permuted_qk=False, attention_bias=True),
}


def arch_spec(gguf: GGUFFile) -> ArchSpec:
    """The architecture of the file; GGUFError naming it when Weir cannot serve it."""
    arch = gguf.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[arch]


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config(gguf: GGUFFile, spec: ArchSpec, dtype: str) -> dict[str, Any]:
    """The config.json dict; GGUFError naming a missing key or a shape Weir's model cannot take."""
    key = (spec.gguf_architecture + ".{}").format
    hidden, heads = int(gguf.require(key("embedding_length"))), int(gguf.require(key("attention.head_count")))
    head_dim = int(gguf.get(key("attention.key_length"), hidden // heads))
    rope_dims = int(gguf.get(key("rope.dimension_count"), head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"{gguf.path}: RoPE on {rope_dims} of {head_dim} head dimensions is not supported")
    embeddings = gguf.tensors.get("token_embd.weight")
    if embeddings is None:
        raise GGUFError(f"{gguf.path}: no token_embd.weight tensor")
    eos = _eos_ids(gguf)
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture], "model_type": spec.model_type,
        "vocab_size": embeddings.shape[0], "hidden_size": hidden,
        "intermediate_size": int(gguf.require(key("feed_forward_length"))),
        "num_hidden_layers": int(gguf.require(key("block_count"))), "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.get(key("attention.head_count_kv"), heads)), "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": int(gguf.get(key("context_length"), 2048)),
        "rms_norm_eps": _f32(gguf.require(key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": _f32(gguf.get(key("rope.freq_base"), 10000.0)),
        "rope_scaling": rope_scaling(gguf, spec, head_dim),
        "attention_bias": spec.attention_bias, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
    }
    if spec.model_type == "qwen2":
        config["use_sliding_window"] = False
    return config


def _eos_ids(gguf: GGUFFile) -> list[int]:
    """EOS, then the end-of-turn token when the file names a different one (<|eot_id|>, <|im_end|>)."""
    ids = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def rope_scaling(gguf: GGUFFile, spec: ArchSpec, head_dim: int) -> dict[str, Any] | None:
    """rope_scaling of config.json: linear from the metadata, llama3 from a rope_freqs tensor."""
    key = (spec.gguf_architecture + ".rope.scaling.{}").format
    kind = gguf.get(key("type"), "none")
    if "rope_freqs.weight" in gguf.tensors:
        return _llama3_scaling(gguf, head_dim)
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(gguf.require(key("factor")))}
    raise GGUFError(f"{gguf.path}: RoPE scaling {kind!r} is not supported (supported: none, linear, llama3)")


# Llama 3.1/3.2's published llama3 RoPE parameters, besides the factor (which the tensor gives).
# (low_freq_factor, high_freq_factor, original_max_position_embeddings)
_LLAMA3_CANDIDATES: list[tuple[float, float, int]] = [(1.0, 4.0, 8192)]


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old_len: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for llama3 RoPE scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))


def _llama3_scaling(gguf: GGUFFile, head_dim: int) -> dict[str, Any]:
    tensor = gguf.tensors["rope_freqs.weight"]
    stored = dequantize(tensor.raw, tensor.ggml_type, tensor.shape).astype(np.float64).reshape(-1)
    theta = _f32(gguf.get(f"{gguf.require('general.architecture')}.rope.freq_base", 10000.0))
    factor = float(stored.max())
    for low, high, old_len in _LLAMA3_CANDIDATES:
        want = llama3_factors(head_dim, theta, factor, low, high, old_len)
        if want.shape == stored.shape and np.allclose(want, stored, rtol=1e-4):
            return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old_len}
    raise GGUFError(f"{gguf.path}: its rope_freqs tensor matches no known llama3 RoPE scaling; not imported")
