"""The committed default model, models/weir-tiny-py, is complete, small and Hugging Face-compatible.

The directory is written by scripts/train_default_model.py; Weir's worker loads it with its own
Llama implementation, so these tests pin the format: file set and size, config keys, tensor names,
the tokenizer's exact round trip, and that transformers' LlamaForCausalLM loads it, generates
deterministically and computes the same logits as the training script's own model.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# WEIR_DEFAULT_MODEL_DIR checks a freshly trained directory before it replaces the committed one.
MODEL_DIR = Path(os.environ.get("WEIR_DEFAULT_MODEL_DIR", REPO / "models" / "weir-tiny-py"))
SCRIPT = REPO / "scripts" / "train_default_model.py"
EOS = "<|endoftext|>"

REQUIRED_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "TRAINING.json",
]


def _config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


def test_files_exist_and_total_size_is_small():
    for name in REQUIRED_FILES:
        path = MODEL_DIR / name
        assert path.is_file(), f"{path} is missing; run scripts/train_default_model.py"
        assert path.stat().st_size > 0, f"{path} is empty"
    total = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert total <= 20 * 1024 * 1024, f"{MODEL_DIR} holds {total:,} bytes, over 20 MiB"


def test_config_has_the_llama_keys():
    cfg = _config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    for key, kind in {
        "vocab_size": int,
        "hidden_size": int,
        "intermediate_size": int,
        "num_hidden_layers": int,
        "num_attention_heads": int,
        "num_key_value_heads": int,
        "max_position_embeddings": int,
        "rms_norm_eps": float,
        "rope_theta": float,
        "tie_word_embeddings": bool,
        "bos_token_id": int,
        "eos_token_id": int,
        "torch_dtype": str,
    }.items():
        assert isinstance(cfg.get(key), kind), f"config.json {key}={cfg.get(key)!r}, want {kind.__name__}"
    assert cfg["hidden_act"] == "silu"
    assert cfg["rope_theta"] == 10000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["torch_dtype"] in ("float16", "bfloat16")
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["max_position_embeddings"] >= 512
    assert 0 <= cfg["eos_token_id"] < cfg["vocab_size"]
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    training = json.loads((MODEL_DIR / "TRAINING.json").read_text())
    assert training["val_loss"] > 0 and training["train_loss"] > 0


def test_safetensors_names_shapes_and_dtype():
    from safetensors import safe_open

    cfg = _config()
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    expected = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    if not cfg["tie_word_embeddings"]:
        expected["lm_head.weight"] = (cfg["vocab_size"], h)
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(expected), f"unexpected {names - set(expected)}, missing {set(expected) - names}"
        for name, shape in expected.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == shape, name
            assert str(t.dtype) == f"torch.{cfg['torch_dtype']}", name


ROUND_TRIP_TEXTS = [
    "",
    "def f(x):\n    return x + 1\n",
    "class Foo:\n\tdef bar(self):\n\t\tpass\n\n\n",
    "   leading spaces, trailing spaces   \n\n  \r\n\r\n\t \t",
    "if True:\n        x = {'a': [1, 2, 3]}  # comment\n    else:\n  y = x\n",
    "unicode: héllo wörld — ∑ λ 中文 🐍 \u200b\x00\x7f",
    "    " * 40 + "deeply_indented()\n",
]


def test_tokenizer_round_trips_arbitrary_python_source():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    cfg = _config()
    assert tok.token_to_id(EOS) == cfg["eos_token_id"] == cfg["bos_token_id"]
    assert tok.get_vocab_size() == cfg["vocab_size"]
    texts = ROUND_TRIP_TEXTS + [
        Path(__file__).read_text(),
        SCRIPT.read_text(),
        inspect.getsource(json),
        inspect.getsource(importlib.util),
    ]
    for text in texts:
        ids = tok.encode(text).ids
        if EOS not in text:
            assert cfg["eos_token_id"] not in ids, "the tokenizer must not add special tokens by itself"
        # A literal "<|endoftext|>" (this file has one) becomes the special token and decodes back.
        assert tok.decode(ids, skip_special_tokens=False) == text, repr(text[:80])
    # Python source compresses well: well over 2 bytes per token on average.
    src = inspect.getsource(json)
    assert len(src.encode()) / len(tok.encode(src).ids) > 2.5


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(MODEL_DIR / "tokenizer.json"))
    return model, tok


def test_transformers_loads_and_greedy_generates_deterministically(hf_model):
    import torch

    model, tok = hf_model
    assert (
        model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        or not _config()["tie_word_embeddings"]
    )
    for prompt in ("def ", "import os\n"):
        enc = tok(prompt, return_tensors="pt")
        outs = []
        for _ in range(2):
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    do_sample=False,
                    max_new_tokens=16,
                    min_new_tokens=16,
                    pad_token_id=tok.convert_tokens_to_ids(EOS),
                )
            outs.append(out[0].tolist())
        assert outs[0] == outs[1]
        new = outs[0][enc["input_ids"].shape[1] :]
        assert len(new) >= 10
        text = tok.decode(outs[0])
        assert text.startswith(prompt)
        assert text[len(prompt) :].strip(), f"no visible text generated from {prompt!r}: {text!r}"


def test_training_script_model_matches_transformers_logits(hf_model):
    import torch
    from safetensors.torch import load_file

    model, tok = hf_model
    name = "_weir_train_default_model"
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is created
    spec.loader.exec_module(mod)
    cfg = _config()
    mine = mod.LlamaForCausalLM(
        mod.LlamaArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg["rope_theta"],
            tie_word_embeddings=cfg["tie_word_embeddings"],
        )
    )
    state = {k: v.float() for k, v in load_file(str(MODEL_DIR / "model.safetensors")).items()}
    missing, unexpected = mine.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    mine.eval()
    ids = torch.tensor([tok(inspect.getsource(json))["input_ids"][:200]])
    with torch.no_grad():
        ours = mine(ids)
        theirs = model(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=0), (ours - theirs).abs().max()
