"""Unit tests of the batching planner, with explicit time and no broker."""

from __future__ import annotations

import pytest

from schemas.messages import EmbedRequest
from schemas.registry import ModelManifest, ModelVersionRecord
from services.batcher.planner import Admission, Planner
from weir.registry import promote, register

from .factories import T0_MS, make_models, make_request


def ids(batch) -> list[str]:
    return [r.request_id for r in batch.requests]


def test_batch_closes_at_max_batch_size_without_waiting() -> None:
    planner = Planner(make_models(a=(3, 1000)))
    reqs = [make_request("a") for _ in range(7)]
    for req in reqs:
        assert planner.add(req, T0_MS) is Admission.HELD
    result = planner.poll(T0_MS)
    assert [len(b.requests) for b in result.batches] == [3, 3]
    assert planner.num_held == 1
    assert planner.next_wakeup_ms(T0_MS) == T0_MS + 1000


def test_batch_closes_when_oldest_waited_max_wait_ms_per_model() -> None:
    planner = Planner(make_models(a=(10, 5), b=(10, 50)))
    planner.add(make_request("a"), T0_MS)
    planner.add(make_request("b"), T0_MS)
    planner.add(make_request("a"), T0_MS + 3)
    assert planner.next_wakeup_ms(T0_MS) == T0_MS + 5
    assert planner.poll(T0_MS + 4).batches == []
    first = planner.poll(T0_MS + 5)
    assert [(b.model, len(b.requests)) for b in first.batches] == [("a@1", 2)]
    assert planner.next_wakeup_ms(T0_MS + 5) == T0_MS + 50
    second = planner.poll(T0_MS + 50)
    assert [(b.model, len(b.requests)) for b in second.batches] == [("b@1", 1)]
    assert planner.next_wakeup_ms(T0_MS + 50) is None


def test_interactive_before_bulk_then_earliest_deadline() -> None:
    planner = Planner(make_models(a=(3, 10)))
    bulk_early = make_request("a@1", priority="bulk", deadline_ms=T0_MS + 100)
    late = make_request("a@1", deadline_ms=T0_MS + 9_000)
    early = make_request("a@1", deadline_ms=T0_MS + 1_000)
    bulk_late = make_request("a@1", priority="bulk", deadline_ms=T0_MS + 5_000)
    for req in (bulk_late, bulk_early):
        planner.add(req, T0_MS)
    assert planner.poll(T0_MS).batches == []
    # Two more fill the lane: the first three in scheduling order leave, the last waits.
    planner.add(late, T0_MS)
    planner.add(early, T0_MS)
    result = planner.poll(T0_MS)
    assert [ids(b) for b in result.batches] == [[early.request_id, late.request_id, bulk_early.request_id]]
    result = planner.poll(T0_MS + 10)
    assert [ids(b) for b in result.batches] == [[bulk_late.request_id]]


def test_due_batches_are_returned_in_priority_order_across_models() -> None:
    planner = Planner(make_models(a=(5, 0), b=(5, 0)))
    bulk = make_request("a@1", priority="bulk")
    interactive = make_request("b@1")
    planner.add(bulk, T0_MS)
    planner.add(interactive, T0_MS)
    assert [b.model for b in planner.poll(T0_MS).batches] == ["b@1", "a@1"]


def test_expired_on_arrival_is_refused_and_expired_while_held_is_dropped() -> None:
    planner = Planner(make_models(a=(10, 100)))
    assert planner.add(make_request("a@1", deadline_ms=T0_MS), T0_MS) is Admission.EXPIRED
    short = make_request("a@1", deadline_ms=T0_MS + 20)
    long = make_request("a@1", deadline_ms=T0_MS + 10_000)
    planner.add(short, T0_MS)
    planner.add(long, T0_MS)
    assert planner.next_wakeup_ms(T0_MS) == T0_MS + 20  # the deadline comes before max_wait_ms
    result = planner.poll(T0_MS + 20)
    assert result.expired == [short]
    assert result.batches == []
    result = planner.poll(T0_MS + 100)
    assert [ids(b) for b in result.batches] == [[long.request_id]]
    assert result.expired == []


