"""The audit ledger's anchors in Kafka: keyed checkpoints its writer cannot take back.

As the auditor writes a checkpoint of a chain (of records, or of review flags) it publishes it as
an AuditAnchor to `<prefix>.audit.anchors` (schemas/topics.py), keyed "<log>/<chain_id>": the
chain's head hash, how many records it covered, when, and the checkpoint's MAC under the
deployment's checkpoint key (services/auditor/chain.py, checkpoint_mac). The topic is never
compacted and keeps its records for good, so a record written over an anchor's key hides nothing.

`weir audit verify` reads every anchor and checks the database against them (check_anchors):

- an anchor whose MAC is wrong, or whose fields do not hash to its checkpoint_hash: forged;
- an anchored checkpoint the database does not have: the chain was truncated (records and
  checkpoints removed after the last anchor Kafka knows);
- an anchored checkpoint the database holds with another hash: the chain was rewritten and its
  checkpoints recomputed (with or without the key: the anchor was published before);
- a chain whose database checkpoints no anchor vouches for: unanchored (its anchors are gone, or
  the database is not this deployment's).

Checkpoints after the newest anchor (not yet published), and records after the newest
checkpoint, are vouched for by nothing yet; verify says how many there are (docs/design.md,
"The audit chain").
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.codec import DecodeError, decode
from schemas.messages import AuditAnchor
from services.auditor.chain import CheckpointRow, Log, canonical_checkpoint, chain_hash, mac_matches
from weir.bus import partitions_of
from weir.kafka.security import client_options_from_env

ChainKey = tuple[Log, int]  # (log, chain_id)
_LABEL: dict[str, str] = {"audit": "audit chain", "review_flags": "review flags chain"}


def anchor_of(log: Log, chain_id: int, cp: CheckpointRow) -> AuditAnchor:
    """The AuditAnchor of a stored checkpoint (it must carry its MAC)."""
    if cp.mac is None:
        raise ValueError(f"{log} chain {chain_id} checkpoint {cp.num} has no MAC: it cannot be anchored")
    return AuditAnchor(
        log=log,
        chain_id=chain_id,
        num=cp.num,
        first_seq=cp.first_seq,
        last_seq=cp.last_seq,
        merkle_root=cp.merkle_root,
        last_record_hash=cp.last_record_hash,
        created_ms=cp.created_ms,
        prev_hash=cp.prev_hash,
        checkpoint_hash=cp.checkpoint_hash,
        mac=cp.mac,
    )


def anchor_key(anchor: AuditAnchor) -> bytes:
    """The Kafka key of an anchor: "<log>/<chain_id>" (one partition; the key is for readers)."""
    return f"{anchor.log}/{anchor.chain_id}".encode()


def anchor_problem(anchor: AuditAnchor, key: bytes) -> str | None:
    """Why `anchor` is not one the checkpoint `key` made, or None when it is."""
    canonical = canonical_checkpoint(
        anchor.chain_id,
        anchor.num,
        anchor.first_seq,
        anchor.last_seq,
        anchor.merkle_root,
        anchor.last_record_hash,
        anchor.created_ms,
    )
    if chain_hash(anchor.prev_hash, canonical) != anchor.checkpoint_hash:
        return "its fields do not hash to its checkpoint_hash"
    if not mac_matches(key, anchor.log, anchor.chain_id, anchor.checkpoint_hash, anchor.mac):
        return "its MAC does not match the checkpoint key"
    return None


@dataclass(frozen=True)
class AnchorRecord:
    """One record of the anchor topic, as read: where it is, and its value."""

    offset: int
    value: bytes | None


@dataclass(frozen=True)
class ChainState:
    """What the database holds of one chain: its checkpoints (num order) and how many records."""

    checkpoints: list[CheckpointRow]
    num_records: int


@dataclass
class AnchorReport:
    """The database against the anchors: `problems` (any makes verify fail), and a line per chain."""

    topic: str
    num_anchors: int = 0
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @property
    def is_ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        """Lines for a person: a summary ('ANCHORS OK: ...' or 'ANCHORS BROKEN: ...'), then the details."""
        first = (
            f"ANCHORS OK: the ledger matches the {self.num_anchors} anchor(s) in Kafka ({self.topic})"
            if self.is_ok
            else f"ANCHORS BROKEN: {len(self.problems)} problem(s) against the "
            f"{self.num_anchors} anchor(s) in Kafka ({self.topic})"
        )
        return "\n".join([first, *self.problems, *self.lines])


def check_anchors(
    topic: str, records: Iterable[AnchorRecord], key: bytes, chains: dict[ChainKey, ChainState]
) -> AnchorReport:
    """Check the database's chains (`chains`) against the records of the anchor topic. Pure."""
    report = AnchorReport(topic)
    anchored: dict[ChainKey, list[AuditAnchor]] = {}
    for record in records:
        report.num_anchors += 1
        try:
            anchor = decode(AuditAnchor, record.value)
        except DecodeError as exc:
            report.problems.append(f"FORGED anchor at offset {record.offset}: it is not an AuditAnchor ({exc})")
            continue
        if (why := anchor_problem(anchor, key)) is not None:
            report.problems.append(
                f"FORGED anchor at offset {record.offset} ({_LABEL[anchor.log]} {anchor.chain_id}, "
                f"checkpoint {anchor.num}): {why}"
            )
            continue
        anchored.setdefault((anchor.log, anchor.chain_id), []).append(anchor)
    for chain in sorted({*anchored, *(c for c, state in chains.items() if state.checkpoints)}):
        state = chains.get(chain, ChainState([], 0))
        problem, line = _check_chain(chain, sorted(anchored.get(chain, []), key=lambda a: a.num), state)
        if problem is not None:
            report.problems.append(problem)
        if line is not None:
            report.lines.append(line)
    return report


