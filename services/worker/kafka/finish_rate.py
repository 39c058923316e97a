"""How fast this worker ends requests: the drain rate its heartbeat reports (finished_per_s).

The gateway divides the queue ahead of a new request by the fleet's sum of this rate to refuse
work it cannot finish in time (docs/design.md, "Scale-out and failover", admission from the
queue). What it needs is how fast a worker drains work when it has work, not how much work
happened to arrive: a worker idle for a minute can still drain a burst. So time is counted only
while the worker is busy (it had requests in flight at either end of a sample, or ended some in
between); an idle worker keeps its last rate.

The rate is exponentially weighted over about a minute of busy time: each sample's ends and its
busy seconds are both decayed by exp(-busy_dt / window_s), and the rate is their quotient, so a
steady rate is reported as is from the first samples on (no ramp-up from zero). Pure: the
caller passes the time, and the cumulative count of ended requests (any terminal), sampled.

Ends per busy second lag a change of concurrency: a worker that ran one request at a time for a
minute, or has just started, and now runs 64 at once, ends about 64 times as many a second once
they finish, but its measured rate says what the last minute's (or nothing's) load finished. So
the service time is measured too (`service_s`: how long a request ran, first scheduled to end,
weighted the same way), from which the gateway computes the drain at the concurrency a queue runs
at (Little's law: K requests running at once for `service_s` each end K / service_s a second;
services/gateway/queue_wait.py). An outside test saw 78 requests refused as "217 s ahead at
0.36/s" while 64 echo streams ran at once and the worker drained about 8 a second.
"""

from __future__ import annotations

import math


class FinishRate:
    """An exponentially weighted rate of ended requests per busy second."""

    def __init__(self, window_s: float = 60.0, min_busy_s: float = 5.0) -> None:
        if window_s <= 0 or min_busy_s < 0:
            raise ValueError(f"window_s must be > 0 and min_busy_s >= 0, not {window_s} and {min_busy_s}")
        self.window_s = window_s
        self.min_busy_s = min_busy_s
        self.busy_s = 0.0  # busy seconds seen since start
        self._ended = 0.0  # decayed count of ended requests
        self._weight = 0.0  # decayed busy seconds
        self._last: tuple[float, int, bool] | None = None  # (time, cumulative ended, busy) of the last sample
        self._runs = 0.0  # decayed count of requests whose service time was seen
        self._run_s = 0.0  # decayed sum of those service times
        self._pending = [0, 0.0]  # runs and their seconds reported since the last sample folded them in

    def ran(self, service_s: float) -> None:
        """A request ended after running `service_s` seconds (from when it was first scheduled: its
        wait for a slot is not service); folded in at the next busy sample."""
        self._pending[0] += 1
        self._pending[1] += max(0.0, service_s)

    def sample(self, now_s: float, num_ended: int, is_busy: bool) -> None:
        """Fold in a sample: `num_ended` requests ended since start (a count that may restart lower
        when a version's server is replaced: then nothing is counted for that step), and whether
        requests are in flight now."""
        last, self._last = self._last, (now_s, num_ended, is_busy)
        if last is None:
            return
        then_s, then_ended, was_busy = last
        dt, ended = max(0.0, now_s - then_s), max(0, num_ended - then_ended)
        if not (was_busy or is_busy or ended):
            return  # idle: the rate stands
        decay = math.exp(-dt / self.window_s)
        self._ended = self._ended * decay + ended
        self._weight = self._weight * decay + dt
        self.busy_s += dt
        (runs, run_s), self._pending = self._pending, [0, 0.0]
        self._runs = self._runs * decay + runs
        self._run_s = self._run_s * decay + run_s

    def service_s(self) -> float | None:
        """The mean seconds a request ran, weighted like the rate; None before one was seen (a
        single ended request is a measurement, not a guess). 0 s services count as 1 ms."""
        if self._runs <= 0:
            return None
        return max(0.001, self._run_s / self._runs)

    def per_s(self) -> float | None:
        """Requests ended per busy second; None until `min_busy_s` of busy time was seen."""
        if self.busy_s < self.min_busy_s or self._weight <= 0:
            return None
        return self._ended / self._weight
