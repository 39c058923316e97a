"""The batching planner: admission and scheduling of requests into per-model batches.

Pure and synchronous: no I/O, no clock of its own, no sleeps. The caller passes `now_ms` (epoch
milliseconds, the unit of deadline_ms) to every call that depends on time, so the
planner is tested with explicit time and driven by the batcher's Kafka loop in production.

Models are planned by version: a request's `model` (a bare name or `name@version`) is resolved
against the model registry (schemas/registry.py: RegistryState, followed by the batcher) when it
is admitted, and the request is pinned to that version (its `model` becomes the served_id,
`name@version`), so it keeps that version whatever is promoted while it waits, and one request is
never served by a mix of versions (docs/design.md, invariant 10). A version's batch bounds are its
manifest's.

Per version a ModelQueue (queues.py) holds the waiting requests and decides the order they leave
in: priority lanes (strict or weighted), weighted fair queuing per tenant on token cost, earliest
deadline first within a tenant; or, with lane_policy "fifo", arrival order alone. Expired requests
are dropped and reported, never batched.

A model's batch closes when it holds max_batch_size requests, when its oldest request has waited
max_wait_ms, or when the tokens it holds reach the room of the worker it would go to. Where a
batch goes is asked of a `Placement` (routing.py: live workers from heartbeats, prefix affinity)
for the request that leaves next; the batch then takes requests in order while they fit that
room, max_batch_size and the byte budget. When no worker has room the model's requests stay held
(their deadlines still expire them) until a heartbeat brings room.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from schemas.messages import EmbedRequest, GenerateRequest
from schemas.model_repo import ModelConfig
from schemas.registry import RegistryState, split_ref, version_problem
from services.batcher.queues import Held, ModelQueue

# Lower ranks are scheduled first.
PRIORITY_RANK: dict[str, int] = {"interactive": 0, "bulk": 1}

# Both kinds of request are planned alike, from the fields they share (request_id, model,
# priority, deadline_ms): an EmbedRequest counts as one request, however many inputs it holds.
Request = GenerateRequest | EmbedRequest

# Prompt tokens are estimated from characters (about 4 per token for English and code), per
# chat turn plus a few tokens of template.
CHARS_PER_TOKEN = 4
TOKENS_PER_TURN = 4
# Engines whose "KV blocks" are request slots (echo, onnx: see their stats()) advertise one block
# per request; a request to them costs one block of the worker's default size.
SLOT_COST_TOKENS = 16

# aiokafka's producer refuses records over 1 MiB (max_request_size); a Batch is kept below that.
DEFAULT_MAX_BATCH_BYTES = 900 * 1024
DEFAULT_MAX_RECENT = 100_000


class Admission(StrEnum):
    """What `Planner.add` did with a request; every verdict but HELD is final for that record."""

    HELD = "held"  # waiting in its model's lane; it leaves in a batch, expired, or cancelled
    DUPLICATE = "duplicate"  # its request_id is held or was finished recently: ignore the record
    UNKNOWN_MODEL = "unknown_model"  # its model does not resolve to a servable version: reject it
    EXPIRED = "expired"  # its deadline had passed on arrival: time it out
    CANCELLED = "cancelled"  # a cancellation for it arrived first: end it as cancelled


def resolve_ref(models: RegistryState, ref: str) -> tuple[ModelConfig | None, str | None]:
    """(the config of the version `ref` names, None) or (None, why not), like
    RegistryState.resolve, but a malformed ref (`name@`, `@1`, a version with spaces) is named as
    such instead of as an unregistered version."""
    name, version = split_ref(ref)
    if not name:
        return None, f"model {ref!r} names no model: send 'name' or 'name@version'"
    if version is not None and (problem := version_problem(version)) is not None:
        return None, f"model {ref!r} is not 'name@version': {problem}"
    return models.resolve(ref)


def cost_tokens(req: Request, config: ModelConfig) -> int:
    """What `req` is expected to hold in a worker's KV cache, in tokens: its prompt (estimated
    from characters) plus max_tokens, at most the model's max_model_len. Requests to engines
    without a KV cache (echo, onnx) cost one slot."""
    if config.engine != "torch" or isinstance(req, EmbedRequest):
        return SLOT_COST_TOKENS
    if req.prompt is not None:
        prompt_tokens = math.ceil(len(req.prompt) / CHARS_PER_TOKEN)
    elif req.prompt_token_ids is not None:
        prompt_tokens = len(req.prompt_token_ids)
    else:
        turns = req.messages or []
        prompt_tokens = sum(math.ceil(len(m.content) / CHARS_PER_TOKEN) + TOKENS_PER_TURN for m in turns)
    return max(1, min(prompt_tokens + req.max_tokens, config.max_model_len))


@dataclass(frozen=True)
class Slot:
    """Where a batch goes: a worker's partition and the tokens it has room for.

    worker_id/partition None: no heartbeat names the model, produce keyed (Kafka picks the
    partition); room_tokens None: no token bound.
    """

    worker_id: str | None = None
    partition: int | None = None
    room_tokens: int | None = None


UNBOUNDED = Slot()


@dataclass
class Reservation:
    """Tokens planned for a worker, counted against its room until one of its heartbeats shows
    it has read the batch (`next_offsets` past `offset`, set once Kafka acknowledged the batch)."""

    worker_id: str
    model: str
    partition: int
    num_tokens: int
    planned_ms: int
    offset: int | None = None


class Placement(Protocol):
    """Chooses a worker for the next batch of a model (routing.Router in production)."""

    def place(self, model: str, head: Request, cost_tokens: int, now_ms: int) -> Slot | None:
        """The slot for a batch led by `head` (which costs cost_tokens), or None when no live
        worker has room for it now."""
        ...

    def record(self, model: str, slot: Slot, num_tokens: int, now_ms: int) -> Reservation | None:
        """A batch of num_tokens was planned for `slot` at now_ms: count it against its room.
        Returns the reservation (whose offset the caller sets once the batch is produced)."""
        ...


@dataclass(frozen=True)
class PlannedBatch:
    """Requests of one model that leave together, in scheduling order, and where they go."""

    model: str
    requests: list[Request]
    slot: Slot = UNBOUNDED
    num_tokens: int = 0
    reservation: Reservation | None = None
    arrived_ms: tuple[int, ...] = ()  # when each request was held (the batcher's metrics: time held)


@dataclass(frozen=True)
class PlanResult:
    """What one `Planner.poll` decided: batches to publish and requests that timed out."""

    batches: list[PlannedBatch] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class BatchPolicy:
    """The bounds of one model's batches."""

    max_batch_size: int
    max_wait_ms: int
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES

    @classmethod
    def of(cls, config: ModelConfig, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> BatchPolicy:
        """The policy of a model repository entry."""
        return cls(config.max_batch_size, config.max_wait_ms, max_batch_bytes)

    def fits(self, num_requests: int, num_bytes: int, num_tokens: int, held: Held, room_tokens: int | None) -> bool:
        """Whether `held` may join a batch that already has num_requests using num_bytes and
        num_tokens, for a worker with room_tokens of room (None: unbounded).

        The first request always fits the byte budget, so an oversized one still leaves (alone);
        the token room is never exceeded (the placement only offers a slot the head fits).
        """
        if room_tokens is not None and num_tokens + held.cost_tokens > room_tokens:
            return False
        if num_requests == 0:
            return True
        return num_requests < self.max_batch_size and num_bytes + held.size_bytes <= self.max_batch_bytes


class _RecentIds:
    """A bounded set of request ids, forgetting the oldest first."""

    def __init__(self, max_size: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._max_size = max_size

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._max_size:
            self._ids.popitem(last=False)

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)


class _Lane:
    """One model's waiting requests (a ModelQueue) and its batch bounds."""

    def __init__(self, config: ModelConfig, policy: BatchPolicy) -> None:
        self.config = config
        self.policy = policy
        self.queue = ModelQueue(config)
        self.is_blocked = False  # the last poll found no worker with room

    @property
    def held(self) -> dict[str, Held]:
        return self.queue.held

    def is_due(self, now_ms: int, room_tokens: int | None) -> bool:
        """Whether a batch closes now: the lane is full, its oldest request waited enough, or
        it holds as many tokens as the chosen worker has room for."""
        if not self.held:
            return False
        if len(self.held) >= self.policy.max_batch_size:
            return True
        if room_tokens is not None and self.queue.num_tokens >= room_tokens:
            return True
        return now_ms - self.queue.oldest_arrived_ms() >= self.policy.max_wait_ms

    def next_due_ms(self, now_ms: int) -> int:
        """The earliest time this lane needs a poll: a batch closes or a deadline passes.

        A blocked lane (no worker had room) waits for its first deadline; the batcher polls
        again on every round anyway, after reading heartbeats.
        """
        first_deadline = self.queue.first_deadline_ms()
        if self.is_blocked:
            return first_deadline
        if len(self.held) >= self.policy.max_batch_size:
            return now_ms
        return min(self.queue.oldest_arrived_ms() + self.policy.max_wait_ms, first_deadline)

    def drop_expired(self, now_ms: int) -> list[Request]:
        gone = [rid for rid, h in self.held.items() if h.request.deadline_ms <= now_ms]
        return [held.request for rid in gone if (held := self.queue.remove(rid)) is not None]

    def take_batch(self, room_tokens: int | None) -> tuple[list[Held], int]:
        """Remove and return the next batch and its tokens: requests in scheduling order while
        they fit."""
        chosen: list[Held] = []
        num_bytes = num_tokens = 0
        while (head := self.queue.peek()) is not None:
            if not self.policy.fits(len(chosen), num_bytes, num_tokens, head, room_tokens):
                break
            held = self.queue.pop()
            chosen.append(held)
            num_bytes += held.size_bytes
            num_tokens += held.cost_tokens
        return chosen, num_tokens


class Planner:
    """Forms per-model batches from requests; see the module docstring for the rules.

    The planner never loses a request silently: each one added leaves through exactly one of
    poll (batched or expired), cancel, or release.
    """

    def __init__(
        self,
        models: RegistryState,
        *,
        max_recent: int = DEFAULT_MAX_RECENT,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        self.models = models  # followed by the caller: versions registered later resolve too
        self._max_batch_bytes = max_batch_bytes
        self._lanes: dict[str, _Lane] = {}
        self._lane_of: dict[str, str] = {}  # request_id -> served_id, for held requests
        self._recent = _RecentIds(max_recent)  # finished here: batched, expired, rejected, cancelled
        self._cancelled_early = _RecentIds(max_recent)  # cancels that arrived before their request
        self._num_arrivals = 0

    @property
    def num_held(self) -> int:
        """How many requests wait in lanes."""
        return len(self._lane_of)

    def is_held(self, request_id: str) -> bool:
        """Whether `request_id` waits in a lane."""
        return request_id in self._lane_of

    def blocked_models(self) -> list[str]:
        """Versions (served_ids) whose requests wait because no worker had room at the last poll."""
        return [model for model, lane in self._lanes.items() if lane.is_blocked and lane.held]

    def is_live_blocked(self) -> bool:
        """Whether an interactive request waits because no worker had room at the last poll: the
        batcher is loaded, and drops its mirror copies first (docs/design.md, "Traffic policies")."""
        return any(
            lane.is_blocked and any(h.request.priority == "interactive" for h in lane.held.values())
            for lane in self._lanes.values()
        )

    def waiting(self) -> dict[tuple[str, str], int]:
        """How many requests wait per (lane, tenant): the batcher's queue-depth gauge."""
        counts: dict[tuple[str, str], int] = {}
        for lane in self._lanes.values():
            for held in lane.held.values():
                key = (held.request.priority, held.request.tenant)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def held_models(self) -> list[str]:
        """Versions (served_ids) that have requests waiting."""
        return [model for model, lane in self._lanes.items() if lane.held]

    def resolve(self, ref: str) -> tuple[ModelConfig | None, str | None]:
        """The version `ref` resolves to now, or why it does not (resolve_ref)."""
        return resolve_ref(self.models, ref)

    def add(self, req: Request, now_ms: int, *, size_bytes: int = 0) -> Admission:
        """Admit a request that arrived at now_ms; returns the verdict (see Admission). A held
        request is pinned: it waits, and leaves, with `model` set to the served_id it resolved to.

        size_bytes is its encoded size, counted against the batch byte budget.
        """
        rid = req.request_id
        if rid in self._lane_of or rid in self._recent:
            return Admission.DUPLICATE
        verdict, config = self._verdict(req, now_ms)
        if verdict is not Admission.HELD:
            self._recent.add(rid)
            return verdict
        assert config is not None  # _verdict resolved it
        served_id = config.served_id
        if req.model != served_id:
            req = req.model_copy(update={"model": served_id})
        lane = self._lanes.get(served_id)
        if lane is None:
            lane = self._lanes[served_id] = _Lane(config, BatchPolicy.of(config, self._max_batch_bytes))
        self._num_arrivals += 1
        lane.queue.add(Held(req, now_ms, self._num_arrivals, size_bytes, cost_tokens(req, config)))
        self._lane_of[rid] = served_id
        return Admission.HELD

    def _verdict(self, req: Request, now_ms: int) -> tuple[Admission, ModelConfig | None]:
        if req.request_id in self._cancelled_early:
            self._cancelled_early.discard(req.request_id)
            return Admission.CANCELLED, None
        config, _ = self.resolve(req.model)
        if config is None:
            return Admission.UNKNOWN_MODEL, None
        if req.deadline_ms <= now_ms:
            return Admission.EXPIRED, config
        return Admission.HELD, config

    def drop_model(self, served_id: str) -> list[Request]:
        """Remove every held request of version `served_id` and return them: the caller ends them
        (its version cannot be served). They count as finished here, like batched ones."""
        lane = self._lanes.get(served_id)
        gone = [] if lane is None else list(lane.held)
        out = [self._remove(rid) for rid in gone]
        for rid in gone:
            self._recent.add(rid)
        return [req for req in out if req is not None]

    def cancel(self, request_id: str) -> Request | None:
        """Drop a held request and return it (the caller ends it as cancelled); else None.

        A cancel for a request not seen yet is remembered, so the request is refused on arrival.
        A cancel for one already batched is the worker's to handle.
        """
        req = self._remove(request_id)
        if req is not None:
            self._recent.add(request_id)
        elif request_id not in self._recent:
            self._cancelled_early.add(request_id)
        return req

    def drop(self, request_id: str) -> Request | None:
        """Drop a held request and return it (the caller ends it: a mirror copy shed under
        load); it counts as finished here. None when not held."""
        req = self._remove(request_id)
        if req is not None:
            self._recent.add(request_id)
        return req

    def release(self, request_id: str) -> Request | None:
        """Drop a held request without any verdict, because its record will be delivered again
        (its partition moved to another batcher). Returns it, or None when not held."""
        return self._remove(request_id)

    def _remove(self, request_id: str) -> Request | None:
        model = self._lane_of.pop(request_id, None)
        if model is None:
            return None
        held = self._lanes[model].queue.remove(request_id)
        assert held is not None
        return held.request

    def poll(self, now_ms: int, placement: Placement | None = None) -> PlanResult:
        """Close every batch that is due at now_ms and drop expired requests.

        Called whenever next_wakeup_ms comes, and after new requests arrive or heartbeats change
        the workers' room. Without a placement batches are unbounded in tokens and unrouted.
        Batches are returned in scheduling order (by their first request).
        """
        result = PlanResult()
        keyed: list[tuple[tuple[int, int], PlannedBatch]] = []
        for model, lane in self._lanes.items():
            result.expired.extend(lane.drop_expired(now_ms))
            batches = self._close_batches(model, lane, now_ms, placement)
            for batch in batches:
                # A fifo model's batches all take the key of its first one, so the stable sort
                # keeps them in arrival order.
                head = (batches[0] if lane.queue.is_fifo else batch).requests[0]
                keyed.append(((PRIORITY_RANK[head.priority], head.deadline_ms), batch))
        keyed.sort(key=lambda kb: kb[0])
        result.batches.extend(batch for _, batch in keyed)
        for req in result.expired:
            self._finish(req.request_id)
        for batch in result.batches:
            for req in batch.requests:
                self._finish(req.request_id)
        return result

    def _close_batches(self, model: str, lane: _Lane, now_ms: int, placement: Placement | None) -> list[PlannedBatch]:
        batches: list[PlannedBatch] = []
        lane.is_blocked = False
        while (head := lane.queue.peek()) is not None:
            slot = UNBOUNDED if placement is None else placement.place(model, head.request, head.cost_tokens, now_ms)
            if slot is None:
                lane.is_blocked = True
                break
            if not lane.is_due(now_ms, slot.room_tokens):
                break
            taken, num_tokens = lane.take_batch(slot.room_tokens)
            if not taken:  # the placement offered less room than the head needs
                lane.is_blocked = True
                break
            reservation = None if placement is None else placement.record(model, slot, num_tokens, now_ms)
            requests = [held.request for held in taken]
            arrived = tuple(held.arrived_ms for held in taken)
            batches.append(PlannedBatch(model, requests, slot, num_tokens, reservation, arrived))
        return batches

    def _finish(self, request_id: str) -> None:
        del self._lane_of[request_id]
        self._recent.add(request_id)

    def next_wakeup_ms(self, now_ms: int) -> int | None:
        """When poll must be called next (epoch ms, possibly <= now_ms), or None when idle."""
        due = [lane.next_due_ms(now_ms) for lane in self._lanes.values() if lane.held]
        return min(due) if due else None
