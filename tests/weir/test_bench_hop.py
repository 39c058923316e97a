"""`weir bench hop` runs against the real broker and prints its table (no timing is asserted)."""

from __future__ import annotations

import re

import pytest

from weir.bench import hop

pytestmark = pytest.mark.kafka


def test_bench_hop_measures_every_row(capsys) -> None:
    assert hop.main(["--count", "30", "--gap-ms", "2"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(.+?)\s{2,}(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+)\s*$", out, re.M)
    assert len(rows) == 6, out
    assert all(int(n) == 27 for *_, n in rows), out  # every message measured, the first 10% dropped
    assert "three hops" in out
