"""The import on small GGUF files made here: weir-tiny-py converted as llama.cpp converts (q/k rows
permuted), a random Qwen2 (not permuted), and corrupt files, which are refused and leave nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from weir.models import GGUFError
from weir.models.gguf_import import FILES, MANIFEST, file_sha256, import_gguf

from .factories import TINY, byte_level_tokenizer_meta, hf_to_gguf, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return hf_to_gguf(TINY, tmp_path_factory.mktemp("gguf") / "weir-tiny-py.F16.gguf")


def test_weir_tiny_py_comes_back_tensor_for_tensor_with_q_and_k_unpermuted(tiny_gguf: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    out = import_gguf(tiny_gguf, tmp_path / "tiny", progress=lines.append)
    original = load_file(str(TINY / "model.safetensors"))  # float16, so F16 storage is exact
    imported = load_file(str(out / "model.safetensors"))
    assert set(imported) == set(original)
    for name, values in original.items():
        assert imported[name].dtype == np.float32
        np.testing.assert_array_equal(imported[name], values.astype(np.float32), err_msg=name)
    config, want = json.loads((out / "config.json").read_text()), json.loads((TINY / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == want[key], key
    assert lines[-1].startswith("imported weir-tiny-py.F16.gguf in") and any("[  6/6] final norm" in line for line in lines)


def test_the_manifest_holds_every_file_and_a_second_import_is_reused(tiny_gguf: Path, tmp_path: Path) -> None:
    out = import_gguf(tiny_gguf, tmp_path / "tiny", source="my-source")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["source"] == "my-source" and manifest["source_sha256"] == file_sha256(tiny_gguf)
    assert set(manifest["files"]) == set(FILES) == {p.name for p in out.iterdir()} - {MANIFEST}
    for name, entry in manifest["files"].items():
        assert entry == {"sha256": file_sha256(out / name), "bytes": (out / name).stat().st_size}
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    assert import_gguf(tiny_gguf, out, progress=lines.append) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp and "reused" in lines[-1]
    import_gguf(tiny_gguf, out, dtype="bfloat16")  # another dtype is another import
    assert json.loads((out / MANIFEST).read_text())["dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < manifest["files"]["model.safetensors"]["bytes"] * 0.6
    left = sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock")  # the build lock stays, empty
    assert left == ["tiny"]  # no temporary directory left


def test_a_random_qwen2_keeps_its_biases_and_computes_as_before(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=50000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random biases, so a lost one shows
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = import_gguf(hf_to_gguf(tmp_path / "hf", tmp_path / "qwen2.gguf", arch="qwen2", qtype=Q.F32), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    imported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(imported(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def _small_llama(path: Path, **extra: object) -> Path:
    tensors = [("token_embd.weight", np.ones((4096, 64), np.float32), Q.Q8_0),
               ("output_norm.weight", np.ones(64, np.float32), Q.F32)]
    meta = {"llama.block_count": 0, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
            "llama.attention.head_count": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            **byte_level_tokenizer_meta(), **extra}
    return write_gguf(path, str(extra.pop("arch", "llama")), meta, tensors)


def _corrupt(good: Path, how: str) -> Path:
    data = good.read_bytes()
    bad = good.with_name(f"{how}.gguf")
    if how == "flipped-magic":
        bad.write_bytes(b"FUGG" + data[4:])
    elif how == "cut-header":
        bad.write_bytes(data[:200])
    else:  # tensor data cut short
        bad.write_bytes(data[:-1000])
    return bad


@pytest.mark.parametrize(("how", "message"), [
    ("flipped-magic", r"not a GGUF file \(it starts with b'FUGG'"),
    ("cut-header", r"truncated: the header ends at byte \d+, the file has 200 bytes"),
    ("cut-data", r"truncated: the data of tensor 'token_embd.weight' ends at byte \d+, the file has \d+ bytes"),
])
def test_a_corrupt_file_is_refused_by_name_and_leaves_nothing(tmp_path: Path, how: str, message: str) -> None:
    bad = _corrupt(_small_llama(tmp_path / "good.gguf"), how)
    out = tmp_path / "models" / "m"
    with pytest.raises(GGUFError, match=f"^{bad}: {message}"):
        import_gguf(bad, out)
    left = [name for name in os.listdir(tmp_path / "models") if not name.endswith(".lock")]  # the build lock stays
    assert not out.exists() and left == []


def test_what_weir_cannot_serve_is_refused_before_writing(tmp_path: Path) -> None:
    gemma = write_gguf(tmp_path / "g.gguf", "gemma", {"general.architecture": "gemma"}, [])
    with pytest.raises(GGUFError, match=r"g.gguf: architecture 'gemma' is not supported \(supported: llama, qwen2\)"):
        import_gguf(gemma, tmp_path / "out")
    odd_pre = _small_llama(tmp_path / "p.gguf", **{"tokenizer.ggml.pre": "made-up"})
    with pytest.raises(GGUFError, match=r"p.gguf: pre-tokenizer tokenizer.ggml.pre='made-up' is not supported"):
        import_gguf(odd_pre, tmp_path / "out")
    yarn = _small_llama(tmp_path / "y.gguf", **{"llama.rope.scaling.type": "yarn"})
    with pytest.raises(GGUFError, match=r"y.gguf: RoPE scaling 'yarn' is not supported"):
        import_gguf(yarn, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="is not a Weir import"):
        import_gguf(_small_llama(tmp_path / "ok.gguf"), tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_linear_rope_scaling_and_an_end_of_turn_token_reach_config_json(tmp_path: Path) -> None:
    src = _small_llama(tmp_path / "s.gguf", **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
                                                "tokenizer.ggml.eot_token_id": 1})
    config = json.loads((import_gguf(src, tmp_path / "out") / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["eos_token_id"] == [0, 1] and config["tie_word_embeddings"] is True