def test_unknown_model_is_refused() -> None:
    planner = Planner(make_models(a=(10, 100)))
    assert planner.add(make_request("nope"), T0_MS) is Admission.UNKNOWN_MODEL
    assert planner.num_held == 0


def test_cancel_drops_a_held_request_once() -> None:
    planner = Planner(make_models(a=(10, 5)))
    keep, gone = make_request("a@1"), make_request("a@1")
    planner.add(keep, T0_MS)
    planner.add(gone, T0_MS)
    assert planner.cancel(gone.request_id) == gone
    assert planner.cancel(gone.request_id) is None
    assert [ids(b) for b in planner.poll(T0_MS + 5).batches] == [[keep.request_id]]
    assert planner.cancel(keep.request_id) is None  # already batched: the worker's to cancel
    assert planner.add(gone, T0_MS + 6) is Admission.DUPLICATE


def test_cancel_that_arrives_before_its_request_refuses_it() -> None:
    planner = Planner(make_models(a=(10, 5)))
    req = make_request("a@1")
    assert planner.cancel(req.request_id) is None
    assert planner.add(req, T0_MS) is Admission.CANCELLED
    assert planner.add(req, T0_MS) is Admission.DUPLICATE


def test_duplicates_are_ignored_while_held_and_after_batching() -> None:
    planner = Planner(make_models(a=(10, 5)))
    req = make_request("a@1")
    assert planner.add(req, T0_MS) is Admission.HELD
    assert planner.add(req, T0_MS + 1) is Admission.DUPLICATE
    assert [len(b.requests) for b in planner.poll(T0_MS + 5).batches] == [1]
    assert planner.add(req, T0_MS + 6) is Admission.DUPLICATE
    assert planner.next_wakeup_ms(T0_MS + 6) is None


def test_dedup_window_is_bounded() -> None:
    planner = Planner(make_models(a=(1, 0)), max_recent=2)
    reqs = [make_request("a@1") for _ in range(3)]
    for req in reqs:
        planner.add(req, T0_MS)
        planner.poll(T0_MS)
    assert planner.add(reqs[0], T0_MS) is Admission.HELD  # forgotten: the worker dedups
    assert planner.add(reqs[2], T0_MS) is Admission.DUPLICATE


def test_release_forgets_a_request_so_its_redelivery_is_held_again() -> None:
    planner = Planner(make_models(a=(10, 5)))
    req = make_request("a@1")
    planner.add(req, T0_MS)
    assert planner.release(req.request_id) == req
    assert planner.num_held == 0
    assert planner.add(req, T0_MS + 1) is Admission.HELD


def test_byte_budget_splits_a_batch_but_an_oversized_request_still_leaves() -> None:
    planner = Planner(make_models(a=(10, 0)), max_batch_bytes=100)
    for size in (60, 60, 500):
        planner.add(make_request("a@1"), T0_MS, size_bytes=size)
    assert sorted(len(b.requests) for b in planner.poll(T0_MS).batches) == [1, 1, 1]


def test_every_request_leaves_exactly_once() -> None:
    planner = Planner(make_models(a=(4, 3), b=(3, 7)))
    added: set[str] = set()
    left: list[str] = []
    for t in range(40):
        now = T0_MS + t
        req = make_request("ab"[t % 2], deadline_ms=now + (2 if t % 5 == 0 else 1_000))
        assert planner.add(req, now) is Admission.HELD
        added.add(req.request_id)
        if t % 7 == 0:
            assert planner.cancel(req.request_id) == req.model_copy(update={"model": f"{req.model}@1"})  # pinned
            left.append(req.request_id)
        result = planner.poll(now)
        left += [r.request_id for b in result.batches for r in b.requests]
        left += [r.request_id for r in result.expired]
        for batch in result.batches:
            assert len(batch.requests) <= {"a@1": 4, "b@1": 3}[batch.model]
    result = planner.poll(T0_MS + 10_000)
    left += [r.request_id for b in result.batches for r in b.requests] + [r.request_id for r in result.expired]
    assert sorted(left) == sorted(added)
    assert planner.num_held == 0


