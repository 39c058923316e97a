"""The dashboard's data, unit by unit: percentiles from bucket deltas, throughput from counter deltas,
the alerts and usage views of their topics (bad records skipped and counted)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from schemas.codec import encode
from schemas.messages import LatencyHistogram, VersionLatency, WorkerHeartbeat
from schemas.telemetry import HealthAlert, RateCard, UsageTotals
from services.gateway.dashboard_data import AlertsView, MetricWindow, UsageView, heartbeat_samples, histogram_quantile
from weir.metrics import ITL_BUCKETS, TTFT_BUCKETS, ServiceMetrics

RECORD = SimpleNamespace(topic="t.health", partition=0, offset=7)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gateway_metrics():
    metrics = ServiceMetrics("gateway")
    yield metrics
    metrics.shutdown()


def test_histogram_quantile_interpolates_like_prometheus():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.5], 2 in (0.5, 1]
    buckets = [(0.1, 4.0), (0.5, 8.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 1 / 4)  # rank 5: 1 of 4 into (0.1, 0.5]
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 1.9 / 2)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    # past the last finite bound: that bound, as histogram_quantile answers
    assert histogram_quantile(0.9, [(0.1, 1.0), (float("inf"), 10.0)]) == 0.1


def test_percentiles_cover_only_the_window_not_what_came_before(gateway_metrics):
    ttft = gateway_metrics.histogram("weir_gateway_time_to_first_token_seconds", "TTFT", TTFT_BUCKETS)
    clock = Clock()
    window = MetricWindow(gateway_metrics.render, window_s=60, clock=clock)
    for _ in range(100):
        ttft.record(5.0, {"model_name": "m@1"})  # before the window: slow
    window.sample()
    clock.now += 10
    for _ in range(9):
        ttft.record(0.03, {"model_name": "m@1"})
    ttft.record(0.07, {"model_name": "m@2"})
    report = window.report()
    assert report["window_s"] == 10
    latency = report["latency"]["ttft"]
    assert latency["all"]["count"] == 10
    assert 0.02 < latency["all"]["p50"] <= 0.04  # the 5 s observations are not in it
    assert latency["by_model"]["m@1"]["count"] == 9 and latency["by_model"]["m@2"]["count"] == 1
    assert 0.06 < latency["by_model"]["m@2"]["p99"] <= 0.08
    assert report["latency"]["itl"] is None and report["latency"]["e2e"] is None  # absent: no data, not 0


def worker_beat(worker_id: str, ttft: list[int], itl: list[int]) -> WorkerHeartbeat:
    latency = VersionLatency(
        ttft=LatencyHistogram(bounds=[0.1, 1.0], counts=ttft), itl=LatencyHistogram(bounds=[0.05], counts=itl)
    )
    return WorkerHeartbeat(
        worker_id=worker_id,
        models=["echo@1"],
        is_ready=True,
        num_running=0,
        num_waiting=0,
        max_num_seqs=8,
        free_kv_blocks=1,
        block_size_tokens=16,
        latency={"echo@1": latency},
    )


def test_the_workers_ttft_counts_every_request_the_gateway_never_saw(gateway_metrics):
    """A Batch API job's requests never pass a gateway: its TTFT panel has them from the workers'
    heartbeats (vLLM's TTFT, every request), windowed like the gateway's own histograms."""
    clock = Clock()
    live = [worker_beat("w1", ttft=[50, 60, 60], itl=[100, 100]), worker_beat("w2", ttft=[0, 0, 0], itl=[0, 0])]
    window = MetricWindow(gateway_metrics.render, clock=clock, extra=lambda: heartbeat_samples(live))
    window.sample()
    clock.now += 10
    live = [worker_beat("w1", ttft=[50, 60, 70], itl=[130, 140]), worker_beat("w2", ttft=[8, 10, 10], itl=[0, 0])]
    report = window.report()
    ttft, itl = report["latency"]["worker_ttft"], report["latency"]["worker_itl"]
    assert ttft["all"]["count"] == 20 and ttft["by_model"]["echo@1"]["count"] == 20  # both workers, this window only
    assert ttft["all"]["p95"] > 0.1 and ttft["all"]["p50"] <= 1.0  # w1's 10 past 1 s, w2's 8 under 0.1 s and 2 past it
    assert itl["all"]["count"] == 40 and itl["all"]["p50"] <= 0.05
    assert report["latency"]["ttft"] is None  # the gateway timed nothing itself
    assert heartbeat_samples([]) == {}
    # w2 restarts (its counts begin again at 3): only its own series count from zero, w1's stay a difference
    live = [worker_beat("w1", ttft=[50, 60, 71], itl=[130, 140]), worker_beat("w2", ttft=[3, 3, 3], itl=[0, 0])]
    assert window.report()["latency"]["worker_ttft"]["all"]["count"] == 11 + 3


def test_a_window_with_no_observation_has_no_percentile(gateway_metrics):
    itl = gateway_metrics.histogram("weir_gateway_inter_token_latency_seconds", "ITL", ITL_BUCKETS)
    itl.record(0.02, {"model_name": "m@1"})
    clock = Clock()
    window = MetricWindow(gateway_metrics.render, clock=clock)
    window.sample()
    clock.now += 4
    assert window.report()["latency"]["itl"]["all"] == {"p50": None, "p95": None, "p99": None, "count": 0.0}


def test_throughput_is_the_token_counter_delta_over_the_span(gateway_metrics):
    tokens = gateway_metrics.counter("weir_gateway_generation_tokens", "tokens")
    tokens.add(1000, {"model_name": "m@1"})
    clock = Clock()
    window = MetricWindow(gateway_metrics.render, clock=clock)
    assert window.report()["throughput"] is None  # no snapshot yet: no rate
    window.sample()
    clock.now += 0.2
    assert window.report()["throughput"] is None  # too short a span to say anything
    clock.now += 3.8
    tokens.add(200, {"model_name": "m@1"})
    tokens.add(40, {"model_name": "m@2"})
    throughput = window.report()["throughput"]
    assert throughput == {"tokens_per_s": pytest.approx(60.0), "by_model": {"m@1": 50.0, "m@2": 10.0}}


def test_the_window_forgets_snapshots_older_than_its_start(gateway_metrics):
    tokens = gateway_metrics.counter("weir_gateway_generation_tokens", "tokens")
    clock = Clock()
    window = MetricWindow(gateway_metrics.render, window_s=10, clock=clock)
    for _ in range(10):
        window.sample()
        clock.now += 2
        tokens.add(20, {"model_name": "m@1"})
    report = window.report()
    assert 10 <= report["window_s"] <= 12
    assert report["throughput"]["tokens_per_s"] == pytest.approx(10.0)


def test_an_absent_metric_is_no_data_and_lag_is_read_as_it_is_now(gateway_metrics):
    window = MetricWindow(gateway_metrics.render)
    report = window.report()
    assert report["lag"] is None and report["throughput"] is None and report["window_s"] is None
    lags = {("weir.batcher", "weir.requests"): 12.0}
    gateway_metrics.gauge(
        "kafka_consumergroup_lag", "lag", lambda: [(v, {"consumergroup": g, "topic": t}) for (g, t), v in lags.items()]
    )
    assert window.report()["lag"] == [{"consumergroup": "weir.batcher", "topic": "weir.requests", "lag": 12.0}]


def _alert(alert_id: str, state: str, created_ms: int, signal: str = "entropy") -> HealthAlert:
    return HealthAlert(
        alert_id=alert_id,
        model_version="m@1",
        signal=signal,
        state=state,
        value=2.5,
        baseline=1.0,
        threshold=2.0,
        created_ms=created_ms,
    )


def test_alerts_keep_the_latest_and_the_open_ones_and_skip_bad_records():
    view = AlertsView(keep=3)
    for alert in [_alert("a1", "raised", 1), _alert("a2", "raised", 2, "freshness"), _alert("a3", "cleared", 3)]:
        view.on_record(b"k", encode(alert), RECORD)
    view.on_record(b"k", encode(_alert("a1", "raised", 1)), RECORD)  # a retried publish
    view.on_record(b"k", b"{not json", RECORD)
    view.on_record(b"k", b'{"alert_id": "x", "model_version": "m@1", "signal": "vibes"}', RECORD)
    view.on_record(b"k", None, RECORD)
    view.on_record(b"k", encode(_alert("a0", "raised", 0)), RECORD)  # late and older: not the latest
    report = view.report()
    assert [a["alert_id"] for a in report["open"]] == ["a2"]  # entropy was cleared after it was raised
    assert [a["alert_id"] for a in report["recent"]] == ["a3", "a2", "a0"]  # newest first, keep=3
    assert report["skipped"] == 3


def test_the_health_panel_has_each_versions_output_sla_from_its_latest_alerts():
    view = AlertsView()
    outcomes = [
        ("s1", "structured", "raised", 0.75, {"valid": 3, "invalid": 1}, 1),
        ("s2", "structured", "cleared", 1.0, {"valid": 4, "invalid": 0}, 2),
        ("d1", "determinism", "raised", 0.5, {"same": 1, "differs": 1}, 3),
    ]
    for alert_id, signal, state, rate, counts, created_ms in outcomes:
        alert = HealthAlert(
            alert_id=alert_id,
            model_version="m@1",
            signal=signal,
            state=state,
            value=rate,
            threshold=1.0,
            counts=counts,
            created_ms=created_ms,
        )
        view.on_record(b"k", encode(alert), RECORD)
    entropy_only = _alert("e1", "raised", 4).model_copy(update={"model_version": "m@2"})
    view.on_record(b"k", encode(entropy_only), RECORD)  # no output-SLA alert: no SLA row
    sla = view.report()["sla"]
    assert list(sla) == ["m@1"]
    assert sla["m@1"]["structured"] == {"rate": 1.0, "valid": 4, "invalid": 0, "state": "cleared", "as_of_ms": 2}
    assert sla["m@1"]["determinism"] == {"rate": 0.5, "same": 1, "differs": 1, "state": "raised", "as_of_ms": 3}


def _usage(
    tenant: str, principal: str, day: str = "2026-12-02", tokens: int = 100, cost: float | None = 0.5
) -> UsageTotals:
    return UsageTotals(
        day=day,
        tenant=tenant,
        principal=principal,
        model_version="m@1",
        requests=2,
        prompt_tokens=tokens,
        completion_tokens=tokens,
        cost_usd=cost,
    )


def test_top_tenants_sum_the_latest_totals_of_the_day_and_skip_forged_keys():
    view = UsageView()
    for totals in [
        _usage("acme", "a", tokens=10),
        _usage("acme", "a", tokens=300),
        _usage("acme", "b", cost=None),
        _usage("zeta", "z", tokens=50),
        _usage("old", "o", day="2026-12-01", tokens=10_000),
    ]:
        view.on_record(totals.key().encode(), encode(totals), RECORD)
    rate = RateCard(model_version="m@1", tokens_per_hour=1e6, window_s=60)
    view.on_record(rate.key().encode(), encode(rate), RECORD)
    view.on_record(b"usage\x1fforged", encode(_usage("evil", "e", tokens=10**9)), RECORD)
    view.on_record(b"k", b"[1, 2]", RECORD)
    view.on_record(b"k", b'{"kind": "bill"}', RECORD)
    top = view.top_tenants("2026-12-02")
    assert [(row["tenant"], row["tokens"]) for row in top] == [("acme", 800), ("zeta", 100)]
    assert top[0]["cost_usd"] == 0.5 and top[0]["unpriced"] is True and top[0]["requests"] == 4
    assert view.skipped == 3
    view.on_record(_usage("zeta", "z").key().encode(), None, RECORD)  # a tombstone
    assert [row["tenant"] for row in view.top_tenants("2026-12-02")] == ["acme"]


def test_a_histogram_with_more_labels_is_summed_per_model(gateway_metrics):
    e2e = gateway_metrics.histogram("weir_gateway_e2e_request_latency_seconds", "e2e", (1.0, 2.0, 4.0))
    clock = Clock()
    window = MetricWindow(gateway_metrics.render, clock=clock)
    window.sample()
    clock.now += 2
    for lane, seconds in (("interactive", 0.5), ("interactive", 0.5), ("bulk", 3.0), ("bulk", 3.0)):
        e2e.record(seconds, {"model_name": "m@1", "lane": lane})
    model = window.report()["latency"]["e2e"]["by_model"]["m@1"]
    assert model["count"] == 4 and model["p50"] == pytest.approx(1.0) and 2.0 < model["p99"] <= 4.0
