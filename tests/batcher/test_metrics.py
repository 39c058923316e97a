"""The batcher's event metrics without a broker: known batches and waits -> bucket counts, tenant labels bounded."""

from __future__ import annotations

import pytest

from services.batcher.metrics import BatcherMetrics
from services.batcher.planner import Planner, Slot
from weir.metrics import OTHER, ServiceMetrics, TenantLabels, samples, value

from .factories import T0_MS, make_models, make_request


def buckets(text: str, name: str, **labels: str) -> dict[str, float]:
    out = {}
    for (sample, pairs), count in samples(text).items():
        found = dict(pairs)
        le = found.pop("le", None)
        if sample == f"{name}_bucket" and found == labels and le is not None:
            out[le] = count
    return out


class Room:
    """A placement that offers one worker with `room_tokens` of room."""

    def __init__(self, room_tokens: int) -> None:
        self.room_tokens = room_tokens

    def place(self, model, head, cost_tokens, now_ms):
        return Slot("w1", 0, self.room_tokens)

    def record(self, model, slot, num_tokens, now_ms):
        return None


def test_a_batch_records_its_size_fill_and_each_requests_wait() -> None:
    planner = Planner(make_models(a=(3, 50)))
    service = ServiceMetrics("batcher")
    metrics = BatcherMetrics(service)
    for i, at in enumerate((0, 10, 30)):  # held at T0, T0+10 ms, T0+30 ms; the third fills the batch
        req = make_request("a", request_id=f"r{i}").model_copy(update={"tenant": "acme"})
        metrics.on_admitted(req)
        planner.add(req, T0_MS + at)
    result = planner.poll(T0_MS + 30, Room(64))  # echo requests cost 16 tokens each: 48 of 64
    [batch] = result.batches
    metrics.on_batch(batch, T0_MS + 30)
    text = service.render()
    service.shutdown()
    assert value(text, "weir_batcher_batch_size_sum", model_name="a@1") == 3
    assert buckets(text, "weir_batcher_batch_size", model_name="a@1")["2"] == 0
    assert buckets(text, "weir_batcher_batch_size", model_name="a@1")["4"] == 1
    assert value(text, "weir_batcher_batch_fill_sum", model_name="a@1") == 0.75
    fill = buckets(text, "weir_batcher_batch_fill", model_name="a@1")
    assert (fill["0.7"], fill["0.8"]) == (0, 1)
    wait = buckets(text, "weir_batcher_queue_wait_seconds", lane="interactive", tenant="acme")
    assert (wait["0.001"], wait["0.02"], wait["0.04"]) == (1, 2, 3)  # waited 0, 20 and 30 ms
    assert value(text, "weir_batcher_queue_wait_seconds_sum", lane="interactive", tenant="acme") == pytest.approx(0.05)


def test_an_unrouted_batch_has_no_fill_and_depth_and_expiries_go_by_lane_and_tenant() -> None:
    planner = Planner(make_models(a=(8, 50)))
    service = ServiceMetrics("batcher")
    metrics = BatcherMetrics(service)
    reqs = [
        make_request("a", priority=lane, deadline_ms=T0_MS + deadline).model_copy(update={"tenant": tenant})
        for lane, tenant, deadline in (
            ("interactive", "acme", 10),
            ("bulk", "acme", 60_000),
            ("bulk", "zed", 60_000),
            ("bulk", "zed", 60_000),
        )
    ]
    for req in reqs:
        metrics.on_admitted(req)
        planner.add(req, T0_MS)
    assert metrics.observe_depth(planner) == [
        (1, {"lane": "bulk", "tenant": "acme"}),
        (2, {"lane": "bulk", "tenant": "zed"}),
        (1, {"lane": "interactive", "tenant": "acme"}),
    ]
    result = planner.poll(T0_MS + 50)  # no placement: unbounded, unrouted
    for req in result.expired:
        metrics.on_expired(req)
    for batch in result.batches:
        metrics.on_batch(batch, T0_MS + 50)
    text = service.render()
    service.shutdown()
    assert value(text, "weir_batcher_requests_expired_total", lane="interactive", tenant="acme") == 1
    assert value(text, "weir_batcher_batch_size_sum", model_name="a@1") == 3
    assert value(text, "weir_batcher_batch_fill_count", model_name="a@1") is None
    assert metrics.observe_depth(planner) == []
    assert metrics.observe_depth(None) == []


def test_tenants_beyond_the_busiest_are_other_and_a_busier_one_takes_a_place() -> None:
    labels = TenantLabels(max_named=2, max_counted=3)
    for tenant in ("a", "a", "b", "c"):
        labels.count(tenant)
    assert (labels.of("a"), labels.of("b"), labels.of("c")) == ("a", "b", OTHER)
    labels.count("c")
    labels.count("c")  # c (3) now has more than b (1): it takes b's place
    assert (labels.of("a"), labels.of("b"), labels.of("c")) == ("a", OTHER, "c")
    for _ in range(5):
        labels.count("d")  # a 4th tenant past max_counted is never counted: "other" for good
    assert labels.of("d") == OTHER
    with pytest.raises(ValueError):
        TenantLabels(max_named=0)
