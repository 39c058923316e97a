"""The less common parts of a GGUF file: llama3 RoPE factors (a rope_freqs tensor) and a
SentencePiece vocabulary (tokenizer.ggml.model = llama), against transformers' own readings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from weir.models.gguf_config import llama3_factors
from weir.models.gguf_import import import_gguf

from .factories import byte_level_tokenizer_meta, write_gguf

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _base_meta(**extra: object) -> dict[str, object]:
    return {"llama.block_count": 0, "llama.embedding_length": 256, "llama.feed_forward_length": 128,
            "llama.attention.head_count": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.rope.freq_base": 500000.0, **extra}


def test_llama3_factors_are_the_ones_transformers_divides_its_frequencies_by() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    factors = llama3_factors(64, 500000.0, 32.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(plain.numpy() / factors, scaled.double().numpy(), rtol=1e-5)


def test_a_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path: Path) -> None:
    factors = llama3_factors(64, 500000.0, 32.0, 1.0, 4.0, 8192).astype(np.float32)
    tensors = [("token_embd.weight", np.ones((4096, 256), np.float32), Q.F16), ("rope_freqs.weight", factors, Q.F32)]
    src = write_gguf(tmp_path / "l3.gguf", "llama", {**_base_meta(), **byte_level_tokenizer_meta()}, tensors)
    config = json.loads((import_gguf(src, tmp_path / "out") / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3 and config["rope_theta"] == 500000.0


def _sentencepiece_meta() -> dict[str, object]:
    """A small SentencePiece vocabulary as llama.cpp stores one: <unk> <s> </s>, 256 byte tokens, pieces."""
    pieces = ["\u2581", "t", "h", "e", "a", "c", "o", "n", "\u2581t", "he", "\u2581the", "at", "\u2581c", "\u2581cat",
              "on", "\u2581on", "\u2581a", "s", "\u2581s", "i", "\u2581is", "\u2581sat", "\u2581at", "<tool>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def test_a_sentencepiece_vocabulary_encodes_as_transformers_gguf_loader_does(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    meta = _sentencepiece_meta()
    tensors = [("token_embd.weight", np.ones((len(meta["tokenizer.ggml.tokens"]), 256), np.float32), Q.F16)]
    src = write_gguf(tmp_path / "spm.gguf", "llama", {**_base_meta(), **meta}, tensors)
    out = import_gguf(src, tmp_path / "out")
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["the cat sat on a cat", "the cat is at the sea", "that\nhot é!", "the  cat ", "chat\t\u00e9t\u00e9"]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
    # After a special or user-defined token llama.cpp prefixes a space again (as SentencePiece's
    # "legacy" mode does), and before text that starts with a space; transformers' GGUF loader does
    # neither, so on those the two differ on purpose.
    assert ours.encode("<tool> the</s>cat", add_special_tokens=False).tokens == ["<tool>", "\u2581", "\u2581the", "</s>", "\u2581cat"]
    assert ours.encode("the cat", add_special_tokens=False).tokens == ["\u2581the", "\u2581cat"]
    assert ours.encode("\n", add_special_tokens=False).tokens == ["\u2581", "<0x0A>"]  # byte fallback
    assert ours.decode(ours.encode("the cat sat", add_special_tokens=False).ids) == "the cat sat"
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", True)
