"""Engine tests on tiny random models: exactness against transformers, batching, cache pressure."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine import Engine, EngineConfig

from .factories import make_request

transformers = pytest.importorskip("transformers")

PROMPTS = ["def add(a, b):", "import os\n", "class Point:\n    def", "x", "for i in range(10):\n    if i % 2"]


def run_all(engine: Engine, now_ms: int = 0) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(10_000):
        if not engine.has_work:
            break
        for out in engine.step(now_ms):
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def output_ids(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def hf_greedy(model_dir, engine: Engine, prompt: str, n: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = engine.tokenizer.encode(prompt)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch_dir", ["llama_dir", "qwen2_dir"])
def test_batched_greedy_matches_transformers(arch_dir, request):
    model_dir = request.getfixturevalue(arch_dir)
    engine = Engine(model_dir, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    engine.eos_ids = set()  # random weights: compare full lengths
    reqs = [make_request(p, max_tokens=10) for p in PROMPTS]
    for r in reqs:
        assert engine.add(r, 0) is None
    outputs = run_all(engine)
    for r, p in zip(reqs, PROMPTS, strict=True):
        events = outputs[r.request_id]
        assert events[-1].finish_reason == "length"
        # each output at the position of its first token: the tokens before it
        assert [e.seq for e in events] == [sum(len(p.token_ids) for p in events[:i]) for i in range(len(events))]
        assert output_ids(events) == hf_greedy(model_dir, engine, p, 10), p


def test_chunked_prefill_and_preemption_give_same_tokens(llama_dir):
    """A tiny step budget (chunked prefill) and a tiny cache (preemption) change nothing."""
    reference = Engine(llama_dir, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    # 40 blocks of 4 tokens: six 60-token sequences cannot all fit, so some are preempted
    tight = EngineConfig(
        max_model_len=128, max_num_batched_tokens=7, block_size=4, kv_cache_bytes=reference.kv_bytes_per_token * 4 * 40
    )
    squeezed = Engine(llama_dir, tight)
    for e in (reference, squeezed):
        e.eos_ids = set()
    long_prompt = "def add(a, b):\n    return a + b\n" * 3
    results = []
    for engine in (reference, squeezed):
        reqs = [make_request(long_prompt, request_id=f"r{i}", max_tokens=30) for i in range(6)]
        for r in reqs:
            engine.add(r, 0)
        outs = run_all(engine)
        results.append({rid: output_ids(ev) for rid, ev in outs.items()})
    assert results[0] == results[1]
    assert squeezed.scheduler.num_preemptions > 0
    assert squeezed.blocks.num_free == squeezed.blocks.num_blocks


def test_prefix_cache_hits_for_shared_prompt(llama_dir):
    engine = Engine(llama_dir, EngineConfig(max_model_len=128, block_size=4, kv_cache_bytes=4 << 20))
    shared = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    engine.add(make_request(shared + "a", max_tokens=2), 0)
    run_all(engine)
    engine.add(make_request(shared + "b", max_tokens=2), 0)
    run_all(engine)
    assert engine.blocks.num_prefix_hits > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(llama_dir):
    engine = Engine(llama_dir, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    engine.eos_ids = set()
    alone = make_request("def ", request_id="a1", temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    engine.add(alone, 0)
    first = output_ids(run_all(engine)["a1"])
    crowd = [make_request(p, temperature=1.0, max_tokens=12) for p in PROMPTS]
    again = make_request("def ", request_id="a2", temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    for r in [*crowd, again]:
        engine.add(r, 0)
    assert output_ids(run_all(engine)["a2"]) == first


def test_stop_string_cuts_output(llama_dir):
    engine = Engine(llama_dir, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    engine.eos_ids = set()
    probe = make_request("def ", max_tokens=12)
    engine.add(probe, 0)
    full = "".join(e.text for e in run_all(engine)[probe.request_id])
    stop = full[3:5]
    req = make_request("def ", max_tokens=12, stop=[stop])
    engine.add(req, 0)
    events = run_all(engine)[req.request_id]
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert stop not in text and full.startswith(text)


def test_refusals_cancel_and_timeout(llama_dir):
    engine = Engine(llama_dir, EngineConfig(max_model_len=32, kv_cache_bytes=4 << 20))
    prompt = "def add(a, b): return a + b " * 20
    too_long = engine.add(make_request(prompt), 0)
    assert too_long.finish_reason == "rejected" and too_long.error.code == "prompt_too_long"
    num_tokens = len(engine.tokenizer.encode(prompt))
    assert too_long.error.message == (  # OpenAI's words, which clients match (LiteLLM's context-window fallbacks)
        f"This model's maximum context length is 32 tokens. However, your prompt resulted in {num_tokens} tokens, "
        "which leaves no room for the completion. Please reduce the length of the prompt."
    )
    expired = engine.add(make_request("x", deadline_ms=5), 10)
    assert expired.finish_reason == "timeout"
    running = make_request("x", max_tokens=20, deadline_ms=1_000)
    cancelled = make_request("y", max_tokens=20)
    engine.add(running, 0)
    engine.add(cancelled, 0)
    engine.step(0)
    end = engine.cancel(cancelled.request_id, 1)
    assert end.finish_reason == "cancelled"
    assert engine.cancel(cancelled.request_id, 1) is None
    outs = engine.step(2_000)
    assert [o.finish_reason for o in outs if o.is_final] == ["timeout"]
    assert not engine.has_work and engine.blocks.num_free == engine.blocks.num_blocks


def test_non_finite_logits_fail_only_that_request(llama_dir, monkeypatch):
    engine = Engine(llama_dir, EngineConfig(max_model_len=64, kv_cache_bytes=4 << 20))
    good, bad = make_request("x", max_tokens=3), make_request("y", max_tokens=3, temperature=0.5)
    engine.add(good, 0)
    engine.add(bad, 0)
    real_run = engine._run

    def poisoned(plan):
        logits = real_run(plan).clone()
        sampled = [c for c in plan.prefills if c.samples] + plan.decodes
        for row, chunk in enumerate(sampled):
            if chunk.seq.request_id == bad.request_id:
                logits[row, 0] = float("nan")
        return logits

    monkeypatch.setattr(engine, "_run", poisoned)
    outs = run_all(engine)
    assert outs[bad.request_id][-1].error.code == "non_finite_logits"
    assert outs[good.request_id][-1].finish_reason in ("length", "stop")


def test_decode_groups_by_width_give_same_tokens(llama_dir, monkeypatch):
    """On the CPU decodes are attended in groups of similar block-table widths; any grouping
    yields the tokens of one padded group."""
    import services.worker.engine.llm_engine as engine_module

    prompts = ["def add(a, b):\n    return a + b\n" * 4, "x", "import os\n" * 6, "class Point:\n    def"]
    results, num_groups = [], []
    for min_saving in (10**9, 1):
        monkeypatch.setattr(engine_module, "DECODE_GROUP_MIN_SAVING_BLOCKS", min_saving)
        engine = Engine(llama_dir, EngineConfig(max_model_len=128, block_size=4, kv_cache_bytes=4 << 20))
        engine.eos_ids = set()
        real_model = engine.model
        seen: list[int] = []

        def spy(ids, pos, kv, meta, real_model=real_model, seen=seen):
            seen.append(len(meta.decode_groups))
            return real_model(ids, pos, kv, meta)

        monkeypatch.setattr(engine, "model", spy)
        reqs = [make_request(p, request_id=f"r{i}", max_tokens=12) for i, p in enumerate(prompts)]
        for r in reqs:
            engine.add(r, 0)
        results.append({rid: output_ids(ev) for rid, ev in run_all(engine).items()})
        num_groups.append(max(seen))
    assert results[0] == results[1]
    assert num_groups == [1, max(num_groups)] and num_groups[1] > 1