def _check_chain(chain: ChainKey, anchors: list[AuditAnchor], state: ChainState) -> tuple[str | None, str | None]:
    """(problem, line) of one chain: its database checkpoints against its anchors (num order)."""
    label = f"{_LABEL[chain[0]]} {chain[1]}"
    if not anchors:
        return (
            f"UNANCHORED {label}: the database holds {len(state.checkpoints)} checkpoint(s) of it but Kafka has "
            "no anchor for it (its anchors were removed, or this database is not the deployment's; if its "
            "auditor wrote its first checkpoint just now, verify again in a few seconds)"
        ), None
    by_num = {cp.num: cp for cp in state.checkpoints}
    db_end = state.checkpoints[-1].last_seq if state.checkpoints else 0
    for anchor in anchors:
        cp = by_num.get(anchor.num)
        if cp is None:
            return (
                f"TRUNCATED {label}: Kafka's anchor of checkpoint {anchor.num} covers seq {anchor.first_seq}.."
                f"{anchor.last_seq} (head {anchor.last_record_hash[:16]}), but the database has "
                f"{len(state.checkpoints)} checkpoint(s) of it, ending at seq {db_end}, and {state.num_records} "
                "record(s): its newest records and checkpoints were removed"
            ), None
        if cp.checkpoint_hash != anchor.checkpoint_hash:
            return (
                f"REWRITTEN {label}: the database's checkpoint {anchor.num} (seq {cp.first_seq}..{cp.last_seq}) "
                f"is not the one Kafka's anchor holds (seq {anchor.first_seq}..{anchor.last_seq}, head "
                f"{anchor.last_record_hash[:16]}): records up to seq {anchor.last_seq} were rewritten and the "
                "checkpoints recomputed"
            ), None
    last = anchors[-1]
    pending = [cp for cp in state.checkpoints if cp.num > last.num]
    return None, (
        f"{label}: anchored up to checkpoint {last.num} (seq {last.last_seq}, head "
        f"{last.last_record_hash[:16]}); {len(pending)} checkpoint(s) and "
        f"{max(state.num_records - last.last_seq, 0)} record(s) after it not anchored yet"
    )


async def read_anchor_records(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[AnchorRecord]:
    """Every record of the anchor topic, oldest first. TimeoutError when the cluster does not
    answer in `timeout_s`; RuntimeError when the topic does not exist."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        request_timeout_ms=int(timeout_s * 1000),
        **client_options_from_env(),
    )  # a secure deployment's login
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.start()
        async with asyncio.timeout(timeout_s):
            # the anchor topic exists long before verify runs: a short wait tells "missing" in time
            tps = [TopicPartition(topic, p) for p in sorted(await partitions_of(consumer, topic, timeout_s / 2))]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            records: list[AnchorRecord] = []
            while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
                for tp, batch in (await consumer.getmany(*tps, timeout_ms=1000)).items():
                    records += [AnchorRecord(r.offset, r.value) for r in batch if r.offset < end[tp]]
            return sorted(records, key=lambda r: r.offset)
    finally:
        await consumer.stop()
