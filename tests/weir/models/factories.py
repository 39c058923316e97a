"""GGUF files for the import tests, written with the gguf package the way llama.cpp's converter does.

    write_gguf(path, arch, meta, tensors)    any metadata and tensors (raw bytes for quantized types)
    hf_to_gguf(model_dir, path, arch=...)    a Hugging Face Llama/Qwen2 directory as a GGUF file: the
                                             names, the metadata and (llama) the q/k row permutation of
                                             convert_hf_to_gguf.py, with its byte-level vocabulary
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "weir-tiny-py"
F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16


def write_gguf(path: Path, arch: str, meta: dict[str, Any], tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]]) -> Path:
    """A GGUF file; each tensor is float32 values, stored as its type (quantized with gguf's quantize)."""
    writer = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, values, qtype in tensors:
        if qtype == F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute() of q/k rows (what the import undoes)."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def byte_level_tokenizer_meta(tokenizer_json: Path = TINY / "tokenizer.json", pre: str = "gpt2") -> dict[str, Any]:
    """tokenizer.ggml.* metadata of a byte-level BPE tokenizer.json (token 0 a control token)."""
    model = json.loads(tokenizer_json.read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}


_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, *rest = hf_name.split(".")  # model.layers.N.<module>.<leaf>
    return f"blk.{layer}.{_LAYER['.'.join(rest[:-1])]}.{rest[-1]}"


def hf_to_gguf(model_dir: Path, path: Path, arch: str = "llama", qtype: GGMLQuantizationType = F16,
               tokenizer_meta: dict[str, Any] | None = None) -> Path:
    """The HF model in `model_dir` as a GGUF file: matrices as `qtype`, vectors (norms, biases) F32."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = []
    for name, values in load_file(str(model_dir / "model.safetensors")).items():
        values = values.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            values = permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute(values, kv_heads)
        tensors.append((gguf_name(name), values, qtype if values.ndim == 2 else F32))
    meta = {
        f"{arch}.block_count": config["num_hidden_layers"], f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"], f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.rope.freq_base": float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        **(tokenizer_meta if tokenizer_meta is not None else byte_level_tokenizer_meta()),
    }
    return write_gguf(path, arch, meta, tensors)
