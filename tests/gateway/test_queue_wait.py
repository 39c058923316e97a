"""Admission from the queue as pure cores: the wait estimate, its staleness, the 429 it makes."""

from __future__ import annotations

import pytest

from schemas.codec import encode
from schemas.messages import Batch, GenerateRequest, WorkerHeartbeat, now_ms
from services.gateway.fleet import Fleet
from services.gateway.guard.admission import Admission
from services.gateway.guard.auth import GuardError
from services.gateway.queue_wait import (
    MAX_RETRY_AFTER_S,
    BatchBacklog,
    QueueWait,
    count_requests,
    estimate,
    owner_positions,
    partition_requests,
)
from weir.bus import BusSettings


def beat(
    worker_id: str = "w1",
    num_waiting: int = 0,
    per_s: float | None = 1.0,
    next_offsets: dict[int, int] | None = None,
    num_running: int = 0,
    partitions: list[int] | None = None,
    service_s: float | None = None,
    max_num_seqs: int = 8,
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        models=["echo@1"],
        is_ready=True,
        num_running=num_running,
        num_waiting=num_waiting,
        max_num_seqs=max_num_seqs,
        free_kv_blocks=10,
        block_size_tokens=16,
        finished_per_s=per_s,
        service_s=service_s,
        next_offsets={"echo@1": next_offsets or {}},
        partitions={"echo@1": [0] if partitions is None else partitions},
    )


def request(i: int, priority: str = "interactive") -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{i}",
        model="echo@1",
        prompt="hi",
        reply_to="p.replies.g",
        priority=priority,
        deadline_ms=2_000_000_000_000,
    )


def test_the_wait_is_the_queue_ahead_over_the_fleets_drain_rate() -> None:
    wait = estimate("echo@1", [beat("w1", num_waiting=4, per_s=0.5), beat("w2", num_waiting=2, per_s=1.5)], unread=14)
    assert wait == QueueWait("echo@1", queue_ahead=20, per_s=2.0) and wait.wait_s == 10.0


def test_running_requests_are_ahead_too_and_a_worker_without_partitions_counts_for_nothing() -> None:
    # continuous batching: a new request shares every step with those in flight
    assert estimate("echo@1", [beat(num_running=30, num_waiting=0, per_s=10.0)], unread=0).wait_s == 3.0
    # a heartbeat claiming a huge queue at a tiny rate, owning no partition (a forged one): not counted
    forged = beat("forger", num_waiting=10**9, per_s=1e-9, partitions=[])
    assert estimate("echo@1", [beat(per_s=4.0), forged], unread=8).wait_s == 2.0
    assert estimate("echo@1", [forged], unread=8) is None


def test_a_burst_drains_at_its_concurrency_not_at_the_rate_a_quieter_minute_measured() -> None:
    """Issue 35's false 429: 64 echo streams (20 tokens/s, about 8 s each) running at once, 14 more
    unread, while the last minute's light load measured 0.36 ends a second: "about 217 s long (78
    requests ahead at 0.36/s)". 64 at once for 8 s each end 8 a second: the last of the 78 ends in
    about 10 s, well within a 120 s deadline."""
    old = beat(num_running=64, per_s=0.36, max_num_seqs=64)
    assert estimate("echo@1", [old], unread=14).wait_s == pytest.approx(78 / 0.36)  # a heartbeat without service_s
    burst = beat(num_running=64, per_s=0.36, max_num_seqs=64, service_s=8.0)
    wait = estimate("echo@1", [burst], unread=14)
    assert wait.queue_ahead == 78 and wait.per_s == pytest.approx(64 / 8.0) and wait.wait_s < 10
    admission = Admission({"interactive": 999, "bulk": 9}, overload_ratio=2.0, is_breaker_enabled=True)
    admission.admit("echo@1", "interactive", [burst], wait=wait, time_to_deadline_s=120.0)


