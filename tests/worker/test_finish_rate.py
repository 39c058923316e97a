"""FinishRate: the drain rate a worker's heartbeat reports (finished_per_s), on an injected clock."""

from __future__ import annotations

import pytest

from services.worker.kafka.finish_rate import FinishRate


def feed(rate: FinishRate, start_s: float, seconds: int, per_s: float, ended: int = 0, step_s: float = 1.0) -> int:
    """Samples every step_s for `seconds`, busy, ending `per_s` requests a second; the cumulative count."""
    t = start_s
    while t < start_s + seconds:
        t += step_s
        ended += round(per_s * step_s)
        rate.sample(t, ended, is_busy=True)
    return ended


def test_unknown_until_enough_busy_time_then_the_steady_rate_at_once() -> None:
    rate = FinishRate(window_s=60, min_busy_s=5)
    rate.sample(0, 0, is_busy=True)
    assert rate.per_s() is None
    ended = feed(rate, 0, 4, per_s=3)
    assert rate.per_s() is None  # 4 busy seconds < 5
    feed(rate, 4, 2, per_s=3, ended=ended)
    assert rate.per_s() == pytest.approx(3.0)  # no ramp-up from zero


def test_idle_time_does_not_dilute_the_rate() -> None:
    rate = FinishRate(window_s=60, min_busy_s=1)
    rate.sample(0, 0, is_busy=True)
    ended = feed(rate, 0, 10, per_s=2)
    rate.sample(10, ended, is_busy=False)  # its last request has ended
    for t in range(11, 300):  # five idle minutes: nothing in flight, nothing ended
        rate.sample(t, ended, is_busy=False)
    assert rate.per_s() == pytest.approx(2.0)
    assert rate.busy_s == pytest.approx(10)


def test_weighs_the_last_minute_most() -> None:
    rate = FinishRate(window_s=60, min_busy_s=1)
    rate.sample(0, 0, is_busy=True)
    ended = feed(rate, 0, 600, per_s=10)  # ten minutes at 10/s
    feed(rate, 600, 120, per_s=1, ended=ended)  # then two at 1/s
    assert 1.0 < rate.per_s() < 1.0 + 9 * 0.15  # exp(-2) of the old rate at most is left


def test_a_restarted_count_counts_nothing_for_that_step() -> None:
    rate = FinishRate(window_s=60, min_busy_s=1)
    rate.sample(0, 100, is_busy=True)
    rate.sample(1, 104, is_busy=True)
    rate.sample(2, 3, is_busy=True)  # a version's server was replaced: its count restarts
    rate.sample(3, 7, is_busy=True)
    assert rate.per_s() == pytest.approx(8 / 3, rel=0.02)  # 8 ended in 3 busy seconds (decay: < 2 %)


def test_refuses_a_window_that_cannot_work() -> None:
    with pytest.raises(ValueError):
        FinishRate(window_s=0)


def test_the_service_time_is_the_weighted_mean_of_what_ended_known_from_the_first() -> None:
    rate = FinishRate(window_s=60, min_busy_s=5)
    rate.sample(0, 0, is_busy=True)
    assert rate.service_s() is None
    rate.ran(8.0)  # a burst's first request ended after running 8 s
    rate.sample(1, 1, is_busy=True)
    assert rate.service_s() == pytest.approx(8.0) and rate.per_s() is None  # the rate needs 5 busy seconds
    for t in range(2, 602):  # ten minutes of 2 s requests, one a second
        rate.ran(2.0)
        rate.sample(t, t, is_busy=True)
    assert rate.service_s() == pytest.approx(2.0, rel=1e-3)
    for t in range(602, 1000):  # idle: nothing ran, nothing changes
        rate.sample(t, 601, is_busy=False)
    assert rate.service_s() == pytest.approx(2.0, rel=1e-3)
