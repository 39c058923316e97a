"""Unit tests of who goes next: priority lanes, EDF, fair queuing per tenant, token budgets.

Pure planner and router, explicit time, no broker.
"""

from __future__ import annotations

import pytest

from schemas.messages import ChatMessage, EmbedRequest, GenerateRequest
from schemas.model_repo import ModelRepoError, load_model_repo
from services.batcher.planner import SLOT_COST_TOKENS, PlannedBatch, Planner, Slot, cost_tokens
from services.batcher.routing import Router

from .factories import T0_MS, make_config, make_heartbeat, make_models, make_request, make_tenant_request


def tenants(batch: PlannedBatch) -> list[str]:
    return [r.tenant for r in batch.requests]


class FixedRoom:
    """A placement with one worker of a fixed room that only heartbeats (refill) restore."""

    def __init__(self, room_tokens: int | None) -> None:
        self.room_tokens = room_tokens
        self.recorded: list[int] = []

    def place(self, model, head, cost_tokens, now_ms) -> Slot | None:
        if self.room_tokens is not None and self.room_tokens < cost_tokens:
            return None
        return Slot("w1", 0, self.room_tokens)

    def record(self, model, slot, num_tokens, now_ms) -> None:
        self.recorded.append(num_tokens)
        if self.room_tokens is not None:
            self.room_tokens -= num_tokens


# --- cost ------------------------------------------------------------------------------------


def test_cost_is_prompt_estimate_plus_max_tokens_capped_at_max_model_len() -> None:
    torch = make_config(max_model_len=512)
    assert cost_tokens(make_tenant_request("t", prompt="x" * 41, max_tokens=10), torch) == 11 + 10
    chat = GenerateRequest(
        request_id="c",
        model="a",
        messages=[ChatMessage(role="system", content="s" * 8), ChatMessage(role="user", content="hi")],
        max_tokens=5,
        deadline_ms=T0_MS + 1,
        reply_to="t",
    )
    assert cost_tokens(chat, torch) == (2 + 4) + (1 + 4) + 5
    assert cost_tokens(make_tenant_request("t", prompt="x" * 10_000, max_tokens=100), torch) == 512
    embed = EmbedRequest(request_id="e", model="a", inputs=["x" * 4000], deadline_ms=T0_MS + 1, reply_to="t")
    assert cost_tokens(embed, make_config(engine="onnx", source="pkg")) == SLOT_COST_TOKENS
    assert cost_tokens(make_request("a"), make_config(engine="echo")) == SLOT_COST_TOKENS


# --- lanes -----------------------------------------------------------------------------------


def test_strict_lanes_serve_interactive_first_then_earliest_deadline() -> None:
    planner = Planner(make_models(make_config(max_batch_size=4, max_wait_ms=0)))
    bulk = [make_tenant_request("t", priority="bulk", deadline_ms=T0_MS + 10) for _ in range(4)]
    late = make_tenant_request("t", deadline_ms=T0_MS + 9_000)
    early = make_tenant_request("t", deadline_ms=T0_MS + 1_000)
    for req in [*bulk, late, early]:
        planner.add(req, T0_MS)
    batches = planner.poll(T0_MS).batches
    assert [r.request_id for r in batches[0].requests] == [early.request_id, late.request_id] + [
        r.request_id for r in bulk[:2]
    ]


def test_weighted_lanes_give_bulk_its_share_of_tokens() -> None:
    config = make_config(max_batch_size=10, max_wait_ms=0, lane_policy="weighted", bulk_weight=0.25)
    planner = Planner(make_models(config))
    for _ in range(40):
        planner.add(make_tenant_request("t"), T0_MS)
        planner.add(make_tenant_request("t", priority="bulk"), T0_MS)
    first = planner.poll(T0_MS).batches[:4]  # 40 requests, all of the same cost
    order = [r.priority for b in first for r in b.requests]
    assert order.count("bulk") == 8  # 1 : 4 of the tokens while both lanes wait
    assert order[:5].count("bulk") == 1  # interleaved, not bunched at the end


def test_strict_bulk_waits_while_interactive_holds_anything() -> None:
    planner = Planner(make_models(make_config(max_batch_size=5, max_wait_ms=0)))
    for _ in range(10):
        planner.add(make_tenant_request("t", priority="bulk"), T0_MS)
        planner.add(make_tenant_request("t"), T0_MS)
    order = [r.priority for b in planner.poll(T0_MS).batches for r in b.requests]
    assert order == ["interactive"] * 10 + ["bulk"] * 10