def test_a_cold_worker_with_a_service_time_is_estimated_and_the_measured_rate_wins_when_higher() -> None:
    # Fewer than 5 busy seconds: no finished_per_s yet, but the first requests that ended took 2 s.
    cold = beat(num_running=2, num_waiting=30, per_s=None, service_s=2.0, max_num_seqs=64)
    assert estimate("echo@1", [cold], unread=0).per_s == pytest.approx(32 / 2.0)  # the waiting run beside the 2
    # Draining a burst: fewer run now than ended a second over the last minute; the measured rate stands.
    tail = beat(num_running=1, per_s=6.0, service_s=2.0, max_num_seqs=64)
    assert estimate("echo@1", [tail], unread=0).per_s == 6.0
    assert estimate("echo@1", [beat(per_s=None, service_s=None)], unread=5) is None  # neither: unknown


def test_a_queue_past_max_num_seqs_waits_in_waves_and_is_still_refused() -> None:
    # 8 at a time for 2 s each: 40 ahead take 5 waves, 10 s; a request with 5 s to its deadline cannot make it.
    full = beat(num_running=8, num_waiting=20, per_s=None, service_s=2.0, max_num_seqs=8)
    wait = estimate("echo@1", [full], unread=12)
    assert (wait.queue_ahead, wait.per_s, wait.wait_s) == (40, 4.0, 10.0)
    admission = Admission({"interactive": 9, "bulk": 9}, overload_ratio=99.0, is_breaker_enabled=True)
    with pytest.raises(GuardError) as refused:
        admission.admit("echo@1", "interactive", [full], wait=wait, time_to_deadline_s=5.0)
    assert refused.value.code == "queue_too_long"
    # Two such workers share the unread: each runs 8 at once.
    pair = [beat("w1", num_running=8, per_s=None, service_s=2.0), beat("w2", num_running=0, per_s=None, service_s=2.0)]
    assert estimate("echo@1", pair, unread=16).per_s == pytest.approx(4.0 + 4.0)
    # An engine that runs more than its max_num_seqs says (echo runs every request at once) is taken at its word.
    echo = beat(num_running=200, per_s=None, service_s=10.0, max_num_seqs=64)
    assert estimate("echo@1", [echo], unread=0).per_s == pytest.approx(20.0)


def test_retry_after_is_capped() -> None:
    assert QueueWait("echo@1", queue_ahead=10**9, per_s=1e-9).retry_after_s(3.0) == MAX_RETRY_AFTER_S


def test_an_unknown_rate_or_backlog_refuses_nothing() -> None:
    assert estimate("echo@1", [beat(per_s=1.0), beat("w2", per_s=None)], unread=0) is None  # w2 not measured yet
    assert estimate("echo@1", [beat(per_s=0.0)], unread=50) is None  # nothing measured drains
    assert estimate("echo@1", [beat()], unread=None) is None  # the backlog is stale or was never polled
    assert estimate("echo@1", [], unread=3) is None  # the breaker's case, not this one's


@pytest.mark.parametrize(("wait_s", "to_deadline_s", "retry_after"), [(40, 10, 30), (10.2, 10, 1), (30.5, 10, 21)])
def test_retry_after_is_the_seconds_until_it_would_fit(wait_s: float, to_deadline_s: float, retry_after: int) -> None:
    wait = QueueWait("echo@1", queue_ahead=int(wait_s * 10), per_s=10.0)
    admission = Admission({"interactive": 9, "bulk": 9}, overload_ratio=2.0, is_breaker_enabled=True)
    with pytest.raises(GuardError) as refused:
        admission.admit("echo@1", "interactive", [beat()], wait=wait, time_to_deadline_s=to_deadline_s)
    error = refused.value
    assert (error.status, error.code, error.headers) == (429, "queue_too_long", {"retry-after": str(retry_after)})
    assert "'echo@1'" in error.message and f"{wait.queue_ahead} requests ahead" in error.message
    assert error.body()["error"]["type"] and admission.in_flight["echo@1", "interactive"] == 0  # nothing taken


