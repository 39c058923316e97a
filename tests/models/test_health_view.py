"""`weir models health`'s view (weir/models/health.py): the latest alert per (version, signal) of
the health topic's records, malformed ones skipped and counted; ages from the registry."""

from __future__ import annotations

from schemas.codec import encode
from schemas.registry import ModelManifest, ModelVersionRecord, RegistryState
from schemas.telemetry import HealthAlert
from weir.models.health import health_text, health_view, latest_alerts

T0 = 1_700_000_000_000
DAY_MS = 86400 * 1000


def alert(served_id: str, signal: str, state: str, created_ms: int, **extra) -> tuple[bytes, bytes]:
    fields = {"alert_id": f"{served_id}-{signal}-{created_ms}", "model_version": served_id, "signal": signal, "state": state,
              "value": 0.2, "baseline": 2.0, "threshold": 0.3, "detail": "entropy relative drift 0.9 > 0.3",
              "created_ms": created_ms, **extra}
    return served_id.encode(), encode(HealthAlert(**fields))


def test_the_latest_alert_per_version_and_signal_and_malformed_records_skipped() -> None:
    records = [alert("tiny@1", "entropy", "raised", T0), alert("tiny@1", "entropy", "cleared", T0 + 5, value=1.9),
               alert("tiny@2", "entropy", "raised", T0 + 3), (b"x", b"not json"), (b"y", b'{"signal": "entropy"}'),
               alert("tiny@1", "freshness", "raised", T0 + 1, baseline=None, value=40 * 86400.0, threshold=30 * 86400.0),
               alert("other@1", "watermark", "raised", T0)]
    latest, skipped = latest_alerts(records)
    assert skipped == 2 and latest[("tiny@1", "entropy")].state == "cleared"
    state = RegistryState()
    record = ModelVersionRecord(manifest=ModelManifest(name="tiny", version="1", format="echo", location="", created_ms=T0))
    state.apply(record.key, record)
    view = health_view(state, latest, "tiny", T0 + 40 * DAY_MS)
    assert [v["model_version"] for v in view] == ["tiny@1", "tiny@2"]  # other@1 is not of this name
    assert view[0]["freshness_s"] == 40 * 86400.0 and view[0]["open_alerts"] == ["freshness"]
    assert view[0]["entropy"] == {"baseline": 2.0, "current": 1.9, "as_of_ms": T0 + 5} and view[0]["watermark"] is None
    assert view[1]["freshness_s"] is None and view[1]["open_alerts"] == ["entropy"]
    text = health_text(view, skipped)
    assert "tiny@1   loaded   40.0" in text and "2/1.9" in text and "tiny@2 entropy raised at" in text
    assert "(2 malformed health record(s) skipped)" in text
    assert health_text([], 0) == "no model versions"
