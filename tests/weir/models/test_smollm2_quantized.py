"""The default chat model served quantized: the int4 layout holds the GGUF's Q4_1 (and Q8_0) blocks
exactly, the weights take <= 160 MB, and greedy tokens agree with float32's."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.engine_quality import PROMPTS, top1_agreement
from kernels import cpu_quant
from safetensors import safe_open
from services.worker.engine.model import load_model
from services.worker.engine.tokenizer import ModelTokenizer

CPU = torch.device("cpu")


def test_int4_holds_the_gguf_values_exactly_in_160_mb(smollm2_dir: Path) -> None:
    model = load_model(smollm2_dir, CPU, torch.float32, "int4")
    assert model.weight_bytes <= 160e6, model.weight_bytes
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as fh:
        down = fh.get_tensor("model.layers.7.mlp.down_proj.weight")  # Q4_1 in the file
        embed = fh.get_tensor("model.embed_tokens.weight")  # Q8_0 in the file
    layer = model.model.layers[7].mlp.down_proj
    assert torch.equal(cpu_quant.dequantize_int4(layer.qweight, layer.scales, layer.mins), down)
    emb = model.model.embed_tokens
    assert torch.equal(cpu_quant.dequantize_int8(emb.qweight, emb.scales), embed)
    assert model.lm_head.qweight is emb.qweight  # tied: one copy


def test_int8_and_int4_agree_with_float32(smollm2_dir: Path) -> None:
    reference = load_model(smollm2_dir, CPU, torch.float32)
    tokenizer = ModelTokenizer(smollm2_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    for quantization in ("int8", "int4"):
        model = load_model(smollm2_dir, CPU, torch.float32, quantization)
        assert model.weight_bytes <= 160e6
        top1, _free, _ = top1_agreement(reference, model, prompts, 16)
        assert top1 >= 0.9, f"{quantization}: {top1:.3f}"
