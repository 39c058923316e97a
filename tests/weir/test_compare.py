"""The shadow comparison's measures, its summary per version pair and promote's thresholds
(weir/models/compare.py): pure logic."""

from __future__ import annotations

import math
import random
import time

import pytest

from schemas.registry import ModelComparison
from weir.models.compare import PairSummary, Thresholds, cosine, edit_distance, reply_rates, summarize, summary_rows


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [], 0),
        ([1, 2, 3], [], 3),
        ([], [4], 1),
        ([1, 2, 3], [1, 2, 3], 0),
        ([1, 2, 3], [1, 9, 3], 1),  # substitute
        ([1, 2, 3], [1, 3], 1),  # delete
        ([1, 3], [1, 2, 3], 1),  # insert
        ([5, 6, 7, 8], [6, 7, 8, 5], 2),  # rotate: delete one end, insert the other
        (list(b"kitten"), list(b"sitting"), 3),
    ],
)
def test_edit_distance(a: list[int], b: list[int], expected: int) -> None:
    assert edit_distance(a, b) == expected
    assert edit_distance(b, a) == expected


def _reference(a: list[int], b: list[int]) -> int:
    table = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return table[-1][-1]


def test_edit_distance_matches_the_textbook_table() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = [rng.randrange(4) for _ in range(rng.randrange(12))]
        b = [rng.randrange(4) for _ in range(rng.randrange(12))]
        assert edit_distance(a, b) == _reference(a, b), (a, b)


def test_edit_distance_of_long_answers_is_fast() -> None:
    a = list(range(4000))
    b = [t if t % 10 else -1 for t in a][50:]  # 400 substituted, 50 deleted
    started = time.perf_counter()
    assert edit_distance(a, b) == 445  # 5 of the substituted tokens were among the deleted
    assert time.perf_counter() - started < 5.0


def test_cosine() -> None:
    assert cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)
    assert cosine([3.0, 4.0], [4.0, 3.0]) == pytest.approx(24 / 25)
    assert cosine([0.0, 0.0], [1.0, 0.0]) is None
    assert cosine([1.0], [1.0, 2.0]) is None


def test_reply_rates() -> None:
    # 11 tokens: the 10 after the first took 500 ms -> 20 tokens/s; TTFT 40 ms
    assert reply_rates(1000, 1040, 1540, 11) == (40.0, 20.0)
    assert reply_rates(1000, 1040, 1040, 1) == (40.0, None)  # one token: no decode time
    assert reply_rates(None, 1040, 1540, 11) == (None, 20.0)
    assert reply_rates(1000, None, 1540, 0) == (None, None)


def _c(
    rid: str,
    *,
    live: str = "m@1",
    mirror: str = "m@2",
    exact: bool = True,
    edit: int = 0,
    similarity: float | None = 1.0,
    lt: float | None = 100.0,
    mt: float | None = 100.0,
    error: str | None = None,
    name: str = "m",
) -> ModelComparison:
    return ModelComparison(
        request_id=rid,
        name=name,
        live=live,
        mirror=mirror,
        exact_match=exact,
        token_edit_distance=edit,
        similarity=similarity,
        live_ttft_ms=lt,
        mirror_ttft_ms=mt,
        live_tokens_per_s=50.0,
        mirror_tokens_per_s=40.0 if error is None else None,
        mirror_error=error,
    )


def test_summary_per_pair() -> None:
    pairs = summarize(
        [
            _c("a", exact=True, edit=0, similarity=1.0, lt=100, mt=150),
            _c("b", exact=False, edit=4, similarity=0.8, lt=100, mt=250),
            _c("c", error="timeout"),
            _c("d", mirror="m@3", similarity=None, lt=None),
            _c("e", name="other", live="other@1", mirror="other@2"),
        ],
        name="m",
    )
    assert set(pairs) == {("m@1", "m@2"), ("m@1", "m@3")}
    info = pairs[("m@1", "m@2")].to_json()
    assert info["samples"] == 3 and info["errors"] == 1
    assert info["error_rate"] == pytest.approx(1 / 3)
    assert info["exact_match_rate"] == pytest.approx(0.5)  # of the two that finished
    assert info["mean_edit_distance"] == pytest.approx(2.0)
    assert info["mean_similarity"] == pytest.approx(0.9)
    assert info["latency_ratio"] == pytest.approx(200 / 100)
    assert info["mirror_tokens_per_s"] == pytest.approx(40.0)
    other = pairs[("m@1", "m@3")].to_json()
    assert other["mean_similarity"] is None and other["latency_ratio"] is None
    headers, rows = summary_rows(pairs)
    assert headers[:3] == ["LIVE", "MIRROR", "N"] and rows[0][:3] == ["m@1", "m@2", "3"]


def _pair(comparisons: list[ModelComparison]) -> PairSummary:
    return summarize(comparisons)[("m@1", "m@2")]


def test_thresholds_pass_and_fail() -> None:
    good = _pair([_c(str(i), similarity=0.95, lt=100, mt=110) for i in range(20)])
    assert Thresholds(similarity=0.9, latency_ratio=1.2, error_rate=0.0, min_samples=20).failures(good) == []
    failed = Thresholds(similarity=0.99, latency_ratio=1.05, error_rate=0.0, min_samples=20).failures(good)
    assert len(failed) == 2 and "similarity 0.950 < --require-similarity 0.99" in failed[0] and "latency" in failed[1]
    assert "fewer than --min-samples 21" in Thresholds(similarity=0.5, min_samples=21).failures(good)[0]
    assert "0 comparisons" in Thresholds(similarity=0.5).failures(None)[0]
    errors = _pair([_c(str(i)) for i in range(18)] + [_c("x", error="error"), _c("y", error="error")])
    assert Thresholds(error_rate=0.1).failures(errors) == []
    assert "error rate 0.100" not in " ".join(Thresholds(error_rate=0.1).failures(errors))
    assert "error rate 0.100 > --max-error-rate 0.05" in Thresholds(error_rate=0.05).failures(errors)[0]
    unmeasured = _pair([_c(str(i), similarity=None, lt=None) for i in range(20)])
    failed = Thresholds(similarity=0.5, latency_ratio=2.0).failures(unmeasured)
    assert "no similarity" in failed[0] and "no latency ratio" in failed[1]


@pytest.mark.parametrize(
    "kwargs",
    [{"similarity": 1.5}, {"latency_ratio": 0}, {"error_rate": -0.1}, {"error_rate": math.nan}, {"min_samples": 0}],
)
def test_thresholds_refuse_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Thresholds(**kwargs)