def _flood_then_interactive(lane_policy: str) -> tuple[list[str], GenerateRequest]:
    """20 bulk requests at T0, one interactive at T0+5, a worker with room for 4 requests per
    refill: returns the order requests leave in over five refills, and the interactive one."""
    planner = Planner(make_models(make_config(max_batch_size=4, max_wait_ms=10, lane_policy=lane_policy)))
    placement = FixedRoom(80)  # four requests of 20 tokens
    for _ in range(20):
        planner.add(make_tenant_request("jobs", priority="bulk"), T0_MS)
    order = [r.request_id for b in planner.poll(T0_MS, placement).batches for r in b.requests]
    interactive = make_tenant_request("user", deadline_ms=T0_MS + 1_000)
    planner.add(interactive, T0_MS + 5)
    for refill_ms in (T0_MS + 100, T0_MS + 200, T0_MS + 300, T0_MS + 400, T0_MS + 500):
        placement.room_tokens = 80  # a heartbeat: the worker finished what it had
        order += [r.request_id for b in planner.poll(refill_ms, placement).batches for r in b.requests]
    return order, interactive


def test_fifo_serves_a_bulk_flood_before_a_later_interactive_request() -> None:
    order, interactive = _flood_then_interactive("fifo")
    assert len(order) == 21
    assert order.index(interactive.request_id) == 20  # behind all 20 bulk, 5 refills later


def test_strict_serves_a_later_interactive_request_at_the_next_room() -> None:
    order, interactive = _flood_then_interactive("strict")
    assert len(order) == 21
    assert order.index(interactive.request_id) == 4  # first of the first refill after it came


def test_fifo_ignores_priority_tenant_and_deadline_but_still_expires() -> None:
    planner = Planner(make_models(make_config(max_batch_size=3, max_wait_ms=0, lane_policy="fifo")))
    bulk = make_tenant_request("A", priority="bulk", deadline_ms=T0_MS + 9_000)
    flood = [make_tenant_request("A", deadline_ms=T0_MS + 8_000) for _ in range(3)]
    urgent = make_tenant_request("B", deadline_ms=T0_MS + 1_000)
    short = make_tenant_request("C", deadline_ms=T0_MS + 8)
    for i, req in enumerate([bulk, *flood, urgent, short]):
        planner.add(req, T0_MS + i)
    result = planner.poll(T0_MS + 10)
    assert result.expired == [short]
    assert [r.request_id for b in result.batches for r in b.requests] == [
        r.request_id for r in [bulk, *flood, urgent]
    ]  # arrival order, batches published in that order too


def test_lane_policy_fifo_is_read_from_the_model_repository_and_others_refused(tmp_path) -> None:
    repo = tmp_path / "models.toml"
    repo.write_text('[models.a]\nengine = "echo"\nlane_policy = "fifo"\n')
    assert load_model_repo(repo).models["a"].lane_policy == "fifo"
    repo.write_text('[models.a]\nengine = "echo"\nlane_policy = "arrival"\n')
    with pytest.raises(ModelRepoError, match="lane_policy"):
        load_model_repo(repo)


def test_fifo_cancel_and_release_leave_the_rest_in_order() -> None:
    planner = Planner(make_models(make_config(max_batch_size=10, max_wait_ms=0, lane_policy="fifo")))
    reqs = [make_tenant_request("t") for _ in range(4)]
    for req in reqs:
        planner.add(req, T0_MS)
    assert planner.cancel(reqs[1].request_id) == reqs[1]
    assert planner.release(reqs[2].request_id) == reqs[2]
    [batch] = planner.poll(T0_MS).batches
    assert batch.requests == [reqs[0], reqs[3]] and planner.num_held == 0


# --- fairness ----------------------------------------------------------------------------------


def test_a_flood_from_one_tenant_does_not_starve_another() -> None:
    planner = Planner(make_models(make_config(max_batch_size=8, max_wait_ms=0)))
    flood = [make_tenant_request("A") for _ in range(200)]
    for req in flood:
        planner.add(req, T0_MS)
    few = [make_tenant_request("B") for _ in range(5)]
    for req in few:
        planner.add(req, T0_MS + 1)  # they even arrive after the flood
    batches = planner.poll(T0_MS + 1).batches
    assert len(batches) == 26
    assert tenants(batches[0]).count("B") == 4 and tenants(batches[1]).count("B") == 1
    assert sum(len(b.requests) for b in batches) == 205


def test_tenant_weights_share_tokens_by_weight() -> None:
    config = make_config(max_batch_size=12, max_wait_ms=0, tenant_weights={"gold": 3.0})
    planner = Planner(make_models(config))
    for _ in range(30):
        planner.add(make_tenant_request("gold"), T0_MS)
        planner.add(make_tenant_request("free"), T0_MS)
    first = planner.poll(T0_MS).batches[0]
    assert tenants(first).count("gold") == 9 and tenants(first).count("free") == 3


