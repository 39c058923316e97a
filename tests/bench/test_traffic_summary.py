"""`weir bench traffic`'s figures from measured outcomes (bench/traffic.py: summarize): which phase
is which, the p95 ratio per round, mirror completion, the canary share. The bench itself needs a stack."""

from __future__ import annotations

import math

from bench.swap import Outcome
from bench.traffic import Phase, Result, summarize


def _phase(mirror: bool, ttfts: list[float], failed: int = 0) -> Phase:
    outcomes = [Outcome(0.0, ttft_ms=t, version="m@1") for t in ttfts]
    return Phase(mirror, outcomes + [Outcome(0.0, error="cut") for _ in range(failed)])


def test_ratios_pair_on_with_off_whatever_the_order_and_shares_count_only_served_requests() -> None:
    result = Result(
        phases=[
            _phase(True, [10.0] * 18 + [60.0] * 2, failed=2),
            _phase(False, [10.0] * 18 + [50.0] * 2),
            _phase(False, [10.0] * 20),
            _phase(True, [12.0] * 20),
        ],
        mirrored_before=5,
        mirrored_after=5 + 38,
    )
    result.canary = (
        [Outcome(0.0, ttft_ms=1.0, version="m@3") for _ in range(6)]
        + [Outcome(0.0, ttft_ms=1.0, version="m@1") for _ in range(94)]
        + [Outcome(0.0, error="x")]
    )
    s = summarize(result, "m", canary_pct=5.0)
    assert s["ratios"] == [60.0 / 50.0, 12.0 / 10.0]
    assert (s["mirrored_live"], s["copies_completed"]) == (42, 38)  # the 2 failed live requests were copied too
    assert math.isclose(s["completed_share"], 38 / 42)
    assert (s["canary_served"], s["canary_failed"]) == (100, 1)
    assert math.isclose(s["canary_share"], 6.0) and math.isclose(s["canary_error_pts"], 1.0)
