"""RoPE scaling: Weir's engine matches transformers on tiny random Llamas with rope_scaling, past
the original context, for each supported type; other types are refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.engine import Engine, EngineConfig
from services.worker.engine.kv_cache import allocate_kv_caches
from services.worker.engine.model import AttentionMetadata, ModelLoadError, load_model

from .factories import make_model_dir, make_request

transformers = pytest.importorskip("transformers")

ORIGINAL_LEN = 32  # positions the (pretend) pretraining saw; every test goes past them
# name -> (config.json key to write it under, the scaling dict, max_position_embeddings)
SCALINGS = {
    "linear": ("rope_scaling", {"type": "linear", "factor": 2.0}, ORIGINAL_LEN),  # the older `type` key
    "dynamic": ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, ORIGINAL_LEN),
    "llama3": (
        "rope_parameters",
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_LEN,
        },
        96,
    ),
}


def scaled_model_dir(path: Path, name: str) -> Path:
    """A random Llama (2 layers, hidden 64, 4 heads, 2 KV heads, vocabulary 300) saved by transformers, its
    config.json carrying the scaling under the key SCALINGS names (as real checkpoints do)."""
    key, scaling, max_pos = SCALINGS[name]
    # initializer_range 0.2, not 0.02: attention sharp enough that positions change greedy tokens;
    # no eos: both sides generate every token (transformers' min_new_tokens would mask eos instead)
    path = make_model_dir(
        path,
        "llama",
        seed=1,
        max_position_embeddings=max_pos,
        rope_scaling=dict(scaling),
        initializer_range=0.2,
        eos_token_id=None,
    )
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config[key] = {**scaling, "rope_theta": 10000.0} if key == "rope_parameters" else dict(scaling)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, scaled_model_dir(tmp_path_factory.mktemp(request.param) / "m", request.param)


def hf_model(path: Path):
    """A fresh transformers model: its dynamic NTK frequencies are state that grows with use."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def weir_prefill_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill of `ids` through Weir's model and paged KV cache."""
    model = load_model(path, torch.device("cpu"), torch.float32)
    a, block_size, n = model.args, 8, len(ids)
    kv = allocate_kv_caches(
        a.num_layers, -(-n // block_size), block_size, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu")
    )
    meta = AttentionMetadata(slot_mapping=torch.arange(n))
    meta.prefills.append((0, n, torch.arange(-(-n // block_size)), n))
    meta.logits_indices = torch.arange(n)
    if model.rotary.needs_seq_lens(n):
        meta.rope_seq_lens = torch.full((n,), n)  # a prompt's tokens rotate for the prompt's length
    return model(torch.tensor(ids), torch.arange(n), kv, meta)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_logits_match_transformers_past_the_original_length(scaled_dir):
    _name, path = scaled_dir
    ids = prompt_ids(56)  # positions 0..55, past ORIGINAL_LEN
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(weir_prefill_logits(path, ids), expected)  # float32 tolerances


def test_scaling_changes_the_logits(scaled_dir, tmp_path):
    """The same weights without rope_scaling give other logits: the comparison above means something."""
    _name, path = scaled_dir
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in path.iterdir():
        (plain / file.name).write_bytes(file.read_bytes())
    config = json.loads((plain / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    config["max_position_embeddings"] = 128  # plain RoPE's table must reach the positions too
    (plain / "config.json").write_text(json.dumps(config))
    ids = prompt_ids(56)
    scaled, unscaled = weir_prefill_logits(path, ids), weir_prefill_logits(plain, ids)
    assert (scaled[ORIGINAL_LEN:] - unscaled[ORIGINAL_LEN:]).abs().max() > 1e-3


def run_greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    requests = [make_request(request_id=f"r{i}", max_tokens=max_tokens, ignore_eos=True) for i in range(len(prompts))]
    for request, ids in zip(requests, prompts, strict=True):
        assert engine.add_tokens(request, ids, 0) is None
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_work:
        for event in engine.step(0):
            out[event.request_id].extend(event.token_ids)
    return [out[r.request_id] for r in requests]


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    out = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("budget", [512, 8], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_decoding_matches_transformers_past_the_original_length(scaled_dir, budget):
    """A prompt within the original context decoding past it, and one longer than it; batched
    together, and (budget 8) with chunked prefills, which dynamic NTK must not notice."""
    name, path = scaled_dir
    engine = Engine(path, EngineConfig(max_model_len=64, max_num_batched_tokens=budget, kv_cache_bytes=4 << 20))
    prompts, max_tokens = [prompt_ids(20, seed=1), prompt_ids(40, seed=2)], 22  # to positions 41 and 61
    got = run_greedy(engine, prompts, max_tokens)
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(path, ids, max_tokens), name


@pytest.mark.parametrize(
    "scaling, message",
    [
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            "rope type 'yarn' is not supported; supported: default, linear, dynamic, llama3",
        ),
        ({"type": "su", "factor": 2.0}, "rope type 'su' is not supported"),
        (
            {"type": "linear", "factor": 2.0, "finetuned": True},
            r"keys \['finetuned'\] are not used by rope type 'linear'",
        ),
        ({"rope_type": "llama3", "factor": 8.0}, "needs \\['high_freq_factor', 'low_freq_factor'\\]"),
        ({"rope_type": "dynamic", "factor": 0.5}, "factor=0.5 must be >= 1"),
    ],
)
def test_unsupported_rope_scaling_is_refused_at_load(scaling, message, tmp_path):
    path = make_model_dir(tmp_path / "m", "llama", max_position_embeddings=32)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = scaling
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, torch.device("cpu"), torch.float32)


def test_context_length_follows_the_scaling(scaled_dir):
    name, path = scaled_dir
    engine = Engine(path, EngineConfig(max_model_len=4096, kv_cache_bytes=4 << 20))
    assert engine.max_model_len == {"linear": 64, "dynamic": 64, "llama3": 96}[name]
    assert engine.blocks.enable_prefix_caching == (name != "dynamic")
