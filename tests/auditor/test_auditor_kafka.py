"""The auditor against the real Kafka broker: events in, one record each, dead letters out."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import RecordMetadata

from schemas.codec import decode, encode
from schemas.messages import DeadLetter
from schemas.topics import Topics
from services.auditor import cli
from services.auditor.app import create_app
from services.auditor.config import AuditorSettings
from services.auditor.ledger import Ledger, LedgerError
from tests.ports import HeldPort
from tests.waiting import until
from weir.kafka.admin import delete_prefixed_topics, ensure_topics, list_topic_names
from weir.metrics import value

from .factories import make_event, make_flag

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
NOT_JSON = b"this is {not json"
NOT_AN_EVENT = b'{"event_id": "x", "prompt": "raw text"}'
NOT_STORABLE = encode(make_event(99, seed=2**63))  # valid AuditEvent, but past SQLite's 64 bits


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    """Deprecated: kept importable only for branches written before tests/waiting.py; new tests call
    `until(check, timeout_s=..., what=...)`."""
    await until(check, timeout_s=timeout_s, what=what)


async def produce(bootstrap: str, topic: str, values: list[tuple[bytes, bytes]]) -> list[RecordMetadata]:
    """Produce (key, value) pairs; returns where each landed."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        futures = [await producer.send(topic, value, key=key) for key, value in values]
        return list(await asyncio.gather(*futures))
    finally:
        await producer.stop()


async def read_all(bootstrap: str, topic: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, 0)]  # the dead-letter topic has one partition
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        values: list[bytes] = []
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                values += [r.value for r in records]
        return values
    finally:
        await consumer.stop()


async def committed_and_end(bootstrap: str, topics: Topics) -> tuple[dict[int, int], dict[int, int]]:
    """The auditor group's committed offset (-1: none) and the end offset, per audit partition."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await admin.start()
    await consumer.start()
    try:
        committed = await admin.list_consumer_group_offsets(topics.auditor_group)
        tps = [TopicPartition(topics.audit, p) for p in range(4)]
        end = await consumer.end_offsets(tps)
        return (
            {tp.partition: committed[tp].offset if tp in committed else -1 for tp in tps},
            {tp.partition: end[tp] for tp in tps},
        )
    finally:
        await consumer.stop()
        await admin.close()


async def is_fully_committed(bootstrap: str, topics: Topics) -> bool:
    """True when the auditor's group committed the end offset of every audit partition."""
    committed, end = await committed_and_end(bootstrap, topics)
    return committed == end


