"""Fleet: the latest heartbeat of every worker, and which of them are live, per model.

Readiness asks it whether any worker is live; admission control will ask it how much room a
model has. Pure: heartbeats and `now_ms` come in as arguments.
"""

from __future__ import annotations

from schemas.messages import WorkerHeartbeat


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

    def __len__(self) -> int:
        return len(self._latest)
