"""The batcher's traffic policy logic, unit by unit (services/batcher/mirroring.py, planner
shedding): assignment of outside producers' bare names, mirror copies, forged traffic fields."""

from __future__ import annotations

from schemas.messages import EmbedRequest
from schemas.registry import ModelManifest, ModelRoute, ModelVersionRecord, RegistryState
from schemas.traffic import assign, assignment_key
from services.batcher.mirroring import assign_version, forged_traffic_fields, mirror_id, with_mirrors
from services.batcher.planner import Planner

from .factories import T0_MS, make_models, make_request

SHADOW = "t.replies.shadow"


def models_with(route: ModelRoute | None, *versions: str, retired: tuple[str, ...] = ()) -> RegistryState:
    """Seeded a@1 plus registered versions of `a`, and the route."""
    models = make_models(a=(4, 10))
    for v in versions:
        manifest = ModelManifest(name="a", version=v, format="echo", location="", serving={"engine": "echo"})
        record = ModelVersionRecord(
            manifest=manifest, registered_by="t", desired="retired" if v in retired else "loaded"
        )
        models.apply(record.key, record)
    if route is not None:
        models.apply(route.key, route)
    return models


def test_bare_names_are_assigned_sticky_by_user_then_principal_then_request() -> None:
    models = models_with(ModelRoute(name="a", default_version="1", canary={"2": 50}), "2")
    seen = {}
    for i in range(200):
        req = make_request("a", request_id=f"r{i}").model_copy(update={"user": f"u{i % 20}"})
        out = assign_version(req, models)
        expected, how = assign("a", "1", {"2": 50}, assignment_key(f"u{i % 20}", "anonymous", f"r{i}"))
        assert (out.model, out.assignment) == (f"a@{expected}", how)
        seen.setdefault(req.user, set()).add(out.model)
    assert all(len(v) == 1 for v in seen.values())  # one user, one version
    assert {m for v in seen.values() for m in v} == {"a@1", "a@2"}  # both versions serve someone
    no_user = make_request("a", request_id="x").model_copy(update={"principal": "svc"})
    assert assign_version(no_user, models).model == "a@" + assign("a", "1", {"2": 50}, "principal:svc")[0]


def test_pinned_and_gateway_assigned_requests_are_not_reassigned() -> None:
    models = models_with(ModelRoute(name="a", default_version="1", canary={"2": 100}), "2")
    pinned = assign_version(make_request("a@1"), models)
    assert (pinned.model, pinned.assignment) == ("a@1", "pinned")
    gateway = make_request("a@1").model_copy(update={"assignment": "default"})
    assert assign_version(gateway, models) == gateway
    assert assign_version(make_request("nope"), models).assignment is None  # left for the planner to reject


def test_a_canary_that_does_not_resolve_falls_back_to_the_default() -> None:
    models = models_with(ModelRoute(name="a", default_version="1", canary={"2": 100}), "2", retired=("2",))
    out = assign_version(make_request("a"), models)
    assert (out.model, out.assignment) == ("a@1", "default")


def test_mirror_copies_are_bulk_requests_of_their_own_to_the_shadow_topic() -> None:
    models = models_with(ModelRoute(name="a", default_version="1", mirror={"3": 100}), "3")
    live = assign_version(make_request("a", request_id="L1").model_copy(update={"user": "u"}), models)
    live2, copies = with_mirrors(live, models, SHADOW)
    assert live2.mirrors == ["3"] and live2.request_id == "L1" and live2.reply_to == live.reply_to
    [copy] = copies
    assert copy.request_id == mirror_id("L1", "3") == "L1.mirror.3"
    assert (copy.shadow_of, copy.model, copy.priority, copy.assignment, copy.reply_to) == (
        "L1",
        "a@3",
        "bulk",
        "mirror",
        SHADOW,
    )
    assert copy.mirrors == [] and copy.prompt == live.prompt and copy.user == "u"
    assert with_mirrors(copy, models, SHADOW) == (copy, [])  # a copy is never mirrored again


def test_mirror_share_unresolvable_and_self_mirrors() -> None:
    models = models_with(ModelRoute(name="a", default_version="1", mirror={"3": 30}), "3")
    n = sum(bool(with_mirrors(make_request("a@1", request_id=f"r{i}"), models, SHADOW)[1]) for i in range(2000))
    assert 500 <= n <= 700  # about 30% of requests, decided per request id
    unregistered = models_with(ModelRoute(name="a", default_version="1", mirror={"9": 100}))
    req = make_request("a@1")
    assert with_mirrors(req, unregistered, SHADOW) == (req, [])  # no copy, none listed
    self_pinned = make_request("a@3")
    assert with_mirrors(
        self_pinned, models_with(ModelRoute(name="a", default_version="1", mirror={"3": 100}), "3"), SHADOW
    ) == (self_pinned, [])
    long_id = make_request("a@1", request_id="x" * 125)
    assert with_mirrors(
        long_id, models_with(ModelRoute(name="a", default_version="1", mirror={"3": 100}), "3"), SHADOW
    ) == (long_id, [])
    embed = EmbedRequest(request_id="e", model="a@1", inputs=["x"], deadline_ms=T0_MS + 1000, reply_to="t.replies.x")
    assert with_mirrors(embed, models, SHADOW) == (embed, [])


def test_traffic_fields_only_the_batcher_sets_are_refused_on_intake() -> None:
    def why(model: str = "a@2", from_producer: bool = False, **fields: object) -> str | None:
        return forged_traffic_fields(make_request(model).model_copy(update=fields), SHADOW, from_producer)

    assert why() is None and why(assignment="canary") is None and why(assignment="pinned") is None  # the gateway's
    assert why("a") is None  # a bare name: assigned by the batcher
    # an assignment Weir did not make: on a bare name (it would be counted for the default that serves
    # it), or from an outside producer (who never assigns), whatever it claims
    assert "bare name" in (why("a", assignment="canary") or "") and why("a", assignment="default") is not None
    assert why(from_producer=True) is None and "set by Weir" in (why(from_producer=True, assignment="canary") or "")
    assert "shadow_of" in (why(shadow_of="x") or "")
    assert why(assignment="mirror") is not None
    assert "mirrors" in (why(mirrors=["2"]) or "")
    assert "reply topic" in (why(reply_to=SHADOW) or "")


class _NoRoom:
    def place(self, model, head, cost_tokens, now_ms):
        return None

    def record(self, model, slot, num_tokens, now_ms):
        return None


def test_the_planner_reports_interactive_requests_waiting_for_room_and_drops_on_demand() -> None:
    planner = Planner(make_models(a=(4, 10)))
    bulk = make_request("a", priority="bulk")
    planner.add(bulk, T0_MS)
    planner.poll(T0_MS + 20, _NoRoom())
    assert not planner.is_live_blocked()  # only bulk waits
    planner.add(make_request("a"), T0_MS)
    planner.poll(T0_MS + 20, _NoRoom())
    assert planner.is_live_blocked()
    assert planner.drop(bulk.request_id) is not None and not planner.is_held(bulk.request_id)
    assert planner.drop(bulk.request_id) is None
    assert planner.add(bulk, T0_MS) == "duplicate"  # a dropped request counts as finished
