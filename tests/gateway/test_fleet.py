"""Fleet: which workers are live, per model."""

from __future__ import annotations

import pytest

from schemas.messages import VersionStatus, WorkerHeartbeat
from services.gateway.fleet import TAKE_UP_MS, Availability, Fleet


def heartbeat(worker_id: str, sent_ms: int, models: list[str], is_ready: bool = True) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        models=models,
        is_ready=is_ready,
        num_running=0,
        num_waiting=0,
        max_num_seqs=8,
        free_kv_blocks=100,
        block_size_tokens=16,
        sent_ms=sent_ms,
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


def versioned(worker_id: str, versions: dict[str, VersionStatus], sent_ms: int = 100_000) -> WorkerHeartbeat:
    ready = [served_id for served_id, status in versions.items() if status.state == "ready"]
    return heartbeat(worker_id, sent_ms, ready).model_copy(update={"versions": versions})


@pytest.mark.parametrize("state", ["verifying", "loading", "golden", "unhealthy"])
def test_a_version_a_live_worker_brings_up_is_coming(state: str) -> None:
    fleet = Fleet()
    fleet.observe(versioned("w1", {"echo@1": VersionStatus(state=state)}))
    fleet.observe(versioned("w2", {"echo@1": VersionStatus(state="failed", reason="bad file")}))
    offer = fleet.availability("echo@1", "loaded", 100_500)
    assert (offer.serving, offer.coming, offer.problem) == ([], True, None)


def test_a_wanted_version_of_a_name_a_live_worker_serves_is_coming() -> None:
    """After a rollback the old default is wanted loaded again: the worker that holds its name
    will load it, though it does not report it yet."""
    fleet = Fleet()
    fleet.observe(versioned("w1", {"echo@2": VersionStatus(state="draining")}))
    assert fleet.availability("echo@1", "loaded", 100_500).coming
    assert not fleet.availability("other@1", "loaded", 100_500).coming  # no live worker serves `other`
    assert fleet.availability("echo@1", "loaded", 200_000) == Availability()  # w1 is no longer live


def test_a_wanted_version_no_worker_takes_up_is_a_clear_refusal_not_a_wait() -> None:
    """Workers report a version within a heartbeat of its record: one wanted long ago and still
    reported by none of the workers holding its name is refused with why (a request admitted for
    it would wait for its deadline)."""
    fleet = Fleet()
    fleet.observe(versioned("w1", {"echo@1": VersionStatus(state="ready")}))
    assert fleet.availability("echo@2", "loaded", 100_500, wanted_since_ms=100_000).coming  # just registered
    late = fleet.availability("echo@2", "loaded", 100_500, wanted_since_ms=100_500 - TAKE_UP_MS - 1)
    assert not late.coming and "no live worker reports it" in (late.problem or "")


def test_a_served_version_lists_its_workers() -> None:
    fleet = Fleet()
    fleet.observe(versioned("w1", {"echo@1": VersionStatus(state="ready")}))
    fleet.observe(versioned("w2", {"echo@1": VersionStatus(state="failed", reason="bad file")}))
    offer = fleet.availability("echo@1", "unloaded", 100_500)  # served now, whatever the registry wants
    assert [hb.worker_id for hb in offer.serving] == ["w1"] and offer.problem is None


def test_a_version_failed_or_refused_everywhere_names_each_workers_reason() -> None:
    fleet = Fleet()
    fleet.observe(versioned("w1", {"echo@2": VersionStatus(state="failed", reason="weights.bin: sha256 differs")}))
    fleet.observe(versioned("w2", {"echo@2": VersionStatus(state="refused", reason="needs 9 GiB, 2 free")}))
    fleet.observe(versioned("w3", {"echo@1": VersionStatus(state="ready")}))  # holds the name: still failed
    offer = fleet.availability("echo@2", "loaded", 100_500)
    assert not offer.coming and offer.problem == (
        "model version 'echo@2' cannot be served: failed on w1: "
        "weights.bin: sha256 differs; refused on w2: needs 9 GiB, 2 free"
    )


def test_an_unloaded_version_no_worker_serves_says_how_to_load_it() -> None:
    fleet = Fleet()
    fleet.observe(versioned("w1", {"echo@2": VersionStatus(state="ready")}))
    problem = fleet.availability("echo@1", "unloaded", 100_500).problem
    assert problem is not None and "is unloaded" in problem and "/v2/repository/models/echo/load" in problem
    assert fleet.availability("echo@1", "retired", 100_500) == Availability()  # never wanted: not coming
