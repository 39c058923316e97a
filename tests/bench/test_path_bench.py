"""`weir bench path` once at tiny size on the real broker: the table has its shape, tokens arrive."""

from __future__ import annotations

import pytest

from bench import path

pytestmark = pytest.mark.kafka


def test_bench_path_prints_every_process_and_delivers_tokens(capsys, kafka_broker: str) -> None:
    argv = ["--streams", "4", "--duration", "3", "--tokens", "20", "--rounds", "1", "--fingerprints", "off"]
    results = path.run_all_sync(path.parse_args(argv))
    assert set(results) == {("this", client, "off", 4) for client in path.CLIENTS}
    for runs in results.values():
        (row,) = runs
        assert row["delivered tok/s"] > 0
        assert row["offered tok/s"] == 80  # 4 streams x 20 tokens/s
        assert row["gateway us/token"] >= 0 and row["worker us/token"] > 0 and row["path us/token"] > 0
        # nan when no first token (or no second) fell in the 3 s window on a stalled machine
        assert not row["TTFT p50 ms"] <= 0 and not row["ITL p50 ms"] <= 0
    path.report(results, path.parse_args(argv))
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("tree "))
    for column in path.HEADER:
        assert column in header
    rows = [line for line in out.splitlines() if line.startswith("this ")]
    assert len(rows) == 2 and {line.split()[1] for line in rows} == {"sse", "kafka"}
