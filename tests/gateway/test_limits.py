"""Token buckets and admission control as pure cores: time is an argument, no broker, no sleeps."""

from __future__ import annotations

import math

import pytest

from schemas.messages import WorkerHeartbeat
from services.gateway.guard.admission import Admission
from services.gateway.guard.auth import GuardError
from services.gateway.guard.limits import Charge, RateLimited, RateLimiter, ScopeLimits, TokenBucket

KEY = ScopeLimits(max_requests_per_min=3, max_tokens_per_min=600)
TENANT = ScopeLimits(max_requests_per_min=5)


def charges(tokens: int = 100, key: str = "key:a", tenant: str = "tenant:t") -> list[Charge]:
    return [Charge(key, KEY, tokens), Charge(tenant, TENANT, tokens)]


def test_a_bucket_bursts_its_minute_then_refills_at_the_rate() -> None:
    bucket = TokenBucket(60, now_s=0.0)
    assert bucket.wait_s(60, 0.0) == 0
    bucket.debit(60, 0.0)
    assert bucket.wait_s(1, 0.0) == pytest.approx(1.0)  # 60/min: one a second
    assert bucket.wait_s(1, 1.0) == 0
    assert math.isinf(bucket.wait_s(61, 100.0))
    bucket.debit(-500, 100.0)  # a refund never overfills
    assert bucket.level == 60


def test_rpm_burst_is_refused_with_the_wait_and_nothing_taken() -> None:
    limiter = RateLimiter()
    for _ in range(3):
        limiter.admit(charges(), now_s=0.0)
    with pytest.raises(RateLimited) as limited:
        limiter.admit(charges(), now_s=0.0)
    assert (limited.value.scope, limited.value.kind, limited.value.limit) == ("key:a", "requests", 3)
    assert limited.value.retry_after_s == pytest.approx(20.0)  # 3/min: one every 20 s
    assert limiter.level("tenant:t", "requests", 0.0) == 2  # the refused request took nothing
    limiter.admit(charges(), now_s=20.0)


def test_tenant_limit_holds_across_its_keys() -> None:
    limiter = RateLimiter()
    for i in range(5):
        limiter.admit(charges(key=f"key:{i}"), now_s=0.0)
    with pytest.raises(RateLimited) as limited:
        limiter.admit(charges(key="key:new"), now_s=0.0)
    assert limited.value.scope == "tenant:t"
    limiter.admit(charges(key="key:other-tenant", tenant="tenant:u"), now_s=0.0)


def test_tokens_are_reserved_then_corrected_by_actual_usage() -> None:
    limiter = RateLimiter()
    limiter.admit(charges(tokens=500), now_s=0.0)
    with pytest.raises(RateLimited) as limited:
        limiter.admit(charges(tokens=500), now_s=0.0)
    assert limited.value.kind == "tokens"
    limiter.debit("key:a", 0, 20 - 500, 0.0)  # the terminal said 20 tokens were used
    limiter.admit(charges(tokens=500), now_s=0.0)
    with pytest.raises(RateLimited) as too_large:
        limiter.admit(charges(tokens=601), now_s=60.0)
    assert too_large.value.is_too_large


def test_what_other_instances_admitted_counts_here() -> None:
    limiter = RateLimiter(lambda scope: KEY if scope.startswith("key:") else None)
    limiter.debit("key:a", 3, 300, now_s=0.0)  # a peer admitted three requests
    with pytest.raises(RateLimited):
        limiter.admit(charges(), now_s=0.0)
    limiter.debit("key:unlimited-elsewhere", 0, 5, now_s=0.0)
    limiter.debit("sub:t:x", 10, 0, now_s=0.0)  # a scope with no known limit has no bucket here
    assert limiter.level("sub:t:x", "requests", 0.0) is None


def test_one_subject_in_two_tenants_has_two_buckets() -> None:
    limiter = RateLimiter()
    jwt = ScopeLimits(max_requests_per_min=3)
    for _ in range(3):
        limiter.admit([Charge("sub:globex:zed", jwt, 10), Charge("tenant:globex", TENANT, 10)], now_s=0.0)
    with pytest.raises(RateLimited) as limited:
        limiter.admit([Charge("sub:globex:zed", jwt, 10), Charge("tenant:globex", TENANT, 10)], now_s=0.0)
    assert limited.value.scope == "sub:globex:zed"
    limiter.admit([Charge("sub:acme:zed", jwt, 10), Charge("tenant:acme", TENANT, 10)], now_s=0.0)


