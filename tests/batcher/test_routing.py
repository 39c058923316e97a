"""Unit tests of routing from heartbeats: liveness, room, prefix affinity, fallbacks. Explicit time."""

from __future__ import annotations

from schemas.messages import ChatMessage, GenerateRequest
from services.batcher.planner import UNBOUNDED
from services.batcher.routing import Router, prefix_key

from .factories import T0_MS, make_heartbeat, make_tenant_request

TIMEOUT_MS = 3_000


def router_with(*heartbeats) -> Router:
    router = Router(worker_timeout_ms=TIMEOUT_MS, prefix_chars=32)
    for hb in heartbeats:
        router.on_heartbeat(hb)
    return router


def chat(system: str, user: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"c-{user}",
        model="a",
        messages=[ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)],
        deadline_ms=T0_MS + 60_000,
        reply_to="t",
    )


def test_prefix_key_is_the_system_message_or_the_first_chars() -> None:
    assert prefix_key(chat("You are terse.", "hello"), 8) == "You are "
    assert prefix_key(make_tenant_request("t", prompt="abcdefghij"), 4) == "abcd"


def test_only_ready_fresh_workers_owning_partitions_of_the_model_are_live() -> None:
    router = router_with(
        make_heartbeat("fresh", {"a@1": [0]}),
        make_heartbeat("stale", {"a@1": [1]}, sent_ms=T0_MS - TIMEOUT_MS - 1),
        make_heartbeat("warming", {"a@1": [2]}, states={"a@1": "golden"}),
        make_heartbeat("unassigned", {"a@1": []}),
        make_heartbeat("other", {"b@1": [0]}),
    )
    assert router.live_workers("a@1", T0_MS) == ["fresh"]
    assert router.live_workers("a@1", T0_MS + TIMEOUT_MS + 1) == []  # its heartbeats stopped


def test_a_model_no_heartbeat_names_is_routed_keyed_but_one_with_only_dead_workers_waits() -> None:
    old = make_heartbeat("old", {"a": [0]}, sent_ms=T0_MS).model_copy(update={"versions": {}})  # before the registry
    head = make_tenant_request("t", model="z@1")
    assert router_with().place("z@1", head, 20, T0_MS) == UNBOUNDED  # no worker yet
    assert router_with(old).place("z@1", head, 20, T0_MS) == UNBOUNDED
    # Workers that report versions announce what they serve: a version none reports is held.
    router = router_with(old, make_heartbeat("w1", {"a@1": [0]}, sent_ms=T0_MS))
    assert router.place("z@1", head, 20, T0_MS) is None
    assert router.place("a@1", make_tenant_request("t"), 20, T0_MS + 10 * TIMEOUT_MS) is None


def test_room_is_advertised_blocks_less_what_was_planned_since_the_heartbeat() -> None:
    router = router_with(make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=10, sent_ms=T0_MS))  # 160 tokens
    head = make_tenant_request("t")
    slot = router.place("a@1", head, 20, T0_MS + 5)
    assert slot is not None and (slot.worker_id, slot.partition, slot.room_tokens) == ("w1", 0, 160)
    router.record("a@1", slot, 150, T0_MS + 5)
    assert router.room_tokens("w1") == 10
    assert router.place("a@1", head, 20, T0_MS + 6) is None  # no room: the batch waits
    router.on_heartbeat(make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=2, sent_ms=T0_MS + 4))
    assert router.room_tokens("w1") == 32 - 150  # sent before that batch was planned: still counted
    router.on_heartbeat(make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=3, sent_ms=T0_MS + 5 - 10))
    assert router.room_tokens("w1") == 32 - 150  # an older heartbeat is ignored
    router.on_heartbeat(make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=4, sent_ms=T0_MS + 7))
    assert router.room_tokens("w1") == 64  # this one already reflects the batch


def test_with_read_offsets_a_batch_counts_until_the_worker_has_read_it() -> None:
    def beat(sent_ms: int, next_offset: int, partitions: tuple[int, ...] = (0, 1)):
        offsets = {"a@1": dict.fromkeys(partitions, next_offset)}
        return make_heartbeat("w1", {"a@1": list(partitions)}, free_kv_blocks=10, sent_ms=sent_ms, next_offsets=offsets)

    router = router_with(beat(T0_MS, 7))
    slot = router.place("a@1", make_tenant_request("t"), 20, T0_MS)
    assert slot is not None and slot.partition is not None
    reservation = router.record("a@1", slot, 100, T0_MS)
    assert reservation is not None
    router.on_heartbeat(beat(T0_MS + 50, 7))
    assert router.room_tokens("w1") == 60  # not acknowledged by Kafka yet: still counted
    reservation.offset = 7  # the produce was acknowledged at offset 7
    router.on_heartbeat(beat(T0_MS + 100, 7))
    assert router.room_tokens("w1") == 60  # newer heartbeat, but the worker has not read offset 7
    router.on_heartbeat(beat(T0_MS + 150, 8))
    assert router.room_tokens("w1") == 160  # read: the heartbeat's free blocks count it now
    second = router.record("a@1", slot, 100, T0_MS + 160)
    assert second is not None
    second.offset = 8
    others = tuple(p for p in (0, 1) if p != slot.partition)
    router.on_heartbeat(beat(T0_MS + 200, 8, others))
    assert router.room_tokens("w1") == 160  # its partition moved to another worker: not w1's any more


