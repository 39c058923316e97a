"""The auditor's tenant labels are bounded: audit events anyone may forge (plaintext mode) with a
new tenant each cost a few series, not one each (weir.metrics.TenantLabels)."""

from __future__ import annotations

from services.auditor.health import HealthMetrics
from tests.auditor.factories import make_event
from weir.metrics import samples


def test_a_stream_of_new_tenants_shares_the_other_label() -> None:
    health = HealthMetrics()
    for i in range(200):
        health.observe(make_event(i, model="tiny", model_version="tiny@1", tenant=f"forged-{i}"))
    tenants = {
        dict(labels)["tenant"] for name, labels in samples(health.render()) if name == "weir_audit_requests_total"
    }
    assert len(tenants) == 51 and "other" in tenants
    total = sum(v for (name, _), v in samples(health.render()).items() if name == "weir_audit_requests_total")
    assert total == 200  # every request counted, under its own name or "other"
    health.service.shutdown()
