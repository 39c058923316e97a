"""Quantized weights in the engine (engine/model.py: QuantLinear) on the committed tiny model:
fewer bytes held, greedy tokens that agree with float32's, served through Engine like float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.engine_quality import PROMPTS, greedy_engine, top1_agreement
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.model import ModelLoadError, QuantLinear, load_model

from .factories import make_request

TINY = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def float_model():
    return load_model(TINY, CPU, torch.float32)


@pytest.mark.parametrize("quantization,least", [("int8", 0.95), ("int4", 0.85)])
def test_quantized_tiny_model_agrees_with_float32(float_model, quantization, least) -> None:
    model = load_model(TINY, CPU, torch.float32, quantization)
    assert model.quantization == quantization
    projections = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(projections) == 4 * model.args.num_layers + 2  # + lm_head and the embedding
    assert model.weight_bytes < float_model.weight_bytes / 3.5
    assert not [p for p in model.parameters() if p.dim() == 2]  # no float matrix left
    from services.worker.engine.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(TINY)
    prompts = [tokenizer.encode(p) for p in ["def add(a, b):", "import os\n", "class Point:\n    def", *PROMPTS[:3]]]
    top1, _free, _ = top1_agreement(float_model, model, prompts, 16)
    assert top1 >= least, f"{quantization}: top-1 agreement {top1:.3f} < {least}"


def test_engine_serves_quantized_weights_as_it_serves_float32() -> None:
    engine = Engine(TINY, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20, quantization="int8"), CPU)
    assert engine.model.quantization == "int8"
    request = make_request("def add(a, b):", max_tokens=8)
    request = request.model_copy(update={"temperature": 0.0, "ignore_eos": True})
    assert engine.add(request, 0) is None
    tokens = []
    while engine.has_work:
        tokens += [t for out in engine.step(0) for t in out.token_ids]
    # the engine's batched path gives what the model's own greedy loop gives
    assert tokens == greedy_engine(engine.model, engine.tokenizer.encode("def add(a, b):"), 8)


def test_unknown_quantization_and_non_float32_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="not one of"):
        load_model(TINY, CPU, torch.float32, "int3")
    with pytest.raises(ModelLoadError, match="float32"):
        load_model(TINY, CPU, torch.bfloat16, "int8")


def test_engine_threads_setting_and_default(monkeypatch) -> None:
    import os

    from services.worker.config import WorkerSettings
    from services.worker.hosts.hardware import cpu_threads

    assert cpu_threads(3) == 3
    owned = len(os.sched_getaffinity(0))
    assert cpu_threads(0) == max(1, owned - 1)
    monkeypatch.setenv("WEIR_ENGINE_THREADS", "2")
    assert WorkerSettings().threads == 2
    monkeypatch.delenv("WEIR_ENGINE_THREADS")
    assert WorkerSettings(torch_threads=1).threads == 1  # the former name still counts
