"""The green-list watermark: the default model generates with it in-process, the detector finds it.

Evidence the issue asks for: watermarked texts of >= 200 tokens score z > 4 after the text is
re-tokenized (as the auditor's detector does); unwatermarked texts do not; the false-positive
rate at z > 4 is <= 1% over 1,000 unwatermarked 200-token sequences, both uniform random token ids
and windows of human-written text (the Python standard library's source); the watermark keeps a
request's tokens deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.messages import GenerateRequest, now_ms
from schemas.watermark import WatermarkConfig, detect, green_mask, is_green, parse_tenants
from services.worker.engine import Engine, EngineConfig
from services.worker.engine.sampler import sample
from services.worker.engine.watermark import Watermarker

MODEL = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"
CONFIG = WatermarkConfig(gamma=0.25, delta=2.0, key=b"acme-watermark-key")
PROMPTS = [
    "def main():",
    "import os\n",
    "class Stack:\n",
    "# parse the arguments\n",
    "def add(a, b):\n",
    "for i in range(10):\n",
    "with open(path) as f:\n",
    "try:\n",
]


def generate(engine: Engine, tenant: str, **overrides) -> dict[str, list[int]]:
    """Output token ids per request id, for every prompt, 200 tokens each."""
    for i, prompt in enumerate(PROMPTS):
        fields = dict(
            request_id=f"{tenant}-{i}",
            model="weir-tiny-py",
            prompt=prompt,
            max_tokens=200,
            ignore_eos=True,
            temperature=1.0,
            tenant=tenant,
            deadline_ms=now_ms() + 600_000,
            reply_to="-",
        )
        fields.update(overrides)
        assert engine.add(GenerateRequest(**fields), now_ms()) is None
    outs = {}
    while engine.has_work:
        for out in engine.step(now_ms()):
            if out.is_final:
                outs[out.request_id] = out
    return outs


@pytest.fixture(scope="module")
def engine() -> Engine:
    if not (MODEL / "model.safetensors").exists():
        pytest.skip(f"the default model is not in {MODEL}")
    torch.set_num_threads(1)
    return Engine(MODEL, EngineConfig(), torch.device("cpu"), Watermarker({"acme": CONFIG}))


def test_watermarked_outputs_are_detected_from_their_text(engine: Engine) -> None:
    outs = generate(engine, "acme")
    for out in outs.values():
        assert out.completion_tokens == 200
        retokenized = engine.tokenizer.encode(out.output_text)
        found = detect(CONFIG, retokenized)
        assert found.num_scored >= 150 and found.z_score > 4, (out.request_id, found)
        assert found.p_value < 1e-4
        assert out.watermark_z is not None and out.watermark_z > 4
        assert out.mean_token_entropy is not None and out.mean_token_entropy > 0
        assert detect(WatermarkConfig(0.25, 2.0, b"another key"), retokenized).z_score < 4


def test_unwatermarked_outputs_are_not_detected(engine: Engine) -> None:
    outs = generate(engine, "other-tenant")
    for out in outs.values():
        assert out.watermark_z is None
        assert detect(CONFIG, engine.tokenizer.encode(out.output_text)).z_score < 4


def test_watermark_keeps_tokens_deterministic_per_request(engine: Engine) -> None:
    first = generate(engine, "acme", top_p=0.9, temperature=0.8)
    again = generate(engine, "acme", top_p=0.9, temperature=0.8)
    assert {k: v.output_text for k, v in first.items()} == {k: v.output_text for k, v in again.items()}


def test_false_positive_rate_over_1000_random_sequences() -> None:
    rng = np.random.default_rng(1234)
    zs = np.array([detect(CONFIG, rng.integers(0, 4096, size=200).tolist()).z_score for _ in range(1000)])
    fpr = float((zs > 4).mean())
    print(f"FPR at z>4 over 1000 random 200-token sequences: {fpr:.3%}; mean z {zs.mean():.3f}, max {zs.max():.2f}")
    assert fpr <= 0.01
    assert abs(float(zs.mean())) < 0.2  # the null is centred: gamma is the green fraction


def test_false_positive_rate_over_1000_human_written_texts(engine: Engine) -> None:
    """1,000 windows of 200 tokens of the Python standard library's own source: real text that no
    watermark touched (and repetitive, a harder null than random tokens)."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    windows: list[list[int]] = []
    for file in files:
        ids = engine.tokenizer.encode(file.read_text(errors="replace"))
        windows += [ids[i : i + 200] for i in range(0, len(ids) - 200, 200)][:10]
        if len(windows) >= 1000:
            break
    assert len(windows) >= 1000
    zs = np.array([detect(CONFIG, w).z_score for w in windows[:1000]])
    fpr = float((zs > 4).mean())
    print(f"FPR at z>4 over 1000 stdlib 200-token windows: {fpr:.3%}; mean z {zs.mean():.3f}, max {zs.max():.2f}")
    assert fpr <= 0.01


def test_green_list_is_a_gamma_fraction_and_membership_agrees() -> None:
    mask = green_mask(CONFIG, 17, 50_000)
    assert abs(mask.mean() - CONFIG.gamma) < 0.01
    assert all(is_green(CONFIG, 17, t) == bool(mask[t]) for t in range(0, 50_000, 499))
    assert not np.array_equal(mask, green_mask(CONFIG, 18, 50_000))  # the split moves with the previous token


def test_zero_bias_samples_like_no_bias() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    request = GenerateRequest(request_id="r", model="m", prompt="x", deadline_ms=1, reply_to="t", temperature=0.9)
    a = [sample(logits, request, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [sample(logits, request, torch.Generator().manual_seed(s), torch.zeros(300)) for s in range(20)]
    assert a == b


def test_tenants_setting_is_parsed_and_errors_name_it() -> None:
    tenants = parse_tenants('{"acme": {"gamma": 0.5, "delta": 1.5, "key": "hex:00ff"}}')
    assert tenants == {"acme": WatermarkConfig(0.5, 1.5, b"\x00\xff")}
    assert parse_tenants("") == {}
    with pytest.raises(ValueError, match="WEIR_WATERMARK_TENANTS"):
        parse_tenants('{"acme": {"gamma": 2, "key": "k"}}')
