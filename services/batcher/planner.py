"""The batching planner: admission and scheduling of requests into per-model batches.

Pure and synchronous: no I/O, no clock of its own, no sleeps. The caller passes `now_ms` (epoch
milliseconds, the unit of deadline_ms) to every call that depends on time, so the
planner is tested with explicit time and driven by the batcher's Kafka loop in production.

Per model a lane holds waiting requests. A lane closes a batch when it holds max_batch_size
requests, or when its oldest request has waited max_wait_ms (both from the model repository).
Within a lane, requests are ordered by priority (interactive before bulk), then earliest deadline,
then arrival. Expired requests are dropped and reported, never batched.

Extension points: BatchPolicy.fits is where a token budget goes; _Held.sort_key is where weighted
fair queuing per tenant goes (a virtual finish time instead of the deadline); PlannedBatch is
where a routing target (a worker chosen from heartbeats) goes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from schemas.messages import EmbedRequest, GenerateRequest
from schemas.model_repo import ModelConfig, ModelRepository

# Lower ranks are scheduled first.
PRIORITY_RANK: dict[str, int] = {"interactive": 0, "bulk": 1}

# Both kinds of request are planned alike, from the fields they share (request_id, model,
# priority, deadline_ms): an EmbedRequest counts as one request, however many inputs it holds.
Request = GenerateRequest | EmbedRequest

# aiokafka's producer refuses records over 1 MiB (max_request_size); a Batch is kept below that.
DEFAULT_MAX_BATCH_BYTES = 900 * 1024
DEFAULT_MAX_RECENT = 100_000


class Admission(StrEnum):
    """What `Planner.add` did with a request; every verdict but HELD is final for that record."""

    HELD = "held"  # waiting in its model's lane; it leaves in a batch, expired, or cancelled
    DUPLICATE = "duplicate"  # its request_id is held or was finished recently: ignore the record
    UNKNOWN_MODEL = "unknown_model"  # the model repository does not serve its model: reject it
    EXPIRED = "expired"  # its deadline had passed on arrival: time it out
    CANCELLED = "cancelled"  # a cancellation for it arrived first: end it as cancelled


@dataclass(frozen=True)
class PlannedBatch:
    """Requests of one model that leave together, in scheduling order."""

    model: str
    requests: list[Request]


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

    def fits(self, num_requests: int, num_bytes: int, held: _Held) -> bool:
        """Whether `held` may join a batch that already has num_requests using num_bytes.

        The first request always fits, so an oversized one still leaves (alone).
        """
        if num_requests == 0:
            return True
        return num_requests < self.max_batch_size and num_bytes + held.size_bytes <= self.max_batch_bytes


@dataclass
class _Held:
    """A waiting request: the wire message plus the planner's state about it."""

    request: Request
    arrived_ms: int
    arrival: int  # arrival counter: breaks ties so order is stable
    size_bytes: int

    def sort_key(self) -> tuple[int, int, int]:
        return (PRIORITY_RANK[self.request.priority], self.request.deadline_ms, self.arrival)


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
    """One model's waiting requests."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self.held: dict[str, _Held] = {}

    def is_due(self, now_ms: int) -> bool:
        """Whether a batch closes now: the lane is full, or its oldest request waited enough."""
        if not self.held:
            return False
        if len(self.held) >= self.policy.max_batch_size:
            return True
        return now_ms - self.oldest_arrived_ms() >= self.policy.max_wait_ms

    def oldest_arrived_ms(self) -> int:
        return min(h.arrived_ms for h in self.held.values())

    def next_due_ms(self, now_ms: int) -> int:
        """The earliest time this lane needs a poll: a batch closes or a deadline passes."""
        if len(self.held) >= self.policy.max_batch_size:
            return now_ms
        first_deadline = min(h.request.deadline_ms for h in self.held.values())
        return min(self.oldest_arrived_ms() + self.policy.max_wait_ms, first_deadline)

    def drop_expired(self, now_ms: int) -> list[Request]:
        gone = [rid for rid, h in self.held.items() if h.request.deadline_ms <= now_ms]
        return [self.held.pop(rid).request for rid in gone]

    def take_batch(self) -> list[Request]:
        """Remove and return the next batch: the first requests in scheduling order that fit."""
        chosen: list[_Held] = []
        num_bytes = 0
        for held in sorted(self.held.values(), key=_Held.sort_key):
            if not self.policy.fits(len(chosen), num_bytes, held):
                break
            chosen.append(held)
            num_bytes += held.size_bytes
        for held in chosen:
            del self.held[held.request.request_id]
        return [h.request for h in chosen]


class Planner:
    """Forms per-model batches from requests; see the module docstring for the rules.

    The planner never loses a request silently: each one added leaves through exactly one of
    poll (batched or expired), cancel, or release.
    """

    def __init__(
        self,
        repo: ModelRepository,
        *,
        max_recent: int = DEFAULT_MAX_RECENT,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        self._repo = repo
        self._max_batch_bytes = max_batch_bytes
        self._lanes: dict[str, _Lane] = {}
        self._lane_of: dict[str, str] = {}  # request_id -> model, for held requests
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

    def add(self, req: Request, now_ms: int, *, size_bytes: int = 0) -> Admission:
        """Admit a request that arrived at now_ms; returns the verdict (see Admission).

        size_bytes is its encoded size, counted against the batch byte budget.
        """
        rid = req.request_id
        if rid in self._lane_of or rid in self._recent:
            return Admission.DUPLICATE
        verdict = self._verdict(req, now_ms)
        if verdict is not Admission.HELD:
            self._recent.add(rid)
            return verdict
        lane = self._lanes.get(req.model)
        if lane is None:
            config = self._repo.get(req.model)
            assert config is not None  # _verdict checked it
            lane = self._lanes[req.model] = _Lane(BatchPolicy.of(config, self._max_batch_bytes))
        self._num_arrivals += 1
        lane.held[rid] = _Held(req, now_ms, self._num_arrivals, size_bytes)
        self._lane_of[rid] = req.model
        return Admission.HELD

    def _verdict(self, req: Request, now_ms: int) -> Admission:
        if req.request_id in self._cancelled_early:
            self._cancelled_early.discard(req.request_id)
            return Admission.CANCELLED
        if self._repo.get(req.model) is None:
            return Admission.UNKNOWN_MODEL
        if req.deadline_ms <= now_ms:
            return Admission.EXPIRED
        return Admission.HELD

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

    def release(self, request_id: str) -> Request | None:
        """Drop a held request without any verdict, because its record will be delivered again
        (its partition moved to another batcher). Returns it, or None when not held."""
        return self._remove(request_id)

    def _remove(self, request_id: str) -> Request | None:
        model = self._lane_of.pop(request_id, None)
        if model is None:
            return None
        return self._lanes[model].held.pop(request_id).request

    def poll(self, now_ms: int) -> PlanResult:
        """Close every batch that is due at now_ms and drop expired requests.

        Called whenever next_wakeup_ms comes, and after new requests arrive. Batches are returned
        in scheduling order (by their first request).
        """
        result = PlanResult()
        for model, lane in self._lanes.items():
            result.expired.extend(lane.drop_expired(now_ms))
            while lane.is_due(now_ms):
                result.batches.append(PlannedBatch(model, lane.take_batch()))
        result.batches.sort(key=lambda b: (PRIORITY_RANK[b.requests[0].priority], b.requests[0].deadline_ms))
        for req in result.expired:
            self._finish(req.request_id)
        for batch in result.batches:
            for req in batch.requests:
                self._finish(req.request_id)
        return result

    def _finish(self, request_id: str) -> None:
        del self._lane_of[request_id]
        self._recent.add(request_id)

    def next_wakeup_ms(self, now_ms: int) -> int | None:
        """When poll must be called next (epoch ms, possibly <= now_ms), or None when idle."""
        due = [lane.next_due_ms(now_ms) for lane in self._lanes.values() if lane.held]
        return min(due) if due else None
