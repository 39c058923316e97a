"""Fleet: the latest heartbeat of every worker, and which of them are live, per model version.

Readiness asks it whether any worker is live; admission control asks it which live workers serve
a version; GET /v1/models and the admin index ask what state each version is in on each worker
(WorkerHeartbeat.versions, docs/design.md "The model registry"). Pure: heartbeats and `now_ms`
come in as arguments.
"""

from __future__ import annotations

from schemas.messages import VersionStatus, WorkerHeartbeat

# The states a worker still answers a version's requests in: ready, and draining (the batcher sends
# requests pinned just before a promotion to a draining version; docs/design.md, "The model registry").
SERVING_STATES = frozenset({"ready", "draining"})


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

    def serving(self, sid: str, now_ms: int) -> list[WorkerHeartbeat]:
        """Live heartbeats of the workers that answer version `sid` (name@version): ready, or
        draining it (WorkerHeartbeat.models lists the ready ones)."""
        return [hb for hb in self.live(now_ms)
                if sid in hb.models or (sid in hb.versions and hb.versions[sid].state in SERVING_STATES)]  # fmt: skip

    def version_states(self, now_ms: int) -> dict[str, dict[str, VersionStatus]]:
        """Per version (name@version), per live worker, the status that worker reports."""
        out: dict[str, dict[str, VersionStatus]] = {}
        for hb in self.live(now_ms):
            for sid, status in hb.versions.items():
                out.setdefault(sid, {})[hb.worker_id] = status
        return out

    def ready_versions(self, now_ms: int) -> set[str]:
        """Every version some live worker reports ready."""
        return {sid for sid, by_worker in self.version_states(now_ms).items()
                if any(status.state == "ready" for status in by_worker.values())}  # fmt: skip

    def __len__(self) -> int:
        return len(self._latest)
