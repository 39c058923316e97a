"""The output SLA in the auditor (docs/design.md, "Structured output, tools and logprobs"): an invalid
constrained output raises the `structured` alert at once and a clean window clears it; outputs of
equal version, prompt, parameters and seed from two workers are compared (services/auditor/
determinism.py) and a difference raises `determinism`; the comparison is bounded and made again
from the ledger after a restart. Unit tests of the pure parts; tests/auditor/test_health_kafka.py
has the same alerts through the broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.auditor.determinism import DeterminismProbe
from services.auditor.health import HealthMetrics
from services.auditor.ledger import Ledger
from weir.metrics import value

from .factories import T0_MS, make_event
from .test_drift import POLICY, SID, monitor, publish

PARAMS = "ab" * 32


def constrained(i: int, valid: bool | None, finish_reason: str = "stop"):
    return make_event(i, model_version=SID, structured_valid=valid, finish_reason=finish_reason, finished_ms=T0_MS + i)


def twin(i: int, worker: str, output: str = "same", **extra):
    """The i-th event of one key (prompt 0, PARAMS, seed 7) from `worker`."""
    fields = dict(
        model_version=SID,
        prompt_hmac="cd" * 32,
        params_sha256=PARAMS,
        seed=7,
        worker_id=worker,
        output_hmac=(output * 64)[:64],
        finished_ms=T0_MS + i,
    )
    return make_event(i, **{**fields, **extra})


def test_an_invalid_structured_output_raises_at_once_and_a_clean_window_clears_it() -> None:
    mon = monitor()  # window 4 outputs, at least 3 judged
    for i in range(3):
        mon.observe(constrained(i, True))
    mon.observe(constrained(3, None))  # unconstrained: not an outcome
    mon.observe(constrained(4, False, "length"))  # ran out of tokens: never claimed valid, not counted here
    assert publish(mon, T0_MS) == []
    mon.observe(constrained(5, False))
    [raised] = publish(mon, T0_MS)
    assert (raised.signal, raised.state, raised.threshold) == ("structured", "raised", 1.0)
    assert raised.value == pytest.approx(0.75) and raised.counts == {"valid": 3, "invalid": 1}
    assert "1 invalid of the last 4" in raised.detail
    for i in range(6, 9):
        mon.observe(constrained(i, True))
    assert publish(mon, T0_MS) == []  # the invalid one is still in the window
    mon.observe(constrained(9, True))
    [cleared] = publish(mon, T0_MS)
    assert (cleared.state, cleared.value, cleared.counts) == ("cleared", 1.0, {"valid": 4, "invalid": 0})


def test_the_probe_compares_only_equal_requests_of_two_workers() -> None:
    probe = DeterminismProbe()
    assert probe.observe(twin(0, "w1")) is None  # nothing to compare with yet
    assert probe.observe(twin(1, "w1", "other")) is None  # the same worker: no second instance
    assert probe.observe(twin(2, "w2")) == "same"
    assert probe.observe(twin(3, "w3", "other")) == "differs"
    # greedy: the seed cannot change the text, so requests with derived seeds compare
    assert probe.observe(twin(4, "w1", temperature=0.0, seed=1)) is None
    assert probe.observe(twin(5, "w2", temperature=0.0, seed=2)) == "same"
    # not compared: another seed of a sampled request, another HMAC key, another watermarked tenant,
    # a mirror copy, an output cut by an error, an event without params_sha256
    for i, extra in enumerate(
        [
            {"seed": 8},
            {"hmac_key_id": "f" * 16},
            {"shadow_of": "req-0"},
            {"finish_reason": "error"},
            {"params_sha256": None},
        ]
    ):
        assert probe.observe(twin(10 + i, "w9", "other", **extra)) is None, extra
    assert probe.observe(twin(20, "w1", watermark_z=5.0, tenant="a")) is None
    assert probe.observe(twin(21, "w2", "other", watermark_z=5.0, tenant="b")) is None


def test_the_probe_holds_at_most_its_capacity_of_keys() -> None:
    probe = DeterminismProbe(capacity=2)
    for i in range(3):
        probe.observe(twin(i, "w1", seed=i))
    assert len(probe.outputs) == 2
    assert probe.observe(twin(3, "w2", seed=0)) is None  # the oldest key was dropped
    assert probe.observe(twin(4, "w2", seed=2)) == "same"
    with pytest.raises(ValueError):
        DeterminismProbe(capacity=0)


def test_a_difference_raises_determinism_is_counted_and_is_compared_again_after_a_restart(tmp_path: Path) -> None:
    metrics = HealthMetrics(clock=lambda: T0_MS)
    mon = monitor()
    metrics.monitor = mon
    events = [twin(0, "w1"), twin(1, "w2", "other")]
    with Ledger(tmp_path / "audit.sqlite", checkpoint_key=b"k" * 32) as ledger:
        for offset, event in enumerate(events):
            assert ledger.append(event, partition=0, offset=offset)
            result = mon.observe(event)
            if result is not None:
                metrics.compared(event.model_version, result)
        replay = ledger.comparable_events(POLICY.determinism_keys)
    [raised] = publish(mon, T0_MS)
    assert (raised.signal, raised.state, raised.value, raised.counts) == (
        "determinism",
        "raised",
        0.0,
        {"same": 0, "differs": 1},
    )
    assert value(metrics.render(), "weir_determinism_checks_total", model_name=SID, result="differs") == 1
    assert replay == events  # as appended, in the ledger's order
    restarted = monitor()
    restarted.hold(raised)  # from the health topic
    for event in replay:
        restarted.compare(event)
    assert restarted.outcome(SID, "determinism", T0_MS).counts == {"same": 0, "differs": 1}
    assert publish(restarted, T0_MS) == []  # still raised: nothing repeated
    assert restarted.observe(twin(2, "w3")) == "same"  # w1's output, read back, is the reference