def test_a_wait_that_fits_the_deadline_or_an_unknown_one_is_admitted() -> None:
    admission = Admission({"interactive": 9, "bulk": 9}, overload_ratio=2.0, is_breaker_enabled=True)
    wait = QueueWait("echo@1", queue_ahead=10, per_s=1.0)
    admission.admit("echo@1", "interactive", [beat()], wait=wait, time_to_deadline_s=10.0)  # 10 s fits in 10 s
    admission.admit("echo@1", "interactive", [beat()], wait=None, time_to_deadline_s=0.5)
    admission.admit("echo@1", "interactive", [beat()], wait=wait, time_to_deadline_s=None)  # no deadline given
    assert admission.in_flight["echo@1", "interactive"] == 3


def test_lanes_are_not_told_apart() -> None:
    """The batch topic is read in order and num_waiting has no lane split: both lanes see it all."""
    admission = Admission({"interactive": 9, "bulk": 9}, overload_ratio=2.0, is_breaker_enabled=True)
    wait = estimate(
        "echo@1",
        [beat(num_waiting=5)],
        unread=count_requests(
            "echo@1",
            [
                encode(
                    Batch(
                        batch_id="b", model="echo@1", requests=[request(0, "bulk"), request(1, "bulk")], batcher_id="b"
                    )
                )
            ],
        ),
    )
    assert wait is not None and wait.queue_ahead == 7
    for lane in ("interactive", "bulk"):
        with pytest.raises(GuardError, match="7 requests ahead"):
            admission.admit("echo@1", lane, [beat()], wait=wait, time_to_deadline_s=3.0)


def test_only_batches_a_worker_would_run_are_counted() -> None:
    good = encode(Batch(batch_id="b1", model="echo@1", requests=[request(0), request(1), request(2)], batcher_id="b"))
    other = encode(Batch(batch_id="b2", model="echo@2", requests=[request(3)], batcher_id="b"))  # another version
    assert count_requests("echo@1", [good, other, b"{not json", None, good]) == 6


def test_records_past_those_read_count_at_their_mean() -> None:
    three = encode(Batch(batch_id="b1", model="echo@1", requests=[request(0), request(1), request(2)], batcher_id="b"))
    one = encode(Batch(batch_id="b2", model="echo@1", requests=[request(3)], batcher_id="b"))
    assert partition_requests("echo@1", [three, one], num_behind=2) == 4  # all read
    assert partition_requests("echo@1", [three, one], num_behind=1002) == 4 + 2000  # 2 a record
    assert partition_requests("echo@1", [], num_behind=50) == 0


def test_the_read_position_is_the_live_owners_next_offset() -> None:
    live = [beat("w1", next_offsets={0: 5, 1: 2}), beat("w2", next_offsets={1: 7, 3: 0})]  # both report 1: a rebalance
    assert owner_positions("echo@1", live) == {0: 5, 1: 7, 3: 0}
    assert owner_positions("other@1", live) == {}


def test_stale_or_missing_backlog_is_unknown() -> None:
    backlog = BatchBacklog(BusSettings(topic_prefix="p"), Fleet(), interval_s=1.0)
    assert backlog.count("echo@1", now=1_000) is None  # never polled
    backlog.unread, backlog.polled_ms = {"echo@1": 4}, 1_000
    assert backlog.count("echo@1", now=1_000 + 10_000) == 4
    assert backlog.count("echo@1", now=1_000 + 10_001) is None  # older than max(10 s, 3 polls)
    assert backlog.count("echo@2", now=1_000) is None  # not polled yet
    with pytest.raises(ValueError):
        BatchBacklog(BusSettings(topic_prefix="p"), Fleet(), interval_s=0)


async def test_a_failed_poll_keeps_the_last_values_until_they_are_stale() -> None:
    fleet = Fleet()
    fleet.observe(beat())
    backlog = BatchBacklog(BusSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="p"), fleet, interval_s=1.0)
    backlog.unread, backlog.polled_ms = {"echo@1": 4}, now_ms()
    assert await backlog.refresh() is False  # nobody listens there
    assert backlog.unread == {"echo@1": 4} and backlog.count("echo@1", now_ms()) == 4
    assert backlog.count("echo@1", now_ms() + 10_001) is None
