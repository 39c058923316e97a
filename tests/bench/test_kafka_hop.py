"""`weir bench hop` runs against the real broker and prints its table (no timing is asserted)."""

from __future__ import annotations

import asyncio.selector_events
import re

import pytest

from bench import kafka_hop

pytestmark = pytest.mark.kafka


def test_bench_hop_measures_every_row(capsys, kafka_broker: str) -> None:
    transport = asyncio.selector_events._SelectorSocketTransport
    before = (transport.write, transport._read_ready)
    assert kafka_hop.main(["--bootstrap", kafka_broker, "--count", "30", "--gap-ms", "2", "--warmup", "50"]) == 0
    assert (transport.write, transport._read_ready) == before  # this process's event loop as it was
    out = capsys.readouterr().out
    rows = re.findall(r"^(.+?)\s{2,}(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+)\s*$", out, re.M)
    assert len(rows) == 6, out
    assert all(int(n) == 27 for *_, n in rows), out  # every message measured, the first 10% dropped
    assert "three hops" in out
