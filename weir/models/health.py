"""`weir models health [NAME]`: each version's freshness and the auditor's health alerts
(docs/design.md, "Observability").

Topics.health (HealthAlert, from the auditor: services/auditor/drift.py) is read from its beginning
and folded to the latest alert per (version, signal): `latest_alerts`, which any reader of that
topic can use (a record that is no HealthAlert is skipped and counted, docs/design.md, invariant 6).
Freshness comes from the registry (now - the manifest's created_ms). The baseline and current
values of entropy and watermark are those of the latest alert of each signal: the auditor publishes
them with each transition, and its /metrics (weir_model_output_entropy_nats, weir_model_watermark_z)
has them at any time. So are the output SLA's (docs/design.md, "Structured output, tools and
logprobs"): the structured valid rate with its valid/invalid counts, and the determinism comparison's
same/differs counts, of each signal's latest alert (`outcome_view`; live on the auditor's /metrics:
weir_model_structured_valid_rate, weir_determinism_checks_total).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from schemas.codec import DecodeError, decode
from schemas.registry import RegistryState, split_ref
from schemas.telemetry import HealthAlert
from weir.bus import BusSettings, read_topic

SIGNALS = ("freshness", "entropy", "watermark", "error_rate", "golden", "structured", "determinism")
OUTCOME_SIGNALS = ("structured", "determinism")  # counted outcomes: value is the good share, counts behind it


def latest_alerts(records: Iterable[tuple[bytes | None, bytes | None]]) -> tuple[dict[tuple[str, str], HealthAlert], int]:
    """(the latest alert per (model_version, signal), records skipped) of the health topic's records."""
    latest: dict[tuple[str, str], HealthAlert] = {}
    skipped = 0
    for _key, value in records:
        try:
            alert = decode(HealthAlert, value)
        except DecodeError:
            skipped += 1
            continue
        held = latest.get((alert.model_version, alert.signal))
        if held is None or alert.created_ms >= held.created_ms:
            latest[(alert.model_version, alert.signal)] = alert
    return latest, skipped


async def read_alerts(settings: BusSettings) -> tuple[dict[tuple[str, str], HealthAlert], int]:
    """latest_alerts of Topics.health, read from its beginning to its end."""
    return latest_alerts(await read_topic(settings, settings.topics.health))


def outcome_view(alert: HealthAlert | None) -> dict[str, Any] | None:
    """An outcome signal's latest alert as shown: the good share (`rate`), the counts behind it
    (valid/invalid, same/differs), its state and when; None without an alert."""
    if alert is None:
        return None
    return {"rate": alert.value, **alert.counts, "state": alert.state, "as_of_ms": alert.created_ms}


def health_view(state: RegistryState, alerts: dict[tuple[str, str], HealthAlert], name: str | None,
                now_ms: int) -> list[dict[str, Any]]:
    """One entry per version (of `name`, or all) the registry or the alerts know, oldest name first."""
    versions = {served_id for served_id in state.versions} | {served_id for served_id, _ in alerts}
    out = []
    for served_id in sorted(v for v in versions if name is None or split_ref(v)[0] == name):
        record = state.versions.get(served_id)
        entry: dict[str, Any] = {
            "model_version": served_id,
            "desired": record.desired if record else None,
            "freshness_s": (now_ms - record.manifest.created_ms) / 1000 if record else None,
            "open_alerts": [s for s in SIGNALS if (a := alerts.get((served_id, s))) is not None and a.state == "raised"],
        }
        for signal in ("entropy", "watermark"):
            alert = alerts.get((served_id, signal))
            entry[signal] = None if alert is None else {"baseline": alert.baseline, "current": alert.value,
                                                        "as_of_ms": alert.created_ms}
        for signal in OUTCOME_SIGNALS:
            entry[signal] = outcome_view(alerts.get((served_id, signal)))
        entry["alerts"] = [alerts[(served_id, s)].model_dump(mode="json") for s in SIGNALS if (served_id, s) in alerts]
        out.append(entry)
    return out


def health_text(view: list[dict[str, Any]], skipped: int) -> str:
    """The view as a table, then each open alert's detail."""
    if not view:
        return "no model versions" + (f" ({skipped} malformed health record(s) skipped)" if skipped else "")
    headers = ["VERSION", "DESIRED", "AGE (days)", "ENTROPY base/cur", "WATERMARK Z base/cur", "STRUCTURED valid",
               "DETERMINISM same/differs", "OPEN ALERTS"]
    rows = [[e["model_version"], e["desired"] or "-",
             "-" if e["freshness_s"] is None else f"{e['freshness_s'] / 86400:.1f}",
             _pair(e["entropy"]), _pair(e["watermark"]), _outcome(e["structured"], "valid", "invalid"),
             _outcome(e["determinism"], "same", "differs"), ",".join(e["open_alerts"]) or "-"] for e in view]
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in [headers, *rows]]
    for entry in view:
        for alert in entry["alerts"]:
            if alert["state"] == "raised":
                lines.append(f"  {entry['model_version']} {alert['signal']} raised at {alert['created_ms']} ms: "
                             f"value {alert['value']:.4g}, threshold {alert['threshold']:.4g}; {alert['detail']}")
    if skipped:
        lines.append(f"({skipped} malformed health record(s) skipped)")
    lines.append("(base/cur, structured, determinism: as of each signal's latest alert; the auditor's /metrics has "
                 "them live)")
    return "\n".join(lines)


def _pair(values: dict[str, Any] | None) -> str:
    if values is None:
        return "-"
    baseline = "-" if values["baseline"] is None else f"{values['baseline']:.3g}"
    return f"{baseline}/{values['current']:.3g}"


def _outcome(values: dict[str, Any] | None, good: str, bad: str) -> str:
    """`structured` as "75% (3/4)" (valid of all), `determinism` as "3/1" (same/differs)."""
    if values is None:
        return "-"
    n_good, n_bad = values.get(good, 0), values.get(bad, 0)
    if good == "valid":
        return f"{values['rate']:.0%} ({n_good}/{n_good + n_bad})"
    return f"{n_good}/{n_bad}"
