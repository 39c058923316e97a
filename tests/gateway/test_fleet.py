"""Fleet: which workers are live, per model."""

from __future__ import annotations

from schemas.messages import WorkerHeartbeat
from services.gateway.fleet import Fleet


def heartbeat(worker_id: str, sent_ms: int, models: list[str], is_ready: bool = True) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id, models=models, is_ready=is_ready, num_running=0, num_waiting=0,
        max_num_seqs=8, free_kv_blocks=100, block_size_tokens=16, sent_ms=sent_ms,
    )


def test_live_means_ready_and_recent() -> None:
    fleet = Fleet(live_ms=10_000)
    fleet.observe(heartbeat("w1", 100_000, ["echo"]))
    fleet.observe(heartbeat("w2", 100_000, ["echo"], is_ready=False))
    fleet.observe(heartbeat("w3", 80_000, ["echo"]))
    assert [hb.worker_id for hb in fleet.live(105_000)] == ["w1"]
    assert fleet.live(111_000) == []


def test_newest_heartbeat_wins_and_tombstone_forgets() -> None:
    fleet = Fleet(live_ms=10_000)
    fleet.observe(heartbeat("w1", 100_000, ["echo"]))
    fleet.observe(heartbeat("w1", 90_000, ["echo"], is_ready=False))  # older, arrives late
    assert len(fleet.live(100_000)) == 1
    fleet.forget("w1")
    assert fleet.live(100_000) == [] and len(fleet) == 0


def test_live_by_model_groups_workers() -> None:
    fleet = Fleet()
    fleet.observe(heartbeat("w1", 100_000, ["echo", "tiny"]))
    fleet.observe(heartbeat("w2", 100_000, ["tiny"]))
    by_model = fleet.live_by_model(100_500)
    assert sorted(hb.worker_id for hb in by_model["tiny"]) == ["w1", "w2"]
    assert [hb.worker_id for hb in by_model["echo"]] == ["w1"]
