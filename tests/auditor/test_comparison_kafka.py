"""The shadow comparison against the real broker: live answers and mirror replies in, one
ModelComparison each out (topic and ledger), forged and malformed records dead-lettered without
stopping it (docs/design.md, "Traffic policies")."""

from __future__ import annotations

from pathlib import Path
from uuid import uuid4

import orjson
import pytest

from schemas.codec import decode, encode
from schemas.messages import DeadLetter, ReplyDelta, ReplyEnd, Usage
from schemas.registry import ModelComparison, ShadowLive
from schemas.topics import Topics
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics

from .test_auditor_kafka import produce, read_all

pytestmark = pytest.mark.kafka

T0 = 1_700_000_000_000
VECTORS = {"a b c": [1.0, 0.0], "a b x": [0.6, 0.8], "same": [0.0, 1.0]}


def fake_embed(texts: list[str]) -> list[list[float]]:
    """A stand-in embedder with known vectors: the test checks the cosine the auditor computes."""
    return [VECTORS[text] for text in texts]


def live(rid: str, text: str, tokens: list[int], model: str = "m@1") -> bytes:
    return encode(
        ShadowLive(
            request_id=rid,
            model=model,
            assignment="canary",
            text=text,
            token_ids=tokens,
            finish_reason="stop",
            ttft_ms=25.0,
            tokens_per_s=40.0,
        )
    )


def mirror(rid: str, pieces: list[tuple[str, list[int]]], served: str = "m@2") -> list[bytes]:
    events = [encode(ReplyDelta(request_id=rid, seq=i, text=t, token_ids=ids)) for i, (t, ids) in enumerate(pieces)]
    return [
        *events,
        encode(
            ReplyEnd(
                request_id=rid,
                seq=len(pieces),
                finish_reason="stop",
                model_version=served,
                received_ms=T0,
                first_token_ms=T0 + 50,
                created_ms=T0 + 250,
                usage=Usage(completion_tokens=sum(len(ids) for _, ids in pieces)),
            )
        ),
    ]


@pytest.fixture
async def topics(bootstrap: str):
    topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    wanted = {
        topics.audit,
        topics.audit_anchors,
        topics.dead_letter,
        topics.shadow_live,
        topics.comparisons,
        topics.models,
        topics.model_health,
        topics.traffic,
    }  # the canary guard follows the registry
    await ensure_topics(bootstrap, [*[s for s in topics.core_specs() if s.name in wanted], topics.reply_spec("shadow")])
    yield topics
    await delete_prefixed_topics(bootstrap, topics.prefix)


async def test_comparisons_appear_and_forged_records_are_dead_lettered(
    bootstrap: str, topics: Topics, tmp_path: Path
) -> None:
    db = tmp_path / "audit.sqlite"
    settings = AuditorSettings(
        kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, audit_db=db, audit_checkpoint_key="hex:" + "ab" * 16
    )
    replies, shadow_live = topics.shadow_replies, topics.shadow_live
    async with create_app(settings, embed=fake_embed):
        # Bad records first, on both topics: none may stop what follows.
        await produce(
            bootstrap,
            replies,
            [
                (b"k", b"not json"),
                (b"k", orjson.dumps({"type": "end", "request_id": "x"})),  # no seq, no finish_reason
                (b"k", mirror("r0", [("hi", [1])])[0]),  # no mirror copy's id
            ],
        )
        await produce(
            bootstrap,
            shadow_live,
            [
                (b"k", b"{}"),
                (b"k", live("r9.mirror.2", "a b c", [1, 2, 3])),  # a mirror's id as a live answer
                (b"k", live("r3", "a b c", [1, 2, 3])),
            ],
        )
        await produce(bootstrap, replies, [(b"k", v) for v in mirror("r3.mirror.2", [("a b x", [1])], served="evil@2")])
        # Two good pairs: live first for r1, mirror first for r2.
        await produce(bootstrap, shadow_live, [(b"r1", live("r1", "a b c", [1, 2, 3]))])
        await produce(
            bootstrap,
            replies,
            [
                (b"k", v)
                for v in mirror("r1.mirror.2", [("a b", [1, 2]), (" x", [9])])
                + mirror("r2.mirror.m@2", [("sa", [7]), ("me", [8])])
            ],
        )
        await produce(bootstrap, shadow_live, [(b"r2", live("r2", "same", [7, 8]))])

        async def two_comparisons() -> bool:
            return len(await read_all(bootstrap, topics.comparisons)) == 2

        await until(two_comparisons, timeout_s=60, what="two comparisons on the topic")
        found = {
            c.request_id: c for c in (decode(ModelComparison, v) for v in await read_all(bootstrap, topics.comparisons))
        }
        letters = [decode(DeadLetter, v) for v in await read_all(bootstrap, topics.dead_letter)]

    one, two = found["r1"], found["r2"]
    assert (one.name, one.live, one.mirror) == ("m", "m@1", "m@2")
    assert one.exact_match is False and one.token_edit_distance == 1  # [1, 2, 3] against [1, 2, 9]
    assert one.similarity == pytest.approx(0.6)  # cos([1, 0], [0.6, 0.8])
    assert (one.live_ttft_ms, one.live_tokens_per_s) == (25.0, 40.0)
    assert (one.mirror_ttft_ms, one.mirror_tokens_per_s) == (50.0, 10.0)  # 2 tokens after the first in 200 ms
    assert one.mirror_error is None
    assert two.exact_match is True and two.token_edit_distance == 0 and two.similarity == pytest.approx(1.0)
    reasons = " | ".join(letter.reason for letter in letters)
    assert len(letters) == 6, reasons
    assert "not JSON" in reasons and "is no mirror copy's" in reasons and "has a mirror copy's request id" in reasons
    assert "served by 'evil@2'" in reasons
    with Ledger(db, readonly=True) as ledger:
        stored = {c.request_id: c for c in ledger.comparisons("m")}
    assert stored.keys() == {"r1", "r2"} and stored["r1"].token_edit_distance == 1 and stored["r2"].exact_match
    stored_bytes = b"".join(path.read_bytes() for path in tmp_path.glob("audit.sqlite*"))
    assert b"a b x" not in stored_bytes and b"a b c" not in stored_bytes  # no raw text in the ledger