def test_embed_requests_are_planned_like_generate_requests() -> None:
    planner = Planner(make_models(a=(3, 1000)))
    generate = make_request("a@1")
    embed = EmbedRequest(request_id="e1", model="a", inputs=["x", "y"], deadline_ms=T0_MS + 60_000, reply_to="t")
    late = EmbedRequest(request_id="e2", model="a", inputs=["z"], deadline_ms=T0_MS + 10, reply_to="t")
    assert [planner.add(r, T0_MS) for r in (generate, embed, embed, late)] == [
        Admission.HELD,
        Admission.HELD,
        Admission.DUPLICATE,
        Admission.HELD,
    ]
    result = planner.poll(T0_MS + 10)
    assert [r.request_id for r in result.expired] == ["e2"] and result.batches == []
    assert [ids(b) for b in planner.poll(T0_MS + 1000).batches] == [[generate.request_id, "e1"]]


def test_a_request_is_pinned_on_arrival_to_the_version_its_model_resolves_to() -> None:
    models = make_models(a=(10, 0))
    planner = Planner(models)
    bare, pinned = make_request("a"), make_request("a@1")
    assert planner.add(bare, T0_MS) is Admission.HELD and planner.add(pinned, T0_MS) is Admission.HELD
    # A promotion while they wait moves new requests only (the route now names version 2).
    v2 = ModelVersionRecord(
        manifest=ModelManifest(
            name="a", version="2", format="echo", location="", serving={"engine": "echo", "max_batch_size": 1}
        )
    )
    for record in register(models, v2):
        models.apply(record.key, record)
    for record in promote(models, "a@2", by="test"):
        models.apply(record.key, record)
    later = make_request("a")
    assert planner.add(later, T0_MS) is Admission.HELD
    batches = {b.model: ids(b) for b in planner.poll(T0_MS).batches}
    assert batches == {"a@1": [bare.request_id, pinned.request_id], "a@2": [later.request_id]}
    assert all(r.model == b.model for b in planner.poll(T0_MS).batches for r in b.requests)


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("nope", "model 'nope' does not exist"),
        ("a@9", "model version 'a@9' is not registered"),
        ("a@", "is not 'name@version'"),
        ("@1", "names no model"),
        ("a@bad version!", "is not 'name@version'"),
    ],
)
def test_a_model_that_does_not_resolve_is_refused_with_the_reason(ref: str, why: str) -> None:
    planner = Planner(make_models(a=(10, 0)))
    req = make_request(ref)
    assert planner.add(req, T0_MS) is Admission.UNKNOWN_MODEL
    config, reason = planner.resolve(ref)
    assert config is None and reason is not None and why in reason
    assert planner.add(req, T0_MS) is Admission.DUPLICATE and planner.num_held == 0


def test_a_retired_version_no_longer_resolves_but_its_held_requests_stay_pinned() -> None:
    models = make_models(a=(10, 0))
    planner = Planner(models)
    v2 = ModelVersionRecord(
        manifest=ModelManifest(name="a", version="2", format="echo", location="", serving={"engine": "echo"})
    )
    for record in register(models, v2):
        models.apply(record.key, record)
    held = make_request("a@2")
    assert planner.add(held, T0_MS) is Admission.HELD
    models.apply(v2.key, v2.model_copy(update={"desired": "retired"}))
    assert planner.add(make_request("a@2"), T0_MS) is Admission.UNKNOWN_MODEL
    assert "retired" in (planner.resolve("a@2")[1] or "")
    assert [(b.model, ids(b)) for b in planner.poll(T0_MS + 5).batches] == [("a@2", [held.request_id])]
