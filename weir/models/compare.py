"""Shadow comparisons: the measures of one mirrored request, their running summary per version
pair, and the thresholds `weir models promote --require-*` checks (docs/design.md, "Traffic policies").

Pure except `read_comparisons`, which reads Topics.comparisons from its beginning: that topic is the
source of truth (the auditor writes one ModelComparison per mirrored request and keeps the same
summary in its ledger, computed by `summarize` here, so both agree by construction). weir/ never
imports services/ (docs/design.md, "The floors"): the auditor imports this module, not the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.codec import DecodeError, decode
from schemas.registry import ModelComparison
from weir.bus import BusSettings, read_topic


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance between two token sequences (insert, delete, substitute: 1 each).

    The dynamic programme a row at a time in numpy, O(len(a) * len(b)) work but no Python loop per
    cell (answers of thousands of tokens take milliseconds): a row is first the best of deleting and
    substituting, then insertions are a running minimum, since row[j] = min over k <= j of
    (that[k] + j - k)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    others = np.asarray(b, dtype=np.int64)
    steps = np.arange(len(b) + 1)
    previous = steps.copy()
    for i, x in enumerate(a, start=1):
        current = np.empty_like(previous)
        current[0] = i
        np.minimum(previous[1:] + 1, previous[:-1] + (others != x), out=current[1:])
        previous = np.minimum.accumulate(current - steps) + steps
    return int(previous[-1])


def cosine(u: Sequence[float], v: Sequence[float]) -> float | None:
    """Cosine similarity of two vectors; None when either is zero or their lengths differ."""
    if len(u) != len(v) or not u:
        return None
    dot = sum(x * y for x, y in zip(u, v, strict=True))
    norm = math.sqrt(sum(x * x for x in u)) * math.sqrt(sum(y * y for y in v))
    return dot / norm if norm > 0 else None


def reply_rates(received_ms: int | None, first_token_ms: int | None, finished_ms: int,
                completion_tokens: int) -> tuple[float | None, float | None]:
    """(TTFT in ms, decode tokens/s) of one reply from the worker's timestamps: TTFT is first token
    minus received; the rate counts the tokens after the first over the time after it (None when
    there is no such time: one token, or no first token)."""
    ttft = float(first_token_ms - received_ms) if received_ms is not None and first_token_ms is not None else None
    if ttft is not None and ttft < 0:
        ttft = None
    rate = None
    if first_token_ms is not None and finished_ms > first_token_ms and completion_tokens > 1:
        rate = (completion_tokens - 1) / ((finished_ms - first_token_ms) / 1000)
    return ttft, rate


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


@dataclass
class PairSummary:
    """The running summary of one (live version, mirror version) pair."""

    live: str
    mirror: str
    samples: int = 0
    errors: int = 0  # mirror copies that did not finish
    exact: int = 0
    edit_distances: list[int] = field(default_factory=list, repr=False)
    similarities: list[float | None] = field(default_factory=list, repr=False)
    live_ttft: list[float | None] = field(default_factory=list, repr=False)
    mirror_ttft: list[float | None] = field(default_factory=list, repr=False)
    live_rate: list[float | None] = field(default_factory=list, repr=False)
    mirror_rate: list[float | None] = field(default_factory=list, repr=False)

    def add(self, c: ModelComparison) -> None:
        self.samples += 1
        if c.mirror_error is not None:
            self.errors += 1
            return  # an unfinished copy has no answer to measure
        self.exact += c.exact_match
        self.edit_distances.append(c.token_edit_distance)
        self.similarities.append(c.similarity)
        self.live_ttft.append(c.live_ttft_ms)
        self.mirror_ttft.append(c.mirror_ttft_ms)
        self.live_rate.append(c.live_tokens_per_s)
        self.mirror_rate.append(c.mirror_tokens_per_s)

    @property
    def error_rate(self) -> float:
        return self.errors / self.samples if self.samples else 0.0

    @property
    def latency_ratio(self) -> float | None:
        """Mean mirror TTFT over mean live TTFT, over the requests where both were measured."""
        both = [(lv, mv) for lv, mv in zip(self.live_ttft, self.mirror_ttft, strict=True) if lv is not None and mv is not None]
        live = _mean(lv for lv, _ in both)
        mirror = _mean(mv for _, mv in both)
        if live is None or mirror is None:
            return None
        return mirror / live if live > 0 else (1.0 if mirror == 0 else math.inf)

    def to_json(self) -> dict[str, object]:
        finished = self.samples - self.errors
        return {
            "live": self.live, "mirror": self.mirror, "samples": self.samples, "errors": self.errors,
            "error_rate": self.error_rate, "exact_match_rate": self.exact / finished if finished else None,
            "mean_edit_distance": _mean(self.edit_distances), "mean_similarity": _mean(self.similarities),
            "similarity_samples": sum(s is not None for s in self.similarities),
            "live_ttft_ms": _mean(self.live_ttft), "mirror_ttft_ms": _mean(self.mirror_ttft),
            "latency_ratio": self.latency_ratio,
            "live_tokens_per_s": _mean(self.live_rate), "mirror_tokens_per_s": _mean(self.mirror_rate),
        }


def summarize(comparisons: Iterable[ModelComparison], name: str | None = None) -> dict[tuple[str, str], PairSummary]:
    """(live, mirror) -> its summary, over the comparisons of `name` (all when None)."""
    pairs: dict[tuple[str, str], PairSummary] = {}
    for c in comparisons:
        if name is not None and c.name != name:
            continue
        pairs.setdefault((c.live, c.mirror), PairSummary(c.live, c.mirror)).add(c)
    return pairs


@dataclass(frozen=True)
class Thresholds:
    """What `weir models promote --require-similarity S --max-latency-ratio R --max-error-rate E
    [--min-samples N]` asks of the comparisons of (current default -> candidate)."""

    similarity: float | None = None
    latency_ratio: float | None = None
    error_rate: float | None = None
    min_samples: int = 20

    def __post_init__(self) -> None:
        if self.similarity is not None and not -1 <= self.similarity <= 1:
            raise ValueError(f"--require-similarity must be -1..1 (cosine), not {self.similarity}")
        if self.latency_ratio is not None and not self.latency_ratio > 0:
            raise ValueError(f"--max-latency-ratio must be > 0, not {self.latency_ratio}")
        if self.error_rate is not None and not 0 <= self.error_rate <= 1:
            raise ValueError(f"--max-error-rate must be 0..1, not {self.error_rate}")
        if self.min_samples < 1:
            raise ValueError(f"--min-samples must be >= 1, not {self.min_samples}")

    @property
    def any(self) -> bool:
        return (self.similarity, self.latency_ratio, self.error_rate) != (None, None, None)

    def failures(self, pair: PairSummary | None) -> list[str]:
        """Why `pair` does not pass, one line each; empty: it passes."""
        if pair is None or pair.samples < self.min_samples:
            have = pair.samples if pair else 0
            return [f"{have} comparisons, fewer than --min-samples {self.min_samples} (mirror the version first)"]
        failed = []
        if self.error_rate is not None and pair.error_rate > self.error_rate:
            failed.append(f"error rate {pair.error_rate:.3f} > --max-error-rate {self.error_rate}")
        if self.similarity is not None:
            similarity = _mean(pair.similarities)
            if similarity is None:
                failed.append("no similarity was measured (the auditor's embedding model did not load)")
            elif similarity < self.similarity:
                failed.append(f"mean similarity {similarity:.3f} < --require-similarity {self.similarity}")
        if self.latency_ratio is not None:
            ratio = pair.latency_ratio
            if ratio is None:
                failed.append("no latency ratio: no request had both TTFTs measured")
            elif ratio > self.latency_ratio:
                failed.append(f"latency ratio {ratio:.3f} > --max-latency-ratio {self.latency_ratio}")
        return failed


async def read_comparisons(settings: BusSettings) -> tuple[list[ModelComparison], int]:
    """Every ModelComparison on Topics.comparisons (from its beginning to its end), and how many
    records were none (skipped: a forged or malformed record changes no summary)."""
    found: list[ModelComparison] = []
    skipped = 0
    for _key, value in await read_topic(settings, settings.topics.comparisons):
        try:
            found.append(decode(ModelComparison, value))
        except DecodeError:
            skipped += 1
    return found, skipped


def summary_json(pairs: dict[tuple[str, str], PairSummary]) -> list[dict[str, object]]:
    return [pairs[key].to_json() for key in sorted(pairs)]


def summary_rows(pairs: dict[tuple[str, str], PairSummary]) -> tuple[list[str], list[list[str]]]:
    """The table `weir models compare` prints: one row per version pair."""
    def num(value: object, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    headers = ["LIVE", "MIRROR", "N", "ERRORS", "EXACT", "EDIT", "SIMILARITY", "TTFT LIVE/MIRROR ms", "RATIO",
               "TOK/S LIVE/MIRROR"]
    rows = []
    for info in summary_json(pairs):
        rows.append([
            str(info["live"]), str(info["mirror"]), str(info["samples"]), f"{info['errors']} ({info['error_rate']:.1%})",
            num(info["exact_match_rate"], ".1%"), num(info["mean_edit_distance"], ".1f"),
            num(info["mean_similarity"], ".3f"),
            f"{num(info['live_ttft_ms'], '.0f')}/{num(info['mirror_ttft_ms'], '.0f')}",
            num(info["latency_ratio"], ".2f"),
            f"{num(info['live_tokens_per_s'], '.0f')}/{num(info['mirror_tokens_per_s'], '.0f')}",
        ])
    return headers, rows

