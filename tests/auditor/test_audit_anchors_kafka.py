"""The audit chain against its anchor in Kafka, on the real broker: the auditor writes records and
review flags, checkpoints them and publishes each checkpoint's anchor; then the SQLite ledger is
tampered with as its owner could (a cut tail, a rewrite with every unkeyed hash and checkpoint
recomputed, a deleted review flag) and `weir audit verify` catches each; a clean copy verifies;
a forged anchor on the topic is named."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from schemas.codec import decode, encode
from schemas.messages import AuditAnchor
from schemas.topics import Topics
from services.auditor import cli
from services.auditor.app import create_app
from services.auditor.chain import checkpoint_mac
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger
from tests.waiting import until
from weir.kafka.admin import describe_topic_configs

from .factories import make_event, make_flag
from .tamper import ATTACKER_KEY, cut_tail, open_raw, rewrite_chain
from .test_auditor_kafka import produce, read_all

pytestmark = pytest.mark.kafka

KEY = "hex:" + "5a" * 32  # the deployment's checkpoint key, as WEIR_AUDIT_CHECKPOINT_KEY gives it
NUM_EVENTS, NUM_FLAGS = 12, 4


async def verify(db: Path, bootstrap: str, topics: Topics, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`weir audit verify` (a program with its own event loop: run from a thread here)."""
    capsys.readouterr()
    status = await asyncio.to_thread(
        cli.main, ["verify", "--db", str(db), "--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
    )
    return status, capsys.readouterr().out


async def newest_anchored(bootstrap: str, topics: Topics) -> dict[str, int]:
    """{log: newest last_seq} of the anchors on the topic."""
    newest: dict[str, int] = {}
    for value in await read_all(bootstrap, topics.audit_anchors):
        anchor = decode(AuditAnchor, value)
        newest[anchor.log] = max(newest.get(anchor.log, 0), anchor.last_seq)
    return newest


@pytest.fixture
async def ledger_with_anchors(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A ledger the auditor wrote from the real audit topic: records 1..12 in checkpoints of three,
    flags 1..3 in one checkpoint and flag 4 after it, every checkpoint anchored."""
    monkeypatch.setenv("WEIR_AUDIT_CHECKPOINT_KEY", KEY)
    topics = audit_topics
    db = tmp_path / "audit.sqlite"
    settings = AuditorSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=topics.prefix,
        audit_db=db,
        audit_checkpoint_every_records=3,
        audit_checkpoint_every_s=3600,
    )

    async def feed(messages: list[bytes], log: str, anchored_to: int) -> None:
        await produce(bootstrap, topics.audit, [(b"one", m) for m in messages])  # one key: one chain of each

        async def is_anchored() -> bool:
            return (await newest_anchored(bootstrap, topics)).get(log) == anchored_to

        await until(is_anchored, timeout_s=60, what=f"the {log} anchor of seq {anchored_to}")

    async with create_app(settings):
        # A few at a time: a fetched batch is one group commit, and gets one checkpoint.
        for first in range(1, NUM_EVENTS + 1, 3):
            await feed([encode(make_event(i)) for i in range(first, first + 3)], "audit", first + 2)
        await feed([encode(make_flag(i)) for i in range(1, 4)], "review_flags", 3)
        await produce(bootstrap, topics.audit, [(b"one", encode(make_flag(4)))])

        async def has_flag_4() -> bool:
            with Ledger(db, readonly=True) as ledger:
                return ledger.review_flags.num_flags() == NUM_FLAGS

        await until(has_flag_4, timeout_s=60, what="flag 4 in the ledger")
    return db


def copy_of(db: Path, name: str) -> Path:
    target = db.with_name(name)
    shutil.copy(db, target)
    return target


async def test_verify_checks_the_ledger_against_its_kafka_anchors(
    bootstrap: str, audit_topics: Topics, ledger_with_anchors: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topics, db = audit_topics, ledger_with_anchors
    with Ledger(db, readonly=True) as ledger:
        [partition] = ledger.chain_ids()
    config = (await describe_topic_configs(bootstrap, [topics.audit_anchors]))[topics.audit_anchors]
    assert (config["cleanup.policy"], config["retention.ms"]) == ("delete", "-1")  # kept for good, not compacted

    status, out = await verify(db, bootstrap, topics, capsys)
    assert status == 0, out
    assert out.startswith(f"OK: {NUM_EVENTS} records in 1 chains, 4 checkpoints, all intact; {NUM_FLAGS} review flags")
    assert "ANCHORS OK: the ledger matches the " in out
    assert f"audit chain {partition}: anchored up to checkpoint 4 (seq 12" in out
    assert f"review flags chain {partition}: anchored up to checkpoint 1 (seq 3" in out
    assert "1 record(s) after it not anchored yet" in out  # flag 4: after the last flag checkpoint

    # Records and checkpoints after checkpoint 2 deleted: the database alone is consistent.
    cut = copy_of(db, "cut.sqlite")
    with open_raw(cut) as conn:
        assert cut_tail(conn, "audit", partition, keep_checkpoints=2) == 6
    status, out = await verify(cut, bootstrap, topics, capsys)
    assert status == 1 and out.startswith("OK: 6 records in 1 chains, 2 checkpoints, all intact"), out
    assert f"TRUNCATED audit chain {partition}: Kafka's anchor of checkpoint 3 covers seq 7..9" in out, out

    # A record rewritten, every record hash after it and every checkpoint recomputed (without the key).
    rewritten = copy_of(db, "rewritten.sqlite")
    with open_raw(rewritten) as conn:
        rewrite_chain(conn, "audit", partition, 5, "principal", "someone-innocent", mac_key=ATTACKER_KEY)
    status, out = await verify(rewritten, bootstrap, topics, capsys)
    assert status == 1, out
    assert f"BROKEN chain={partition} at checkpoint 1: forged: its MAC does not match the checkpoint key" in out
    assert f"REWRITTEN audit chain {partition}: the database's checkpoint 2 (seq 4..6)" in out

    # The same rewrite by someone who holds the checkpoint key: only the anchor shows it.
    with_key = copy_of(db, "with-key.sqlite")
    with open_raw(with_key) as conn:
        rewrite_chain(
            conn,
            "audit",
            partition,
            5,
            "principal",
            "someone-innocent",
            mac_key=bytes.fromhex(KEY.removeprefix("hex:")),
        )
    status, out = await verify(with_key, bootstrap, topics, capsys)
    assert status == 1 and out.startswith("OK: "), out
    assert f"REWRITTEN audit chain {partition}" in out

    # A review flag deleted (the newest anchored one), its checkpoint with it.
    no_flag = copy_of(db, "no-flag.sqlite")
    with open_raw(no_flag) as conn:
        conn.execute("DELETE FROM review_flags WHERE seq >= 3")
        conn.execute("DELETE FROM review_flag_checkpoints")
    status, out = await verify(no_flag, bootstrap, topics, capsys)
    assert status == 1, out
    assert f"TRUNCATED review flags chain {partition}: Kafka's anchor of checkpoint 1 covers seq 1..3" in out

    # A flag edited in place: its chain breaks in the database already.
    edited = copy_of(db, "edited-flag.sqlite")
    with open_raw(edited) as conn:
        rewrite_chain(conn, "review_flags", partition, 2, "num_detections", 1)
    status, out = await verify(edited, bootstrap, topics, capsys)
    assert status == 1 and f"REWRITTEN review flags chain {partition}" in out, out
    assert f"BROKEN review flags chain={partition} at checkpoint 1: forged" in out

    # A forged anchor on the topic (a Kafka client without the key): named, and verify fails.
    anchor = decode(AuditAnchor, (await read_all(bootstrap, topics.audit_anchors))[-1])
    forged = anchor.model_copy(
        update={
            "last_seq": 99,
            "mac": checkpoint_mac(ATTACKER_KEY, anchor.log, anchor.chain_id, anchor.checkpoint_hash),
        }
    )
    await produce(bootstrap, topics.audit_anchors, [(b"audit/0", encode(forged))])
    status, out = await verify(db, bootstrap, topics, capsys)
    assert status == 1, out
    assert "ANCHORS BROKEN: 1 problem(s)" in out and "FORGED anchor at offset" in out


async def test_verify_without_kafka_exits_2_and_says_how_to_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_AUDIT_CHECKPOINT_KEY", KEY)
    db = tmp_path / "audit.sqlite"
    Ledger(db).close()
    status = await asyncio.to_thread(
        cli.main, ["verify", "--db", str(db), "--bootstrap", "127.0.0.1:1", "--anchor-timeout", "3"]
    )
    assert status == 2
    assert "cannot read the anchors" in capsys.readouterr().err
    assert cli.main(["verify", "--db", str(db), "--no-anchor"]) == 0
    assert "ANCHORS NOT CHECKED (--no-anchor)" in capsys.readouterr().out
    assert cli.main(["verify", "--db", str(db), "--no-anchor", "--topic-prefix", "p"]) == 2
    assert "--no-anchor skips them" in capsys.readouterr().err


async def test_verify_refuses_a_missing_anchor_topic(
    bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WEIR_AUDIT_CHECKPOINT_KEY", KEY)
    db = tmp_path / "audit.sqlite"
    Ledger(db).close()
    status = await asyncio.to_thread(
        cli.main,
        [
            "verify",
            "--db",
            str(db),
            "--bootstrap",
            bootstrap,
            "--topic-prefix",
            "no-such-prefix-x1",
            "--anchor-timeout",
            "10",
        ],
    )
    assert status == 2
    assert "no-such-prefix-x1.audit.anchors does not exist" in capsys.readouterr().err
