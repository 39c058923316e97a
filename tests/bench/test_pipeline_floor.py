"""The pipeline bench's three-hop floor: the path's added TTFT per round against 3 x one hop's p50."""

from __future__ import annotations

import math

import pytest

from bench.kafka_hop import three_hop_floor_ms
from bench.pipeline import FLOOR_HEADER, added_ttft_by_round, floor_table
from bench.stats import RunResult


def run(ttft_ms: list[float]) -> RunResult:
    return RunResult("x", 1, ttft_ms, [], 0, 1.0)


def test_three_hop_floor_is_three_times_the_hop_p50() -> None:
    assert three_hop_floor_ms([2.0, 9.0, 2.5, 3.0, 2.2]) == 3 * 2.5
    assert math.isnan(three_hop_floor_ms([]))


def test_added_ttft_pairs_each_round_with_its_own_in_process_run() -> None:
    inprocess = [run([5.0, 6.0, 7.0]), run([10.0, 11.0, 12.0])]
    path = [run([20.0, 21.0, 40.0]), run([30.0, 25.0, 26.0])]
    assert added_ttft_by_round(inprocess, path) == [21.0 - 6.0, 26.0 - 11.0]
    with pytest.raises(ValueError):  # a round without its pair is a bug, not a shorter table
        added_ttft_by_round(inprocess, path[:1])


def test_floor_table_rows_and_medians_of_rounds() -> None:
    hop_ms = [[2.0, 2.0, 2.0], [3.0, 3.0, 9.0], [2.0, 1.0, 2.5]]  # p50s 2.0, 3.0, 2.0
    added = [12.0, 18.0, 9.0]  # multiples of 6.0, 9.0, 6.0 ms: 2.0, 2.0, 1.5
    rows, med = floor_table(hop_ms, added)
    assert all(len(r) == len(FLOOR_HEADER) for r in rows)
    assert rows[:3] == [
        ["1", "2.00", "6.00", "+12.0", "2.00x"],
        ["2", "3.00", "9.00", "+18.0", "2.00x"],
        ["3", "2.00", "6.00", "+9.0", "1.50x"],
    ]
    assert rows[3] == ["median", "2.00", "6.00", "+12.0", "2.00x"]  # each column's own median
    assert med == {"hop": 2.0, "floor": 6.0, "added": 12.0, "multiple": 2.0, "low": 1.5, "high": 2.0}


def test_floor_table_shows_a_path_faster_than_the_floor_as_negative() -> None:
    rows, med = floor_table([[2.0]], [-3.0])
    assert rows[0][3:] == ["-3.0", "-0.50x"]
    assert med["multiple"] == -0.5
