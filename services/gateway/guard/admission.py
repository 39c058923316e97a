"""Admission control of one gateway instance: bounded in-flight lanes and a breaker per model.

- In flight: at most max_in_flight[lane] requests per (model, lane) are open in this instance;
  one more is refused with 429 (queue_full) rather than queued behind them.
- Breaker: a model none of whose workers has a live heartbeat is "open": its requests are refused
  at once with 503 (model_unavailable) instead of waiting for a deadline nobody will meet. It
  closes by itself with the next live heartbeat. A version a live worker is bringing up
  (`coming`, fleet.Availability) is admitted: the batcher holds its requests until it is ready.
- Overload: when every live worker of the model has num_waiting >= ratio * max_num_seqs, the
  request is refused with 429 (overloaded) and a short Retry-After.
- Queue too long: when the estimated wait for the model (queue_wait.py: the queue ahead over the
  fleet's drain rate) exceeds the request's time to its deadline, it is refused with 429
  (queue_too_long) and Retry-After = the seconds until it would fit (docs/design.md,
  "Scale-out and failover"). An unknown wait (a worker with no drain measured yet, stale data) refuses nothing.

Pure: the live heartbeats and the wait estimate come in as arguments.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas.messages import Priority, WorkerHeartbeat
from services.gateway.guard.auth import GuardError

if TYPE_CHECKING:
    from services.gateway.queue_wait import QueueWait

OVERLOAD_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Ticket:
    """One admitted request's place in its lane; give it back with Admission.release."""

    model: str
    lane: Priority


class Admission:
    """In-flight counts per (model, lane) and the breaker state per model."""

    def __init__(self, max_in_flight: dict[Priority, int], overload_ratio: float, is_breaker_enabled: bool) -> None:
        self.max_in_flight = max_in_flight
        self.overload_ratio = overload_ratio
        self.is_breaker_enabled = is_breaker_enabled
        self.in_flight: Counter[tuple[str, Priority]] = Counter()
        self.open_breakers: set[str] = set()

    def admit(
        self,
        model: str,
        lane: Priority,
        live: list[WorkerHeartbeat],
        coming: bool = False,
        wait: QueueWait | None = None,
        time_to_deadline_s: float | None = None,
    ) -> Ticket:
        """A Ticket, or GuardError 503 (breaker open) / 429 (lane full, workers overloaded, queue too
        long). `live`: the workers serving `model` now; `coming`: none does yet, but a live one is
        bringing it up; `wait`: the estimated wait for `model` (None: unknown), against the request's
        `time_to_deadline_s` (None: no deadline to meet)."""
        if self.is_breaker_enabled:
            if not live and not coming:
                self.open_breakers.add(model)
                raise GuardError(
                    503,
                    f"no worker of {model!r} is live; try again later",
                    param="model",
                    code="model_unavailable",
                    headers={"retry-after": "5"},
                )
            self.open_breakers.discard(model)
        if live and all(hb.num_waiting >= self.overload_ratio * hb.max_num_seqs for hb in live):
            raise GuardError(
                429,
                f"every worker of {model!r} is overloaded; retry shortly",
                code="overloaded",
                headers={"retry-after": str(OVERLOAD_RETRY_AFTER_S)},
            )
        if wait is not None and time_to_deadline_s is not None and wait.wait_s > time_to_deadline_s:
            raise queue_too_long(wait, time_to_deadline_s)
        limit = self.max_in_flight[lane]
        if self.in_flight[(model, lane)] >= limit:
            raise GuardError(
                429,
                f"{limit} {lane} requests for {model!r} are already in flight at this gateway",
                code="queue_full",
                headers={"retry-after": "1"},
            )
        self.in_flight[(model, lane)] += 1
        return Ticket(model, lane)

    def release(self, ticket: Ticket) -> None:
        """Give a ticket back (exactly once per admitted request)."""
        key = (ticket.model, ticket.lane)
        self.in_flight[key] = max(0, self.in_flight[key] - 1)


def queue_too_long(wait: QueueWait, time_to_deadline_s: float) -> GuardError:
    """429 queue_too_long naming the model and the estimate, with the Retry-After it would fit after."""
    retry_after = wait.retry_after_s(time_to_deadline_s)
    return GuardError(
        429,
        f"the queue for {wait.model!r} is about {wait.wait_s:.0f} s long ({wait.queue_ahead} "
        f"requests ahead at {wait.per_s:.2f}/s), more than the {max(0.0, time_to_deadline_s):.0f} s "
        f"to this request's deadline; retry in {retry_after} s",
        code="queue_too_long",
        headers={"retry-after": str(retry_after)},
    )