def test_fairness_counts_tokens_not_requests() -> None:
    planner = Planner(make_models(make_config(max_batch_size=10, max_wait_ms=0)))
    for _ in range(10):  # each costs 100 tokens
        planner.add(make_tenant_request("big", prompt="x" * 360, max_tokens=10), T0_MS)
        planner.add(make_tenant_request("small", prompt="x" * 40, max_tokens=10), T0_MS)  # 20 tokens
    first = planner.poll(T0_MS).batches[0]
    assert tenants(first).count("small") >= 7


def test_an_idle_tenant_banks_no_credit() -> None:
    planner = Planner(make_models(make_config(max_batch_size=4, max_wait_ms=0)))
    for _ in range(40):
        planner.add(make_tenant_request("A"), T0_MS)
    assert len(planner.poll(T0_MS).batches) == 10  # A alone: served for a while, nobody else waits
    for _ in range(8):
        planner.add(make_tenant_request("A"), T0_MS + 1)
    for _ in range(8):
        planner.add(make_tenant_request("B"), T0_MS + 1)
    later = planner.poll(T0_MS + 1).batches
    # B, newly arrived, alternates with A rather than taking the next eight slots in a row.
    assert tenants(later[0]) in (["A", "B", "A", "B"], ["B", "A", "B", "A"])


def test_earliest_deadline_first_within_a_tenant() -> None:
    planner = Planner(make_models(make_config(max_batch_size=3, max_wait_ms=0)))
    deadlines = [T0_MS + d for d in (5_000, 1_000, 3_000)]
    reqs = [make_tenant_request("t", deadline_ms=d) for d in deadlines]
    for req in reqs:
        planner.add(req, T0_MS)
    [batch] = planner.poll(T0_MS).batches
    assert [r.deadline_ms for r in batch.requests] == sorted(deadlines)


# --- token budget ------------------------------------------------------------------------------


def test_a_batch_closes_when_its_tokens_reach_the_workers_room() -> None:
    planner = Planner(make_models(make_config(max_batch_size=100, max_wait_ms=60_000)))
    placement = FixedRoom(100)  # five requests of 20 tokens
    for _ in range(4):
        planner.add(make_tenant_request("t"), T0_MS)
    assert planner.poll(T0_MS, placement).batches == []  # 80 tokens < 100: wait for more
    for _ in range(3):
        planner.add(make_tenant_request("t"), T0_MS)
    [batch] = planner.poll(T0_MS, placement).batches
    assert len(batch.requests) == 5 and batch.num_tokens == 100 and batch.slot.worker_id == "w1"
    assert placement.recorded == [100] and planner.num_held == 2


def test_no_room_holds_requests_until_room_comes_and_deadlines_still_expire() -> None:
    planner = Planner(make_models(make_config(max_batch_size=4, max_wait_ms=0)))
    placement = FixedRoom(10)  # less than one request
    short = make_tenant_request("t", deadline_ms=T0_MS + 50)
    long = make_tenant_request("t", deadline_ms=T0_MS + 60_000)
    planner.add(short, T0_MS)
    planner.add(long, T0_MS)
    assert planner.poll(T0_MS, placement).batches == []
    assert planner.blocked_models() == ["a@1"]
    assert planner.next_wakeup_ms(T0_MS) == T0_MS + 50  # not "now": nothing to do until room or a deadline
    result = planner.poll(T0_MS + 50, placement)
    assert result.expired == [short] and result.batches == []
    placement.room_tokens = 1000  # a heartbeat brought room
    [batch] = planner.poll(T0_MS + 60, placement).batches
    assert batch.requests == [long] and planner.blocked_models() == []


def test_batches_never_exceed_the_room_of_their_worker() -> None:
    router = Router(worker_timeout_ms=3_000)
    router.on_heartbeat(make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=5, sent_ms=T0_MS))  # 80 tokens
    router.on_heartbeat(make_heartbeat("w2", {"a@1": [1]}, free_kv_blocks=10, sent_ms=T0_MS))  # 160 tokens
    planner = Planner(make_models(make_config(max_batch_size=100, max_wait_ms=0)))
    for i in range(30):
        planner.add(make_tenant_request("t", prompt=f"{i:02d}" * 20), T0_MS)  # 20 tokens each
    batches = planner.poll(T0_MS + 10, router).batches
    sent: dict[str, int] = {}
    for batch in batches:
        assert batch.slot.worker_id is not None
        sent[batch.slot.worker_id] = sent.get(batch.slot.worker_id, 0) + batch.num_tokens
    assert sent == {"w1": 80, "w2": 160}  # full, never over
    assert planner.num_held == 30 - 12 and planner.blocked_models() == ["a@1"]
    # A newer heartbeat carries the worker's state again: room for another 4 requests.
    router.on_heartbeat(make_heartbeat("w1", {"a@1": [0]}, free_kv_blocks=5, sent_ms=T0_MS + 20))
    more = planner.poll(T0_MS + 20, router).batches
    assert [(b.slot.worker_id, len(b.requests)) for b in more] == [("w1", 4)]
