"""Rate limits: token buckets per scope (an API key, a JWT subject, a tenant), requests and tokens.

A bucket holds up to `limit` units and refills at limit/60 per second, so a limit per minute
allows a burst of the whole minute and then the steady rate. Admission takes one request and a
token reservation (prompt estimate + max_tokens) from every bucket of the request at once, or
from none. Later the reservation is corrected by the usage the terminal event reports, and the
consumption other gateway instances report is debited here too: buckets may go below zero (a
debt that refill pays back), so what others admitted delays what this instance admits.

A scope is one credential's (an API key's, or a JWT subject's within its tenant: auth.jwt_scope)
or a tenant's. What another instance reports for a scope whose limits are not known here yet
(a JWT subject limited by its token's rpm/tpm claims, a key whose record has not arrived) is
remembered for a window and debited when the scope's bucket is made, so the first request here
does not find a fresh minute that the others already spent.

Pure: time comes in as `now_s` (monotonic seconds); no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

LimitKind = Literal["requests", "tokens"]
SECONDS_PER_WINDOW = 60.0
MAX_UNBOUND = 10_000  # (scope, kind) pairs whose reported consumption is remembered before a bucket exists
UNBOUND_BIN_S = 5.0  # remembered consumption within this many seconds is summed (at its latest time: strict)


@dataclass(frozen=True)
class ScopeLimits:
    """The per-minute limits of one scope; None is no limit."""

    max_requests_per_min: int | None = None
    max_tokens_per_min: int | None = None

    def of(self, kind: LimitKind) -> int | None:
        return self.max_requests_per_min if kind == "requests" else self.max_tokens_per_min


class TokenBucket:
    """`level` units available, at most `capacity`, refilled at capacity/60 per second."""

    def __init__(self, capacity: int, now_s: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated_s = now_s

    @property
    def rate_per_s(self) -> float:
        return self.capacity / SECONDS_PER_WINDOW

    def refill(self, now_s: float) -> None:
        """Add what accrued since the last update, up to capacity."""
        if now_s > self.updated_s:
            self.level = min(self.capacity, self.level + (now_s - self.updated_s) * self.rate_per_s)
            self.updated_s = now_s

    def resize(self, capacity: int) -> None:
        """Follow a changed limit, keeping what was consumed."""
        self.level -= self.capacity - capacity
        self.capacity = capacity
        self.level = min(self.level, capacity)

    def wait_s(self, cost: int, now_s: float) -> float:
        """Seconds until `cost` units are available (0 now; inf when cost exceeds capacity)."""
        self.refill(now_s)
        if cost > self.capacity:
            return math.inf
        return max(0.0, (cost - self.level) / self.rate_per_s)

    def debit(self, amount: float, now_s: float) -> None:
        """Take `amount` (negative gives back), going below zero if need be."""
        self.refill(now_s)
        self.level = min(self.capacity, self.level - amount)


@dataclass(frozen=True)
class Charge:
    """What one request costs one scope."""

    scope: str
    limits: ScopeLimits
    num_tokens: int


class RateLimited(Exception):
    """Admission refused: which scope and limit, and how long until it would pass."""

    def __init__(self, scope: str, kind: LimitKind, limit: int, retry_after_s: float) -> None:
        super().__init__(f"{scope}: {limit} {kind} per minute")
        self.scope = scope
        self.kind = kind
        self.limit = limit
        self.retry_after_s = retry_after_s

    @property
    def is_too_large(self) -> bool:
        """The request alone exceeds the limit: waiting does not help."""
        return math.isinf(self.retry_after_s)


class RateLimiter:
    """Buckets by (scope, kind). `limits_of` resolves the limits of a scope that another instance
    reported and this one has not charged yet (None: not limited here)."""

    def __init__(self, limits_of: Callable[[str], ScopeLimits | None] | None = None) -> None:
        self._buckets: dict[tuple[str, LimitKind], TokenBucket] = {}
        self._limits_of = limits_of or (lambda scope: None)
        # Other instances' consumption of scopes not limited here (yet): [(time, amount)], oldest first.
        self._unbound: OrderedDict[tuple[str, LimitKind], list[list[float]]] = OrderedDict()

    def admit(self, charges: list[Charge], now_s: float) -> None:
        """Take one request and `num_tokens` from every limited bucket of `charges`, or raise
        RateLimited for the one that must wait longest and take nothing."""
        worst: RateLimited | None = None
        for charge in charges:
            costs: tuple[tuple[LimitKind, int], ...] = (("requests", 1), ("tokens", charge.num_tokens))
            for kind, cost in costs:
                bucket = self._bucket(charge.scope, kind, charge.limits, now_s)
                if bucket is None:
                    continue
                wait_s = bucket.wait_s(cost, now_s)
                if wait_s > 0 and (worst is None or wait_s > worst.retry_after_s):
                    worst = RateLimited(charge.scope, kind, bucket.capacity, wait_s)
        if worst is not None:
            raise worst
        for charge in charges:
            self.debit(charge.scope, 1, charge.num_tokens, now_s, charge.limits)

    def debit(
        self, scope: str, num_requests: int, num_tokens: int, now_s: float, limits: ScopeLimits | None = None
    ) -> None:
        """Apply consumption to a scope's buckets: a correction of this instance (negative tokens
        give back; `limits` given) or what another instance admitted (`limits` None: resolved with
        `limits_of`). Another instance's consumption of a scope not limited here is remembered for
        a window, and debited if a bucket of that scope is made within it (the scope's limits may
        only be known from its next request: a JWT's claims)."""
        is_reported = limits is None
        amounts: tuple[tuple[LimitKind, int], ...] = (("requests", num_requests), ("tokens", num_tokens))
        for kind, amount in amounts:
            if not amount:
                continue
            bucket = self._buckets.get((scope, kind))
            if bucket is None:  # first news of this scope here: its limits decide whether it is limited
                limits = limits or self._limits_of(scope)
                bucket = self._bucket(scope, kind, limits, now_s) if limits else None
            if bucket is not None:
                bucket.debit(amount, now_s)
            elif is_reported:
                self._remember(scope, kind, amount, now_s)

    def _remember(self, scope: str, kind: LimitKind, amount: float, now_s: float) -> None:
        key = (scope, kind)
        entries = self._unbound.pop(key, [])
        self._unbound[key] = entries  # most recently reported last: the first evicted is the stalest
        while entries and entries[0][0] <= now_s - SECONDS_PER_WINDOW:
            entries.pop(0)
        if entries and now_s - entries[-1][0] < UNBOUND_BIN_S and entries[-1][0] <= now_s:
            entries[-1][0], entries[-1][1] = now_s, entries[-1][1] + amount
        else:
            entries.append([now_s, amount])
        while len(self._unbound) > MAX_UNBOUND:
            self._unbound.popitem(last=False)

    def level(self, scope: str, kind: LimitKind, now_s: float) -> float | None:
        """Units available now in a bucket, or None when it does not exist."""
        bucket = self._buckets.get((scope, kind))
        if bucket is None:
            return None
        bucket.refill(now_s)
        return bucket.level

    def reported(self, scope: str, kind: LimitKind, now_s: float) -> float:
        """What other instances reported of a scope that has no bucket here, within the window."""
        entries = self._unbound.get((scope, kind), [])
        return sum(amount for then_s, amount in entries if then_s > now_s - SECONDS_PER_WINDOW)

    def _bucket(self, scope: str, kind: LimitKind, limits: ScopeLimits, now_s: float) -> TokenBucket | None:
        limit = limits.of(kind)
        if limit is None:
            return None
        bucket = self._buckets.get((scope, kind))
        if bucket is None:
            remembered = [e for e in self._unbound.pop((scope, kind), []) if e[0] > now_s - SECONDS_PER_WINDOW]
            # Full at the first consumption reported within the window, then as if it had existed since.
            bucket = self._buckets[(scope, kind)] = TokenBucket(limit, min([now_s, *(t for t, _ in remembered)]))
            for then_s, amount in remembered:
                bucket.debit(amount, then_s)
        elif bucket.capacity != limit:
            bucket.refill(now_s)
            bucket.resize(limit)
        return bucket
