"""Presence/frequency penalties and logit_bias through the engine: on the trained default model
(weir-tiny-py) they change what it writes; on a tiny random model, determinism holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.engine import Engine, EngineConfig

from .factories import make_request

WEIR_TINY_PY = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"
PROMPT = "def parse_args(argv):\n"


def generate(engine: Engine, *requests) -> dict[str, list[int]]:
    """Run `requests` together to the end; the output token ids of each."""
    for request in requests:
        assert engine.add(request, 0) is None
    ids: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_work:
        for out in engine.step(0):
            ids[out.request_id].extend(out.token_ids)
    return ids


@pytest.fixture(scope="module")
def tiny_py() -> Engine:
    return Engine(WEIR_TINY_PY, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20))


def num_repeats(ids: list[int]) -> int:
    """Tokens that repeat an earlier token of the same output."""
    return len(ids) - len(set(ids))


@pytest.fixture(scope="module")
def greedy_outputs(tiny_py) -> dict[str, list[int]]:
    """64 greedy tokens of PROMPT, without penalty and with each penalty at its strongest, in one batch."""
    requests = [
        make_request(PROMPT, request_id=name, max_tokens=64, ignore_eos=True, **penalty)
        for name, penalty in [
            ("plain", {}),
            ("frequency", {"frequency_penalty": 2.0}),
            ("presence", {"presence_penalty": 2.0}),
        ]
    ]
    return generate(tiny_py, *requests)


def test_a_strong_frequency_penalty_changes_greedy_output_and_removes_repeats(greedy_outputs):
    plain, penalised = greedy_outputs["plain"], greedy_outputs["frequency"]
    assert penalised != plain
    # greedy weir-tiny-py loops ("the list of the list of the list..."); the penalty breaks the loops
    assert num_repeats(plain) > 20
    assert num_repeats(penalised) < num_repeats(plain) / 2


def test_a_presence_penalty_changes_greedy_output(greedy_outputs):
    plain, penalised = greedy_outputs["plain"], greedy_outputs["presence"]
    assert penalised != plain
    assert num_repeats(penalised) < num_repeats(plain) / 2


def test_logit_bias_bans_and_forces_tokens_in_greedy_decoding(tiny_py):
    plain = make_request(PROMPT, max_tokens=12, ignore_eos=True)
    first = generate(tiny_py, plain)[plain.request_id]
    banned = make_request(PROMPT, max_tokens=12, ignore_eos=True, logit_bias={str(t): -100 for t in set(first)})
    forced = make_request(PROMPT, max_tokens=12, ignore_eos=True, logit_bias={"42": 100})
    out = generate(tiny_py, banned, forced)
    assert not set(out[banned.request_id]) & set(first)
    assert out[forced.request_id] == [42] * 12


def test_logit_bias_outside_the_vocabulary_is_rejected(tiny_py):
    vocab_size = tiny_py.model.args.vocab_size
    end = tiny_py.add(make_request(PROMPT, logit_bias={"5": 1, str(vocab_size): -100}), 0)
    assert end is not None and end.finish_reason == "rejected"
    assert end.error is not None and end.error.code == "invalid_logit_bias"
    assert str(vocab_size) in end.error.message and f"0 to {vocab_size - 1}" in end.error.message
    last = make_request(PROMPT, max_tokens=2, ignore_eos=True, logit_bias={str(vocab_size - 1): 1})
    assert generate(tiny_py, last)[last.request_id]  # the last id of the vocabulary is fine


def test_penalised_sampling_is_reproducible_through_preemption_and_crowds(llama_dir):
    """A request regenerated with its seed gives the same tokens, alone or squeezed in a crowd
    that forces chunked prefill and preemption: penalties depend only on its own output."""

    def penalised(request_id: str):
        return make_request(
            "def add(a, b):\n    return a + b\n" * 3,
            request_id=request_id,
            temperature=0.8,
            seed=5,
            max_tokens=30,
            presence_penalty=0.8,
            frequency_penalty=0.6,
            logit_bias={"7": 3.0},
        )

    alone = Engine(llama_dir, EngineConfig(max_model_len=128, kv_cache_bytes=4 << 20))
    alone.eos_ids = set()
    reference = generate(alone, penalised("p"))["p"]
    tight = EngineConfig(
        max_model_len=128, max_num_batched_tokens=7, block_size=4, kv_cache_bytes=alone.kv_bytes_per_token * 4 * 40
    )
    squeezed = Engine(llama_dir, tight)
    squeezed.eos_ids = set()
    crowd = [
        make_request("def add(a, b):\n    return a + b\n" * 3, max_tokens=30, temperature=1.0, frequency_penalty=-1.0)
        for _ in range(5)
    ]
    out = generate(squeezed, *crowd, penalised("p"))
    assert squeezed.scheduler.num_preemptions > 0
    assert out["p"] == reference
