"""Prompt logprobs (what lm-eval's loglikelihood tasks read through `echo` + `logprobs`) and
prompts of token ids, in the engine: on the trained default model (weir-tiny-py) against
transformers; through chunked prefill, beside a cached prefix, next to other requests in a step,
and with max_tokens 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.messages import ReplyDelta, ReplyEnd
from services.worker.engine import Engine, EngineConfig
from services.worker.kafka.events import reply_events

from .factories import make_request

transformers = pytest.importorskip("transformers")

WEIR_TINY_PY = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(WEIR_TINY_PY, dtype=torch.float32).eval()


def engine(**config) -> Engine:
    return Engine(WEIR_TINY_PY, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20, **config))


@pytest.fixture(scope="module")
def tiny_py() -> Engine:
    return engine()


@pytest.fixture(scope="module")
def chunked() -> Engine:
    """Prefill in chunks of at most 8 tokens a step (the prompt takes several steps)."""
    return engine(max_num_batched_tokens=8, max_num_seqs=4)


def run(engine: Engine, *requests) -> dict[str, list]:
    for request in requests:
        assert engine.add(request, 0) is None
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work:
        for out in engine.step(0):
            outputs[out.request_id].append(out)
    return outputs


def expected(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position: row p predicts token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def check(entries, prompt_ids: list[int], want: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt_ids) and entries[0].logprob is None  # nothing predicts the first token
    assert entries[0].token_id == prompt_ids[0] and entries[0].top_logprobs == []
    for p, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == prompt_ids[p]
        assert entry.logprob == pytest.approx(float(want[p - 1, prompt_ids[p]]), abs=1e-4)
        top_values, top_ids = torch.topk(want[p - 1], k)
        assert [t.token_id for t in entry.top_logprobs] == top_ids.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_py", "chunked"])
def test_prompt_logprobs_are_the_models_over_the_whole_prompt(fixture, hf_model, request) -> None:
    """Every prompt token after the first gets transformers' logprob and top alternatives, whether
    the prefill ran in one step or in chunks of 8; the generated tokens follow as usual."""
    eng = request.getfixturevalue(fixture)
    asked = make_request(PROMPT, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    outputs = run(eng, asked)[asked.request_id]
    prompt_ids = eng.tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 16
    final = outputs[-1]
    check(final.prompt_logprobs, prompt_ids, expected(hf_model, prompt_ids), 2)
    assert final.completion_tokens == 4 and all(o.prompt_logprobs is None for o in outputs[:-1])


def test_a_cached_prefix_is_not_reused_by_a_request_that_asks(chunked, hf_model) -> None:
    """A request asking prompt logprobs computes its whole prompt even when the cache holds it
    (a cached prefix has no logits): same values as cold, no cached tokens; one that does not ask
    reuses the cache as before."""
    warm = make_request(PROMPT, max_tokens=1)
    run(chunked, warm)
    again = make_request(PROMPT, max_tokens=1)
    asked = make_request(PROMPT, max_tokens=1, prompt_logprobs=0)
    outputs = run(chunked, again)
    outputs.update(run(chunked, asked))
    assert outputs[again.request_id][-1].cached_prompt_tokens > 0
    final = outputs[asked.request_id][-1]
    assert final.cached_prompt_tokens == 0
    prompt_ids = chunked.tokenizer.encode(PROMPT)
    check(final.prompt_logprobs, prompt_ids, expected(hf_model, prompt_ids), 0)


def test_max_tokens_zero_answers_only_the_prompt_and_rides_beside_other_requests(tiny_py, hf_model) -> None:
    """max_tokens 0 with prompt_logprobs ends after the prefill ("length", nothing generated, no
    delta); a request generating with logprobs in the same steps gets what it gets alone."""
    alone = make_request("import os\n", max_tokens=6, logprobs=1, ignore_eos=True)
    by_itself = run(tiny_py, alone)[alone.request_id]
    only = make_request(PROMPT, max_tokens=0, prompt_logprobs=1)
    beside = make_request("import os\n", max_tokens=6, logprobs=1, ignore_eos=True)
    outputs = run(tiny_py, only, beside)
    final = outputs[only.request_id][-1]
    assert [o.is_final for o in outputs[only.request_id]] == [True]
    assert (final.finish_reason, final.completion_tokens, final.token_ids, final.text) == ("length", 0, [], "")
    prompt_ids = tiny_py.tokenizer.encode(PROMPT)
    check(final.prompt_logprobs, prompt_ids, expected(hf_model, prompt_ids), 1)

    def lps(outs):
        return [(lp.token_id, round(lp.logprob, 4)) for o in outs for lp in o.logprobs or []]

    assert lps(outputs[beside.request_id]) == lps(by_itself)
    events = [ev for out in outputs[only.request_id] for ev in reply_events(only, "b-1", out, "weir-tiny-py@1")]
    assert len(events) == 1 and isinstance(events[0], ReplyEnd) and not any(isinstance(e, ReplyDelta) for e in events)
    assert events[0].prompt_logprobs == final.prompt_logprobs and events[0].usage.prompt_tokens == len(prompt_ids)


def test_a_prompt_of_token_ids_runs_as_its_text_does(tiny_py) -> None:
    """prompt_token_ids run as given: the same tokens as the text prompt they encode; ids outside
    the vocabulary are refused."""
    ids = tiny_py.tokenizer.encode(PROMPT)
    text = make_request(PROMPT, max_tokens=6, ignore_eos=True)
    tokens = make_request(None, prompt_token_ids=ids, max_tokens=6, ignore_eos=True)
    outputs = run(tiny_py, text, tokens)

    def ids_of(outs):
        return [t for o in outs for t in o.token_ids]

    assert ids_of(outputs[tokens.request_id]) == ids_of(outputs[text.request_id]) and ids_of(outputs[text.request_id])
    assert outputs[tokens.request_id][-1].prompt_tokens == len(ids)
    refused = tiny_py.add(make_request(None, prompt_token_ids=[1, 10**7]), 0)
    assert refused is not None and (refused.finish_reason, refused.error.code) == ("rejected", "invalid_prompt")