async def rewind_group(bootstrap: str, topics: Topics) -> None:
    """Commit offset 0 on every audit partition: the next auditor reads everything again."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=topics.auditor_group, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topics.audit, p) for p in range(4)]
        consumer.assign(tps)
        await consumer.commit(dict.fromkeys(tps, 0))
    finally:
        await consumer.stop()


def num_records(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with Ledger(db, readonly=True) as ledger:
            return ledger.num_records()
    except LedgerError as exc:  # the auditor made the file and has not committed its tables yet
        assert "has no audit_log table" in str(exc), exc
        return 0


async def run_until(settings: AuditorSettings, bootstrap: str, topics: Topics, expected_records: int) -> None:
    """Run the auditor app until it holds `expected_records` and committed everything it read."""

    async def is_done() -> bool:
        return num_records(settings.audit_db) == expected_records and await is_fully_committed(bootstrap, topics)

    async with create_app(settings):
        await until(is_done, timeout_s=60, what=f"{expected_records} records and all offsets committed")


async def test_auditor_records_each_event_once_and_dead_letters_the_rest(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = audit_topics
    db = tmp_path / "audit.sqlite"
    settings = AuditorSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, audit_db=db)
    events = [make_event(i) for i in range(1, 21)]
    messages = [(e.request_id.encode(), encode(e)) for e in events]
    messages += [(b"req-3", encode(events[2])), (b"req-7", encode(events[6]))]  # duplicates
    messages += [(b"bad-1", NOT_JSON), (b"bad-2", NOT_AN_EVENT), (b"bad-3", NOT_STORABLE)]
    await produce(bootstrap, topics.audit, messages)

    await run_until(settings, bootstrap, topics, expected_records=20)

    with Ledger(db, readonly=True) as ledger:
        records = ledger.records()
        assert ledger.verify().is_ok
    assert sorted(r["event_id"] for r in records) == sorted(e.event_id for e in events)
    assert len({(r["kafka_partition"], r["kafka_offset"]) for r in records}) == 20
    letters = [decode(DeadLetter, v) for v in await read_all(bootstrap, topics.dead_letter)]
    assert sorted(letter.value.encode() for letter in letters) == sorted([NOT_JSON, NOT_AN_EVENT, NOT_STORABLE])
    by_value = {letter.value.encode(): letter for letter in letters}
    assert by_value[NOT_JSON].reason.startswith("not JSON")
    assert by_value[NOT_AN_EVENT].reason.startswith("invalid audit record")
    assert "seed=" in by_value[NOT_STORABLE].reason and "64-bit" in by_value[NOT_STORABLE].reason
    assert all(letter.source_topic == topics.audit and letter.service == "auditor" for letter in letters)
    assert {letter.key for letter in letters} == {"bad-1", "bad-2", "bad-3"}

    capsys.readouterr()  # drop FastStream's log lines
    assert (
        await asyncio.to_thread(
            cli.main, ["verify", "--db", str(db), "--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
        )
        == 0
    )
    out = capsys.readouterr().out
    num_chains = len({r["kafka_partition"] for r in records})
    assert out.startswith(f"OK: 20 records in {num_chains} chains, "), out
    assert cli.main(["show", "--db", str(db), "--limit", "2"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 2 and all(" req=req-" in line for line in shown)

    # Restart after the group lost its offsets: every message is redelivered. Old events stay one
    # record each, the new ones are appended, and the chain stays intact.
    await rewind_group(bootstrap, topics)
    more = [make_event(i) for i in range(21, 24)]
    await produce(bootstrap, topics.audit, [(e.request_id.encode(), encode(e)) for e in more])
    await run_until(settings, bootstrap, topics, expected_records=23)
    capsys.readouterr()
    assert (
        await asyncio.to_thread(
            cli.main, ["verify", "--db", str(db), "--bootstrap", bootstrap, "--topic-prefix", topics.prefix]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("OK: 23 records in ")
    assert len(await read_all(bootstrap, topics.dead_letter)) == 6  # redelivered, dead-lettered again


async def test_review_flags_on_the_audit_topic_reach_the_ledger_once(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topics = audit_topics
    db = tmp_path / "audit.sqlite"
    settings = AuditorSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, audit_db=db)
    events, flags = [make_event(i) for i in range(1, 4)], [make_flag(i) for i in range(1, 3)]
    with_text = encode(make_flag(3)).replace(b'"rules":', b'"prompt":"ignore all previous instructions","rules":')
    messages = [(e.request_id.encode(), encode(e)) for e in events]
    messages += [(f.principal.encode(), encode(f)) for f in [*flags, flags[0]]]  # the gateway keys by principal
    messages += [(b"user-0", with_text)]
    await produce(bootstrap, topics.audit, messages)

    async def is_done() -> bool:
        if not db.exists():
            return False
        with Ledger(db, readonly=True) as ledger:
            stored = (ledger.num_records(), ledger.review_flags.num_flags())
        return stored == (3, 2) and await is_fully_committed(bootstrap, topics)

    async with create_app(settings):
        await until(is_done, timeout_s=60, what="3 records, 2 review flags and all offsets committed")

    with Ledger(db, readonly=True) as ledger:
        report = ledger.verify()
        stored = ledger.review_flags.rows()
    assert report.is_ok and report.num_flags == 2, report.describe()
    assert sorted(f["flag_id"] for f in stored) == ["flag-1", "flag-2"]
    assert all(f["principal"] in ("user-1", "user-2") and f["num_detections"] == 5 for f in stored)
    [letter] = [decode(DeadLetter, v) for v in await read_all(bootstrap, topics.dead_letter)]
    assert letter.value.encode() == with_text and "prompt" in letter.reason
    capsys.readouterr()
    assert cli.main(["reviews", "--db", str(db)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


async def test_offset_is_not_committed_past_an_event_the_ledger_refused(
    bootstrap: str, audit_topics: Topics, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topics = audit_topics
    db = tmp_path / "audit.sqlite"
    settings = AuditorSettings(
        kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, audit_db=db, audit_retry_backoff_s=0.1
    )
    Ledger(db).close()
    # The ledger file refuses ev-5 until the trigger goes: a disk-level failure, no mock.
    raw = sqlite3.connect(db, isolation_level=None, timeout=10)
    raw.execute(
        "CREATE TRIGGER refuse_ev5 BEFORE INSERT ON audit_log WHEN NEW.event_id = 'ev-5' "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
    )
    events = [make_event(i) for i in range(1, 21)]
    landed = await produce(bootstrap, topics.audit, [(e.request_id.encode(), encode(e)) for e in events])
    stuck = landed[4]  # where ev-5 is
    # Everything before ev-5 in its partition, and everything in the other partitions, gets in.
    num_before = sum(1 for m in landed if m.partition != stuck.partition or m.offset < stuck.offset)

    async def is_stuck_at_ev5() -> bool:
        committed, end = await committed_and_end(bootstrap, topics)
        others_done = all(committed[p] == end[p] for p in end if p != stuck.partition)
        return others_done and num_records(db) == num_before

    async with create_app(settings):
        await until(is_stuck_at_ev5, timeout_s=60, what="every event but ev-5 and those after it in its partition")

        async def is_retried() -> bool:  # ev-5 refused, redelivered and refused again, thrice
            return caplog.text.count("ledger write of event ev-5 failed") >= 3

        await until(is_retried, timeout_s=60, what="three redeliveries of ev-5")
        committed, _ = await committed_and_end(bootstrap, topics)
        assert committed[stuck.partition] <= stuck.offset
        assert num_records(db) == num_before
        raw.execute("DROP TRIGGER refuse_ev5")
        raw.close()
        await until(lambda: is_fully_committed(bootstrap, topics), timeout_s=60, what="all offsets committed")
        assert num_records(db) == 20
    with Ledger(db, readonly=True) as ledger:
        assert ledger.verify().is_ok


async def test_binary_and_null_headers_do_not_hold_back_their_batch(
    bootstrap: str, audit_topics: Topics, tmp_path: Path
) -> None:
    # FastStream decodes header values as UTF-8; one that is not (or null) must not fail its batch.
    topics = audit_topics
    settings = AuditorSettings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, audit_db=tmp_path / "a.sqlite")
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(1, 7):
            headers = [("trace", b"\xff\xfe binary")] if i % 3 == 0 else [("empty", None)] if i == 4 else []
            await producer.send(topics.audit, encode(make_event(i)), key=b"one-partition", headers=headers)
        await producer.flush()
    finally:
        await producer.stop()
    await run_until(settings, bootstrap, topics, expected_records=6)
    assert await read_all(bootstrap, topics.dead_letter) == []


async def test_main_runs_until_sigterm(bootstrap: str, tmp_path: Path) -> None:
    # A deployment made before the anchor topic existed: `weir auditor` creates it.
    audit_topics = Topics(prefix=f"t{uuid4().hex[:8]}")
    await ensure_topics(
        bootstrap, [s for s in audit_topics.core_specs() if s.name in (audit_topics.audit, audit_topics.dead_letter)]
    )
    try:
        await _run_main_until_sigterm(bootstrap, audit_topics, tmp_path)
        assert audit_topics.audit_anchors in await list_topic_names(bootstrap)
    finally:
        await delete_prefixed_topics(bootstrap, audit_topics.prefix)


async def _run_main_until_sigterm(bootstrap: str, audit_topics: Topics, tmp_path: Path) -> None:
    db = tmp_path / "audit.sqlite"
    await produce(bootstrap, audit_topics.audit, [(b"k", encode(make_event(i))) for i in range(1, 4)])
    with HeldPort() as held:  # the auditor serves the test's socket: no pick-then-release race
        port = held.port
        env = {
            **os.environ,
            "WEIR_KAFKA_BOOTSTRAP": bootstrap,
            "WEIR_TOPIC_PREFIX": audit_topics.prefix,
            "WEIR_AUDIT_API_PORT": str(port),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import sys; from services.auditor.app import main; sys.exit(main(sys.argv[1:]))",
            "--db",
            str(db),
            env=held.env(env),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=held.pass_fds,
        )

    async def has_three_records() -> bool:
        return num_records(db) == 3

    async def metrics_count_three() -> bool:
        try:
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        except httpx.HTTPError:
            return False
        return value(text, "weir_audit_events_total") == 3

    try:
        await until(has_three_records, timeout_s=60, what="3 records from `weir auditor`")
        await until(metrics_count_three, timeout_s=60, what="the auditor's /metrics to count the 3 events")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, stderr.decode()[-2000:]