def test_shared_prefixes_stick_to_one_worker_and_spread_across_workers() -> None:
    router = router_with(*(make_heartbeat(f"w{i}", {"a@1": [i, 10 + i]}, sent_ms=T0_MS) for i in range(4)))
    system = "You are a helpful assistant that answers in French."
    places = {router.place("a@1", chat(system, f"q{i}"), 20, T0_MS).worker_id for i in range(20)}
    assert len(places) == 1
    spread = {router.place("a@1", chat(f"system {i}", "q"), 20, T0_MS).worker_id for i in range(40)}
    assert len(spread) == 4


def test_a_leaving_worker_moves_only_its_own_prefixes() -> None:
    beats = [make_heartbeat(f"w{i}", {"a@1": [i]}, sent_ms=T0_MS) for i in range(4)]
    heads = [chat(f"system {i}", "q") for i in range(60)]
    before = {h.request_id: router_with(*beats).place("a@1", h, 20, T0_MS).worker_id for h in heads}
    after = {h.request_id: router_with(*beats[1:]).place("a@1", h, 20, T0_MS).worker_id for h in heads}
    moved = {rid for rid in before if before[rid] != after[rid]}
    assert moved == {rid for rid, wid in before.items() if wid == "w0"}


def test_a_full_preferred_worker_gives_way_to_the_one_with_most_room() -> None:
    router = router_with(*(make_heartbeat(f"w{i}", {"a@1": [i]}, free_kv_blocks=10 * (i + 1)) for i in range(3)))
    head = chat("shared prefix", "q")
    preferred = router.place("a@1", head, 20, T0_MS)
    assert preferred is not None and preferred.worker_id is not None
    router.record("a@1", preferred, router.room_tokens(preferred.worker_id) - 10, T0_MS)
    fallback = router.place("a@1", head, 20, T0_MS)
    assert fallback is not None and fallback.worker_id != preferred.worker_id
    rooms = {wid: router.room_tokens(wid) for wid in router.live_workers("a@1", T0_MS)}
    assert fallback.worker_id == max(rooms, key=rooms.__getitem__)


def test_a_head_larger_than_any_room_goes_alone_to_an_idle_worker() -> None:
    router = router_with(
        make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=2), make_heartbeat("w2", {"a@1": [1]}, free_kv_blocks=3)
    )
    slot = router.place("a@1", make_tenant_request("t"), 500, T0_MS)  # more than either advertises
    assert slot is not None and slot.room_tokens == 500  # room for the head only
    router.record("a@1", slot, 500, T0_MS)
    other = router.place("a@1", make_tenant_request("t"), 500, T0_MS)
    assert other is not None and other.worker_id != slot.worker_id
    router.record("a@1", other, 500, T0_MS)
    assert router.place("a@1", make_tenant_request("t"), 500, T0_MS) is None  # neither is idle now


def test_a_worker_is_routable_for_a_version_only_when_its_heartbeat_says_ready() -> None:
    old = make_heartbeat("old", {"a@1": [0]}).model_copy(update={"versions": {}})  # a worker from before the registry
    router = router_with(
        old,
        make_heartbeat("v2", {"a@2": [0]}, states={"a@2": "ready"}),
        make_heartbeat("loading", {"a@1": [1]}, states={"a@1": "loading"}),
    )
    assert router.live_workers("a@1", T0_MS) == [] and router.place("a@1", make_tenant_request("t"), 20, T0_MS) is None
    assert router.live_workers("a@2", T0_MS) == ["v2"]


def test_a_draining_worker_takes_a_version_only_when_none_has_it_ready() -> None:
    draining = make_heartbeat("d", {"a@1": [3]}, states={"a@1": "draining"})
    router = router_with(draining)
    slot = router.place("a@1", make_tenant_request("t"), 20, T0_MS)
    assert slot is not None and (slot.worker_id, slot.partition) == ("d", 3)
    router.on_heartbeat(make_heartbeat("r", {"a@1": [5]}))
    assert {router.place("a@1", make_tenant_request("t", prompt=f"p{i}"), 20, T0_MS).worker_id for i in range(10)} == {
        "r"
    }


def test_a_version_failed_or_refused_on_every_live_worker_that_reports_it_has_a_problem() -> None:
    failed = make_heartbeat(
        "w1", {"a@2": []}, states={"a@2": "failed"}, reasons={"a@2": "weights.bin: sha256 mismatch"}
    )
    refused = make_heartbeat("w2", {"a@2": []}, states={"a@2": "refused"}, reasons={"a@2": "needs 9 GiB, budget 4 GiB"})
    router = router_with(failed, refused, make_heartbeat("w3", {"a@1": [0]}))
    problem = router.version_problem("a@2", T0_MS)
    assert problem is not None and "'a@2'" in problem
    assert "failed on w1: weights.bin: sha256 mismatch" in problem and "refused on w2: needs 9 GiB" in problem
    assert router.version_problem("a@1", T0_MS) is None and router.version_problem("a@3", T0_MS) is None  # nobody says
    router.on_heartbeat(make_heartbeat("w4", {"a@2": []}, states={"a@2": "verifying"}))
    assert router.version_problem("a@2", T0_MS) is None  # it may yet load on w4
    # w4's heartbeats stop: only live workers count.
    assert router.version_problem("a@2", T0_MS + TIMEOUT_MS + 1) is None  # all stale: nobody live says anything
    router.on_heartbeat(failed.model_copy(update={"sent_ms": T0_MS + TIMEOUT_MS}))
    assert "failed on w1" in (router.version_problem("a@2", T0_MS + TIMEOUT_MS + 1) or "")
