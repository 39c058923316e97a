"""Latency percentiles and table printing for the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (pct in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


@dataclass
class RunResult:
    """What one configuration measured."""

    label: str
    concurrency: int
    ttft_ms: list[float]
    itl_ms: list[float]
    num_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s else 0.0


def print_table(rows: list[list[str]], header: list[str]) -> None:
    """A plain aligned text table."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
