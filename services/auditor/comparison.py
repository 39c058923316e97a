"""The shadow comparison (docs/design.md, "Traffic policies"): a mirror copy's answer against the live one.

Two topics feed it, read by the auditor's comparison group (Topics.comparison_group): the mirror
copies' ReplyEvents on Topics.shadow_replies (request id `<live id>.mirror.<version>`; deltas are
gathered until the ReplyEnd) and the live answers (ShadowLive) on Topics.shadow_live. They are
joined by live request id in memory, bounded: what waits longer than `ttl_s` for its other half,
or past `max_pending` entries, is dropped and counted (`ShadowJoin.counts`). Each join gives one
ModelComparison (weir/models/compare.py does the measures), published on Topics.comparisons and
kept in the ledger (no raw text; services/auditor/comparison_log.py).

A record that is no ReplyEvent / ShadowLive, a reply whose id names no mirror copy, a live answer
whose id is a mirror's, or a pair whose models are not two versions of one name, is dead-lettered
with why (docs/design.md, invariant 6) and changes nothing. The join is in memory: offsets are
committed as records are read, and a restart loses only the pairs that were waiting (seen as fewer
samples). The replies topic has one partition, so one auditor replica joins: with several replicas,
the live answers on partitions another replica holds find no mirror there and expire (counted as
expired_live): run the comparison on one replica (docs/auditor.md, "Shadow comparison").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from schemas.codec import DecodeError, decode, decode_reply
from schemas.messages import ReplyDelta, ReplyEnd
from schemas.registry import ModelComparison, ShadowLive, split_ref, version_problem
from schemas.reply_stream import ReplyCursor
from services.auditor.config import AuditorSettings
from services.auditor.consumers import parse_records
from weir.bus import consumer_settings
from weir.models.compare import cosine, edit_distance, reply_rates

log = logging.getLogger(__name__)

MIRROR_MARK = ".mirror."
MAX_REPLY_CHARS = 1_000_000  # as ShadowLive.text: a longer mirror answer is an error of the copy
Embed = Callable[[list[str]], list[list[float]] | None]


class Forged(ValueError):
    """A record that decodes but cannot be what it claims; the message says why."""


def mirror_of(request_id: str) -> tuple[str, str]:
    """(live request id, mirror version suffix) of a mirror copy's request id, or Forged."""
    live, mark, version = request_id.rpartition(MIRROR_MARK)
    if not mark or not live or not version:
        raise Forged(f"request id {request_id!r} is no mirror copy's (<live id>{MIRROR_MARK}<version>)")
    return live, version


@dataclass
class MirrorReply:
    """A mirror copy's answer, gathered from its ReplyEvents (positions it has dropped from a repeat)."""

    live_id: str
    suffix: str  # the version in its request id: "V" or "name@V"
    seen_s: float
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cursor: ReplyCursor = field(default_factory=ReplyCursor)
    chars: int = 0
    overflow: bool = False
    end: ReplyEnd | None = None

    def add(self, delta: ReplyDelta) -> None:
        if self.end is not None:
            return
        part = self.cursor.take(delta)
        if not isinstance(part, ReplyDelta):  # nothing new in it (a delta never yields an end)
            return
        delta = part
        self.chars += len(delta.text)
        if self.chars > MAX_REPLY_CHARS:
            self.overflow = True
            self.text.clear()
            self.token_ids.clear()
        if not self.overflow:
            self.text.append(delta.text)
            self.token_ids.extend(delta.token_ids)


@dataclass
class Pair:
    """A live answer and one mirror copy's finished answer: ready to compare."""

    live: ShadowLive
    mirror_model: str
    mirror: MirrorReply


@dataclass
class _Live:
    answer: ShadowLive
    seen_s: float
    matched: int = 0


