"""Fleet: the latest heartbeat of every worker, and which of them are live, per model version.

Readiness asks it whether any worker is live; admission control asks it what the live workers
offer a version (serve it, bring it up, or gave up on it: availability); GET /v1/models and the
admin index ask what state each version is in on each worker
(WorkerHeartbeat.versions, docs/design.md "The model registry"). Pure: heartbeats and `now_ms`
come in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.messages import VersionStatus, WorkerHeartbeat
from schemas.registry import split_ref

# The states a worker still answers a version's requests in: ready, and draining (the batcher sends
# requests pinned just before a promotion to a draining version; docs/design.md, "The model registry").
SERVING_STATES = frozenset({"ready", "draining"})
# The states of a version a worker is bringing up (unhealthy: it is being reloaded from verified
# files); a request the batcher holds for it is served once the worker reports it ready.
COMING_STATES = frozenset({"verifying", "loading", "golden", "unhealthy"})
# The states a worker gave up on a version in (the batcher rejects its requests at once).
GIVEN_UP_STATES = frozenset({"failed", "refused"})


TAKE_UP_MS = 30_000  # how long after a version is wanted loaded a worker holding its name must report it


@dataclass(frozen=True)
class Availability:
    """What the live fleet offers one version: the workers that serve it now; else whether one is
    bringing it up (`coming`: admit, the batcher holds the request), else why it cannot be served
    (`problem`: retrying cannot help). All empty: no live worker serves its name (the breaker)."""

    serving: list[WorkerHeartbeat] = field(default_factory=list)
    coming: bool = False
    problem: str | None = None


class Fleet:
    """Latest heartbeat per worker_id; live = ready and sent within `live_ms` of now."""

    def __init__(self, live_ms: int = 10_000) -> None:
        self.live_ms = live_ms
        self._latest: dict[str, WorkerHeartbeat] = {}

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        """Keep a heartbeat unless an equally new or newer one of that worker is already known."""
        known = self._latest.get(heartbeat.worker_id)
        if known is None or heartbeat.sent_ms >= known.sent_ms:
            self._latest[heartbeat.worker_id] = heartbeat

    def forget(self, worker_id: str) -> None:
        """Drop a worker (a tombstone on the compacted workers topic)."""
        self._latest.pop(worker_id, None)

    def live(self, now_ms: int) -> list[WorkerHeartbeat]:
        """Heartbeats of the workers that are ready and were heard from within live_ms."""
        return [hb for hb in self._latest.values() if hb.is_ready and now_ms - hb.sent_ms <= self.live_ms]

    def live_by_model(self, now_ms: int) -> dict[str, list[WorkerHeartbeat]]:
        """Live heartbeats grouped by the models each worker serves."""
        out: dict[str, list[WorkerHeartbeat]] = {}
        for hb in self.live(now_ms):
            for model in hb.models:
                out.setdefault(model, []).append(hb)
        return out

    def serving(self, served_id: str, now_ms: int) -> list[WorkerHeartbeat]:
        """Live heartbeats of the workers that answer version `served_id` (name@version): ready, or
        draining it (WorkerHeartbeat.models lists the ready ones)."""
        return [
            hb
            for hb in self.live(now_ms)
            if served_id in hb.models or (served_id in hb.versions and hb.versions[served_id].state in SERVING_STATES)
        ]

    def availability(
        self, served_id: str, desired: str, now_ms: int, wanted_since_ms: int | None = None
    ) -> Availability:
        """What the live workers offer version `served_id`, which the registry wants `desired`
        (docs/design.md, "The model registry"): serving it; bringing it up (a transitional state,
        or it is wanted loaded and a worker serves other versions of its name, so it will load it);
        failed or refused on every worker reporting it (the batcher's rule: the reasons, per
        worker); unloaded and served nowhere; or nothing (no live worker serves the name)."""
        if serving := self.serving(served_id, now_ms):
            return Availability(serving)
        live = self.live(now_ms)
        reports = {hb.worker_id: hb.versions[served_id] for hb in live if served_id in hb.versions}
        if any(status.state in COMING_STATES for status in reports.values()):
            return Availability(coming=True)
        if reports:  # every one failed or refused
            said = "; ".join(
                f"{status.state} on {wid}: {status.reason or 'no reason given'}"
                for wid, status in sorted(reports.items())
            )
            return Availability(problem=f"model version {served_id!r} cannot be served: {said}")
        name = split_ref(served_id)[0]
        if desired == "unloaded":
            return Availability(
                problem=f"model version {served_id!r} is unloaded and no live worker serves it; load it "
                f"(POST /v2/repository/models/{name}/load, or weir models load {served_id}) and wait "
                "until it is ready"
            )
        holds_name = any(split_ref(other)[0] == name for hb in live for other in [*hb.versions, *hb.models])
        if desired == "loaded" and holds_name and wanted_since_ms is not None and now_ms - wanted_since_ms > TAKE_UP_MS:
            # Workers that hold its name report a version within a heartbeat of its record (loading,
            # then ready or failed); none has, long after: they do not know it (a record they could
            # not read, another registry). Admitting would leave the request waiting for its deadline.
            return Availability(
                problem=f"model version {served_id!r} is wanted loaded since "
                f"{(now_ms - wanted_since_ms) // 1000} s ago, but no live worker reports it "
                f"(they serve other versions of {name!r}); see `weir models show {name}`"
            )
        return Availability(coming=desired == "loaded" and holds_name)

    def version_states(self, now_ms: int) -> dict[str, dict[str, VersionStatus]]:
        """Per version (name@version), per live worker, the status that worker reports."""
        out: dict[str, dict[str, VersionStatus]] = {}
        for hb in self.live(now_ms):
            for served_id, status in hb.versions.items():
                out.setdefault(served_id, {})[hb.worker_id] = status
        return out

    def ready_versions(self, now_ms: int) -> set[str]:
        """Every version some live worker reports ready."""
        return {
            served_id
            for served_id, by_worker in self.version_states(now_ms).items()
            if any(status.state == "ready" for status in by_worker.values())
        }

    def __len__(self) -> int:
        return len(self._latest)
