"""The embedding engine: the shared embedder's vectors, dynamic batching, cancel, deadlines.

The embedding math itself (ONNX vs PyTorch, fragments, pooling, the export) is tested in
tests/weir/embedding/test_embedder.py. The model is the repository's all-MiniLM-L6-v2, exported
once into the cache dir ($WEIR_HOME/models/all-MiniLM-L6-v2-onnx) and reused by every later run.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from schemas.messages import EmbedRequest, now_ms
from schemas.model_repo import load_model_repo
from services.worker.engine.embedding_engine import EmbeddingEngine
from weir.embedding.embedder import SentenceEmbedder, as_json_floats

from .factories import make_request

REPO_TOML = Path(__file__).resolve().parents[2] / "models.toml"
MODEL = "all-MiniLM-L6-v2"
T0 = 1_700_000_000_000
_ids = itertools.count()
SHORT = ["The cat sits on the mat.", "A feline rests on a rug.", "Quarterly earnings beat forecasts.", "ok"]


def embed_request(inputs: list[str], **overrides) -> EmbedRequest:
    fields = dict(request_id=f"e{next(_ids)}", model=MODEL, inputs=inputs, deadline_ms=T0 + 60_000, reply_to="t")
    return EmbedRequest(**(fields | overrides))


def run(engine: EmbeddingEngine, *requests: EmbedRequest, now: int = T0) -> dict[str, object]:
    """Add the requests, step until idle; returns the final output of each, by request id."""
    for request in requests:
        assert engine.add(request, now) is None
    outputs = {}
    while engine.has_work:
        outputs.update({o.request_id: o for o in engine.step(now)})
    return outputs


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from weir.embedding.onnx_export import ensure_export

    return ensure_export(load_model_repo(REPO_TOML).models[MODEL])


@pytest.fixture(scope="module")
def engine(minilm_dir: Path) -> EmbeddingEngine:
    return EmbeddingEngine(minilm_dir, num_threads=1, dimensions=384)


def test_the_engine_returns_the_shared_embedders_vectors(engine, minilm_dir):
    inputs = [
        *SHORT,
        "hello " * 510,
        "the quick brown fox jumps over the lazy dog. " * 120,
    ]  # 1, 1, 1, 1, 1, 3 fragments
    request = embed_request(inputs)
    out = run(engine, request)[request.request_id]
    want = as_json_floats(SentenceEmbedder(minilm_dir, num_threads=1).embed(inputs))
    assert out.embeddings == want  # the same session calls, pooling and float32 decimals, bit for bit
    assert len(want) == 6 and len(want[0]) == 384
    assert out.prompt_tokens == sum(
        len(f) for ids in engine.embedder.encode(inputs) for f in engine.embedder.fragment(ids)
    )
    assert np.allclose(np.linalg.norm(out.embeddings, axis=1), 1.0, atol=1e-6)


def test_requests_queued_together_run_in_one_session_call(engine):
    requests = [embed_request(SHORT[:2]), embed_request(["one more text"]), embed_request(SHORT[2:] + ["x y z"])]
    alone = {r.request_id: run(engine, r.model_copy(update={"request_id": f"{r.request_id}-alone"})) for r in requests}
    calls = engine.num_session_calls
    for request in requests:
        assert engine.add(request, T0) is None
    outputs = engine.step(T0)
    assert engine.num_session_calls == calls + 1 and not engine.has_work
    assert sorted(o.request_id for o in outputs) == sorted(r.request_id for r in requests)
    for out in outputs:
        [single] = alone[out.request_id].values()
        np.testing.assert_allclose(out.embeddings, single.embeddings, atol=1e-5)  # padding aside, the same


def test_a_long_request_does_not_hold_up_a_short_one(minilm_dir):
    engine = EmbeddingEngine(minilm_dir, num_threads=1, max_batch_fragments=4, max_fragment_tokens=16)
    long = embed_request(["word " * 140])  # 140 tokens in fragments of 14: 10 fragments
    short = embed_request(["a short one"])
    assert engine.add(long, T0) is None and engine.add(short, T0) is None
    first = engine.step(T0)
    assert [o.request_id for o in first] == [short.request_id]  # round-robin: it got a slot at once
    assert engine.num_fragments_run == 4
    rest = run(engine)
    assert list(rest) == [long.request_id] and engine.num_session_calls == 3


def test_the_token_budget_bounds_a_session_call(minilm_dir):
    engine = EmbeddingEngine(minilm_dir, num_threads=1, max_batch_tokens=512, max_fragment_tokens=128)
    run(engine, embed_request(["word " * 126] * 6))  # six 128-token fragments, four per call
    assert (engine.num_session_calls, engine.num_fragments_run) == (2, 6)


def test_cancel_deadline_and_refusals(engine, minilm_dir):
    request = embed_request(["never embedded"])
    assert engine.add(request, T0) is None
    cancelled = engine.cancel(request.request_id, T0)
    assert cancelled.finish_reason == "cancelled" and cancelled.embeddings is None and not engine.has_work
    assert engine.cancel(request.request_id, T0) is None

    late = embed_request(["too late"], deadline_ms=T0 + 10)
    assert engine.add(late, T0) is None
    [timed_out] = engine.step(T0 + 10)
    assert (timed_out.finish_reason, timed_out.error.code) == ("timeout", "deadline_exceeded")
    expired = engine.add(embed_request(["x"], deadline_ms=T0), T0)
    assert expired.finish_reason == "timeout"

    generate = engine.add(make_request("def ", model=MODEL, deadline_ms=now_ms() + 60_000), T0)
    assert (generate.finish_reason, generate.error.code) == ("rejected", "unsupported_request_kind")
    small = EmbeddingEngine(minilm_dir, num_threads=1, max_model_len=64)
    too_long = small.add(embed_request(["fine", "word " * 100]), T0)
    assert (too_long.finish_reason, too_long.error.code) == ("rejected", "input_too_long")
    assert too_long.error.message == (
        "This model's maximum context length is 64 tokens. However, input 1 resulted "
        "in 102 tokens. Please reduce the length of the input."
    )  # OpenAI's words
    assert not small.has_work
    with pytest.raises(ValueError, match="dimensions=768"):
        EmbeddingEngine(minilm_dir, dimensions=768)