class ShadowJoin:
    """The bounded in-memory join of mirror replies and live answers by live request id.

    `add_reply` / `add_live` return the pairs they complete (each mirror is paired once); they raise
    Forged for a record that cannot be what it claims. `expire(now)` drops what waited over `ttl_s`.
    `counts`: joined, expired_live (a live answer no mirror reply met), expired_mirror (a mirror
    reply no live answer met, or that never ended), evicted (dropped past max_pending), late_deltas.
    """

    def __init__(
        self, ttl_s: float = 300.0, max_pending: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.clock = clock
        self.live: OrderedDict[str, _Live] = OrderedDict()
        self.mirrors: OrderedDict[str, MirrorReply] = OrderedDict()  # by the mirror copy's request id
        self.counts = dict.fromkeys(("joined", "expired_live", "expired_mirror", "evicted", "late_deltas"), 0)

    def add_reply(self, event: ReplyDelta | ReplyEnd) -> list[Pair]:
        live_id, suffix = mirror_of(event.request_id)
        reply = self.mirrors.get(event.request_id)
        if reply is None:
            reply = MirrorReply(live_id, suffix, self.clock())
            self.mirrors[event.request_id] = reply
            self._bound(self.mirrors)
        if isinstance(event, ReplyDelta):
            if reply.end is not None:
                self.counts["late_deltas"] += 1
            reply.add(event)
            return []
        if reply.end is not None:
            return []  # a repeated end
        reply.end = event
        found = self.live.get(live_id)
        if found is None:
            return []  # waits for its live answer
        return [self._pair(event.request_id, found)]

    def add_live(self, answer: ShadowLive) -> list[Pair]:
        if MIRROR_MARK in answer.request_id:
            raise Forged(f"live answer {answer.request_id!r} has a mirror copy's request id")
        _name_version(answer.model, "live answer's model")
        if answer.request_id in self.live:
            return []  # a redelivery: the first one stands
        found = _Live(answer, self.clock())
        self.live[answer.request_id] = found
        self._bound(self.live)
        waiting = [rid for rid, reply in self.mirrors.items() if reply.live_id == answer.request_id and reply.end]
        return [self._pair(rid, found) for rid in waiting]

    def expire(self, now: float | None = None) -> None:
        """Drop what waited longer than ttl_s for its other half (counted)."""
        now = self.clock() if now is None else now
        for rid in [rid for rid, reply in self.mirrors.items() if now - reply.seen_s > self.ttl_s]:
            del self.mirrors[rid]
            self.counts["expired_mirror"] += 1
        for rid in [rid for rid, live in self.live.items() if now - live.seen_s > self.ttl_s]:
            if not self.live.pop(rid).matched:
                self.counts["expired_live"] += 1

    def _pair(self, mirror_id: str, found: _Live) -> Pair:
        reply = self.mirrors.pop(mirror_id)
        mirror_model = mirror_model_of(found.answer.model, reply)
        found.matched += 1
        self.counts["joined"] += 1
        return Pair(found.answer, mirror_model, reply)

    def _bound(self, pending: OrderedDict[str, MirrorReply] | OrderedDict[str, _Live]) -> None:
        while len(pending) > self.max_pending:
            pending.popitem(last=False)
            self.counts["evicted"] += 1


def _name_version(ref: str, what: str) -> tuple[str, str]:
    name, version = split_ref(ref)
    if not name or version is None or version_problem(version):
        raise Forged(f"{what} {ref!r} is no name@version")
    return name, version


def mirror_model_of(live_model: str, reply: MirrorReply) -> str:
    """The mirror copy's name@version: its ReplyEnd's model_version, which must agree with the
    version its request id names and be another version of the live answer's name; else Forged."""
    live_name, live_version = _name_version(live_model, "live answer's model")
    named = reply.suffix if "@" in reply.suffix else f"{live_name}@{reply.suffix}"
    name, version = _name_version(named, "mirror copy's version")
    assert reply.end is not None
    if reply.end.model_version is not None and reply.end.model_version != named:
        raise Forged(f"mirror reply served by {reply.end.model_version!r}, its request id names {named!r}")
    if name != live_name or version == live_version:
        raise Forged(f"mirror {named!r} is no other version of the live answer's {live_model!r}")
    return named


def compare(pair: Pair, embed: Embed | None) -> ModelComparison:
    """The measures of one pair: exact match, token edit distance, similarity of the texts'
    embeddings (None without an embedder), TTFT and tokens/s of both; mirror_error when the copy
    did not finish (its measures are then those of nothing: no match, the live answer's length)."""
    live, reply = pair.live, pair.mirror
    end = reply.end
    assert end is not None
    name = split_ref(live.model)[0]
    common = {
        "request_id": live.request_id,
        "name": name,
        "live": live.model,
        "mirror": pair.mirror_model,
        "live_ttft_ms": live.ttft_ms,
        "live_tokens_per_s": live.tokens_per_s,
    }
    error = _mirror_error(reply)
    if error is not None:
        return ModelComparison(
            **common, exact_match=False, token_edit_distance=len(live.token_ids), mirror_error=error[:1024]
        )
    text = "".join(reply.text)
    similarity = None
    if embed is not None:
        vectors = embed([live.text, text])
        similarity = cosine(vectors[0], vectors[1]) if vectors is not None else None
    ttft, rate = reply_rates(end.received_ms, end.first_token_ms, end.created_ms, end.usage.completion_tokens)
    return ModelComparison(
        **common,
        exact_match=text == live.text,
        token_edit_distance=edit_distance(live.token_ids, reply.token_ids),
        similarity=similarity,
        mirror_ttft_ms=ttft,
        mirror_tokens_per_s=rate,
    )


def _mirror_error(reply: MirrorReply) -> str | None:
    end = reply.end
    assert end is not None
    if end.finish_reason not in ("stop", "length"):
        detail = f" ({end.error.code}: {end.error.message})" if end.error else ""
        return f"{end.finish_reason}{detail}"
    if reply.overflow:
        return f"answer longer than {MAX_REPLY_CHARS} characters"
    missing = reply.cursor.missing + max(0, end.seq - reply.cursor.have)
    if missing:
        return f"{missing} of {end.seq} positions missing"
    return None


class Comparisons:
    """The comparison group's handler: records in, ModelComparisons out (topic, ledger)."""

    def __init__(
        self,
        join: ShadowJoin,
        embed: Embed | None,
        publish: Callable[[ModelComparison], Awaitable[None]],
        store: Callable[[ModelComparison], Awaitable[bool]],
        dead_letter: Callable[[ConsumerRecord, str], Awaitable[None]],
    ) -> None:
        self.join = join
        self.embed = embed
        self.publish = publish
        self.store = store
        self.dead_letter = dead_letter

    async def on_replies(self, records: list[ConsumerRecord]) -> None:
        for record in records:
            await self._one(record, lambda value: self.join.add_reply(decode_reply(value)))

    async def on_live(self, records: list[ConsumerRecord]) -> None:
        for record in records:
            await self._one(record, lambda value: self.join.add_live(decode(ShadowLive, value)))

    async def _one(self, record: ConsumerRecord, add: Callable[[bytes], list[Pair]]) -> None:
        self.join.expire()
        try:
            pairs = add(record.value)
            comparisons = [await asyncio.to_thread(compare, pair, self.embed) for pair in pairs]
        except (DecodeError, Forged) as bad:
            await self.dead_letter(record, str(bad))
            return
        for comparison in comparisons:
            await self.publish(comparison)
            await self.store(comparison)


def register_comparison(broker: KafkaBroker, settings: AuditorSettings, comparisons: Comparisons) -> None:
    """Subscribe the comparison group to the shadow replies and the live answers, a fetched batch at a
    time. Offsets are committed as records are read (the join lives in memory; see the module doc)."""
    fetch = consumer_settings(settings)
    fetch.pop("enable_auto_commit")  # FastStream derives it from the ack policy

    async def raw(msg: KafkaMessage) -> list[ConsumerRecord]:
        return list(msg.raw_message)

    common = {
        "group_id": settings.topics.comparison_group,
        "batch": True,
        "ack_policy": AckPolicy.ACK_FIRST,
        "parser": parse_records,
        "decoder": raw,
        "auto_offset_reset": "earliest",
        **fetch,
    }

    @broker.subscriber(
        settings.topics.shadow_replies,
        title="auditor/shadow-replies",
        description="Mirror copies' ReplyEvents, gathered for the comparison.",
        **common,
    )
    async def on_shadow_replies(records: list[ConsumerRecord]) -> None:
        await comparisons.on_replies(records)

    @broker.subscriber(
        settings.topics.shadow_live,
        title="auditor/shadow-live",
        description="Live answers of mirrored requests, joined with their mirrors.",
        **common,
    )
    async def on_shadow_live(records: list[ConsumerRecord]) -> None:
        await comparisons.on_live(records)