def test_what_peers_spent_of_a_scope_not_yet_limited_here_counts_when_its_bucket_is_made() -> None:
    """A JWT's rpm comes in its claims: an instance that has not seen the subject yet cannot limit
    the peers' reports of it, but remembers them for the window."""
    limiter = RateLimiter(lambda scope: None)
    jwt = ScopeLimits(max_requests_per_min=3)
    limiter.debit("sub:acme:zed", 2, 0, now_s=10.0)  # a peer admitted two
    limiter.debit("sub:acme:zed", 1, 0, now_s=11.0)  # and one more
    limiter.debit("sub:acme:old", 3, 0, now_s=0.0)  # long enough ago to be refilled
    with pytest.raises(RateLimited) as limited:
        limiter.admit([Charge("sub:acme:zed", jwt, 1)], now_s=12.0)
    # 3/min: one every 20 s. Reports within UNBOUND_BIN_S are summed at the later one's time (11 s):
    # the strict side, one second later than the exact 30 s.
    assert limited.value.retry_after_s == pytest.approx(19.0)
    limiter.admit([Charge("sub:acme:zed", jwt, 1)], now_s=31.0)
    limiter.admit([Charge("sub:acme:old", jwt, 1)], now_s=75.0)  # its report fell out of the window
    assert limiter.level("sub:acme:old", "requests", 75.0) == 2
    # This instance's own corrections (limits given) of an unlimited kind are not remembered.
    limiter.debit("key:mine", 0, 100, now_s=12.0, limits=ScopeLimits(max_requests_per_min=3))
    limiter.admit([Charge("key:mine", ScopeLimits(max_requests_per_min=3, max_tokens_per_min=60), 60)], now_s=12.0)


def beat(num_waiting: int = 0, max_num_seqs: int = 8) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id="w",
        models=["echo"],
        is_ready=True,
        num_running=0,
        num_waiting=num_waiting,
        max_num_seqs=max_num_seqs,
        free_kv_blocks=10,
        block_size_tokens=16,
    )


def test_lanes_are_bounded_per_model_and_released() -> None:
    admission = Admission({"interactive": 2, "bulk": 1}, overload_ratio=2.0, is_breaker_enabled=True)
    tickets = [admission.admit("echo", "interactive", [beat()]) for _ in range(2)]
    with pytest.raises(GuardError) as full:
        admission.admit("echo", "interactive", [beat()])
    assert (full.value.status, full.value.code) == (429, "queue_full")
    admission.admit("echo", "bulk", [beat()])  # another lane
    admission.admit("other", "interactive", [beat()])  # another model
    admission.release(tickets[0])
    admission.admit("echo", "interactive", [beat()])


def test_breaker_opens_without_a_live_worker_and_closes_with_one() -> None:
    admission = Admission({"interactive": 2, "bulk": 1}, overload_ratio=2.0, is_breaker_enabled=True)
    with pytest.raises(GuardError) as unavailable:
        admission.admit("echo", "interactive", [])
    assert (unavailable.value.status, unavailable.value.code) == (503, "model_unavailable")
    assert admission.open_breakers == {"echo"} and admission.in_flight["echo", "interactive"] == 0
    admission.admit("echo", "interactive", [beat()])
    assert admission.open_breakers == set()


def test_overloaded_workers_refuse_fast() -> None:
    admission = Admission({"interactive": 9, "bulk": 9}, overload_ratio=2.0, is_breaker_enabled=True)
    with pytest.raises(GuardError) as overloaded:
        admission.admit("echo", "interactive", [beat(num_waiting=16), beat(num_waiting=20)])
    assert (overloaded.value.status, overloaded.value.code) == (429, "overloaded")
    assert overloaded.value.headers["retry-after"] == "1"
    admission.admit("echo", "interactive", [beat(num_waiting=16), beat(num_waiting=3)])  # one has room


def test_a_version_a_live_worker_brings_up_is_admitted_and_closes_the_breaker() -> None:
    admission = Admission({"interactive": 2, "bulk": 1}, overload_ratio=2.0, is_breaker_enabled=True)
    with pytest.raises(GuardError):
        admission.admit("echo@1", "interactive", [])
    admission.admit("echo@1", "interactive", [], coming=True)  # the batcher holds it until ready
    assert admission.open_breakers == set() and admission.in_flight["echo@1", "interactive"] == 1
