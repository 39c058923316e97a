"""The shadow comparison's join and measures (services/auditor/comparison.py), without Kafka."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas.messages import ErrorInfo, ReplyDelta, ReplyEnd, Usage
from schemas.registry import ShadowLive
from services.auditor.comparison import Forged, ShadowJoin, compare, mirror_of
from weir.metrics import value

T0 = 1_700_000_000_000
REPO = Path(__file__).resolve().parents[2]


def live(rid: str = "r1", text: str = "a b c", tokens: list[int] | None = None, model: str = "m@1") -> ShadowLive:
    return ShadowLive(
        request_id=rid,
        model=model,
        assignment="default",
        text=text,
        token_ids=[1, 2, 3] if tokens is None else tokens,
        finish_reason="stop",
        ttft_ms=20.0,
        tokens_per_s=50.0,
    )


def deltas(rid: str, pieces: list[tuple[str, list[int]]]) -> list[ReplyDelta]:
    return [ReplyDelta(request_id=rid, seq=i, text=t, token_ids=ids) for i, (t, ids) in enumerate(pieces)]


def end(rid: str, seq: int, finish: str = "stop", model: str | None = "m@2", **kw: Any) -> ReplyEnd:
    return ReplyEnd(
        request_id=rid,
        seq=seq,
        finish_reason=finish,
        model_version=model,
        received_ms=T0,
        first_token_ms=T0 + 30,
        created_ms=T0 + 130,
        usage=Usage(completion_tokens=3),
        **kw,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_mirror_ids() -> None:
    assert mirror_of("r1.mirror.2") == ("r1", "2")
    assert mirror_of("a.b.mirror.m@v3") == ("a.b", "m@v3")
    for bad in ("r1", "r1.mirror.", ".mirror.2"):
        with pytest.raises(Forged):
            mirror_of(bad)


@pytest.mark.parametrize("live_first", [True, False])
def test_join_either_order_and_measures(live_first: bool) -> None:
    join = ShadowJoin()
    events: list[ReplyDelta | ReplyEnd] = deltas("r1.mirror.2", [("a ", [1]), ("b ", [2]), ("x", [9])])
    events.insert(2, events[1])  # a repeated seq is dropped
    events.append(end("r1.mirror.2", 3))
    pairs = join.add_live(live()) if live_first else []
    for event in events:
        pairs += join.add_reply(event)
    if not live_first:
        pairs += join.add_live(live())
    assert len(pairs) == 1 and pairs[0].mirror_model == "m@2"
    c = compare(pairs[0], lambda texts: [[1.0, 0.0], [0.6, 0.8]])
    assert (c.live, c.mirror, c.name, c.request_id) == ("m@1", "m@2", "m", "r1")
    assert c.exact_match is False and c.token_edit_distance == 1  # [1, 2, 3] against [1, 2, 9]
    assert c.similarity == pytest.approx(0.6)
    assert (c.mirror_ttft_ms, c.mirror_tokens_per_s) == (30.0, 20.0)  # 2 tokens after the first in 100 ms
    assert (c.live_ttft_ms, c.live_tokens_per_s, c.mirror_error) == (20.0, 50.0, None)
    assert join.counts["joined"] == 1 and not join.mirrors


def test_exact_match() -> None:
    join = ShadowJoin()
    join.add_live(live(text="ab", tokens=[5, 6]))
    for event in deltas("r1.mirror.m@2", [("a", [5]), ("b", [6])]):
        join.add_reply(event)
    [pair] = join.add_reply(end("r1.mirror.m@2", 2))
    c = compare(pair, None)
    assert c.exact_match and c.token_edit_distance == 0 and c.similarity is None


def test_a_regenerated_mirror_coalesced_otherwise_is_its_answer_once() -> None:
    join = ShadowJoin()
    join.add_live(live(text="a b c", tokens=[1, 2, 3]))
    rid = "r1.mirror.m@2"
    first = ReplyDelta(request_id=rid, seq=0, count=2, text="a b", texts=["a", " b"], token_ids=[1, 2])
    again = deltas(rid, [("a", [1]), (" b", [2]), (" c", [3])])  # the rerun, one position a delta
    rest = ReplyDelta(request_id=rid, seq=1, count=2, text=" b c", texts=[" b", " c"], token_ids=[2, 3])
    for event in [first, again[0], again[1], rest]:  # what the topic holds of three runs, in order
        join.add_reply(event)
    [pair] = join.add_reply(end(rid, 3))
    c = compare(pair, None)
    assert (c.exact_match, c.mirror_error, pair.mirror.token_ids) == (True, None, [1, 2, 3])


def test_unfinished_mirror_is_an_error() -> None:
    join = ShadowJoin()
    join.add_live(live())
    [pair] = join.add_reply(end("r1.mirror.2", 0, finish="error", error=ErrorInfo(code="oom", message="no memory")))
    c = compare(pair, lambda texts: pytest.fail("no similarity of an unfinished copy"))
    assert c.mirror_error == "error (oom: no memory)" and not c.exact_match and c.token_edit_distance == 3
    join.add_live(live("r2"))
    join.add_reply(deltas("r2.mirror.2", [("a", [1]), ("b", [2])])[1])  # seq 0 never came
    [pair] = join.add_reply(end("r2.mirror.2", 2))
    assert compare(pair, None).mirror_error == "1 of 2 positions missing"


def test_one_live_answer_meets_every_mirror() -> None:
    join = ShadowJoin()
    join.add_reply(end("r1.mirror.2", 0))
    join.add_reply(end("r1.mirror.3", 0, model="m@3"))
    pairs = join.add_live(live())
    assert sorted(p.mirror_model for p in pairs) == ["m@2", "m@3"]
    assert join.add_live(live()) == []  # a redelivery


@pytest.mark.parametrize(
    ("live_model", "rid", "served", "why"),
    [
        ("m@1", "r1.mirror.other@2", "other@2", "no other version"),
        ("m@1", "r1.mirror.1", "m@1", "no other version"),
        ("m@1", "r1.mirror.2", "m@7", "served by 'm@7'"),
        ("m", "r1.mirror.2", "m@2", "no name@version"),
    ],
)
def test_forged_pairs(live_model: str, rid: str, served: str, why: str) -> None:
    join = ShadowJoin()
    join.add_live(live(model=live_model)) if live_model != "m" else None
    if live_model == "m":
        with pytest.raises(Forged, match=why):
            join.add_live(live(model=live_model))
        return
    with pytest.raises(Forged, match=why):
        join.add_reply(end(rid, 0, model=served))


def test_live_answer_with_a_mirror_id_is_forged() -> None:
    with pytest.raises(Forged):
        ShadowJoin().add_live(live("r1.mirror.2"))


def test_expiry_and_bound_are_counted() -> None:
    clock = Clock()
    join = ShadowJoin(ttl_s=10, max_pending=2, clock=clock)
    join.add_live(live("a"))
    join.add_reply(deltas("b.mirror.2", [("x", [1])])[0])  # never ends
    clock.now = 11
    join.add_live(live("c"))
    join.expire()
    assert join.counts["expired_live"] == 1 and join.counts["expired_mirror"] == 1
    assert list(join.live) == ["c"] and not join.mirrors
    join.add_live(live("d"))
    join.add_live(live("e"))
    assert join.counts["evicted"] == 1 and list(join.live) == ["d", "e"]
    join.add_reply(end("c.mirror.2", 0))  # "c" was evicted: the mirror waits, then expires
    clock.now = 30
    join.expire()
    assert join.counts["expired_mirror"] == 2 and join.counts["joined"] == 0


def test_similarity_with_the_auditors_embedding_model(fingerprinter) -> None:  # the model loads (else: skipped)
    from services.auditor.comparison import Pair
    from services.auditor.fingerprints import embedding_function

    embed = embedding_function(REPO / "models.toml")

    def similarity(live_text: str, mirror_text: str) -> float | None:
        join = ShadowJoin()
        join.add_live(live(text=live_text))
        join.add_reply(deltas("r1.mirror.2", [(mirror_text, [1])])[0])
        [pair] = join.add_reply(end("r1.mirror.2", 1))
        assert isinstance(pair, Pair)
        return compare(pair, embed).similarity

    same = similarity("The capital of France is Paris.", "The capital of France is Paris.")
    close = similarity("The capital of France is Paris.", "Paris is the capital city of France.")
    far = similarity("The capital of France is Paris.", "Bake the bread for forty minutes.")
    assert same == pytest.approx(1.0, abs=1e-5)
    assert far is not None and close is not None and far < 0.5 < close < same


def test_join_counts_are_on_metrics() -> None:
    from services.auditor.health import HealthMetrics

    health, join = HealthMetrics(), ShadowJoin(ttl_s=1, clock=Clock())
    health.shadow_join = join.counts
    join.add_live(live())
    join.clock.now = 2
    join.expire()
    text = health.render()
    assert value(text, "weir_audit_shadow_join_total", outcome="expired_live") == 1
    assert value(text, "weir_audit_shadow_join_total", outcome="joined") == 0
