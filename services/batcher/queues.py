"""One model's waiting requests and the order they leave in: priority lanes, fair queuing, EDF.

Pure and synchronous, like the planner that owns one `ModelQueue` per model.

    ModelQueue ── lane "interactive" ── tenant queues (each EDF: earliest deadline, then arrival)
               └─ lane "bulk"        ── tenant queues

The next request is chosen in three steps:

1. Lane. `strict`: interactive whenever it holds anything. `weighted`: the lanes share the tokens
   by weight (interactive 1.0, bulk `bulk_weight`) with the same fair queuing as tenants (2.).
2. Tenant, within the lane: start-time fair queuing on token cost. Each tenant has a virtual
   finish time; its head request would finish at max(tenant finish, lane virtual time) +
   cost / weight, and the tenant whose head finishes first goes (ties: earliest deadline, then
   arrival). The lane's virtual time moves to the start tag of what was served, so a tenant that
   was idle starts level with the others instead of with banked credit, and a flood from one
   tenant only delays the others by one request each turn.
3. Request, within the tenant: earliest deadline first, then arrival.

`fifo` skips all three: one queue in arrival order, whatever the priority, tenant or deadline
(expired requests are still dropped by the planner). It is the order a plain Kafka consumer
gives, kept as the baseline the lanes are measured against (`weir bench batcher`).

Costs are in tokens (`cost_tokens`): the estimate of what the request will hold in a worker's
KV cache, see `planner.cost_tokens`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from schemas.messages import EmbedRequest, GenerateRequest
from schemas.model_repo import ModelConfig

Request = GenerateRequest | EmbedRequest

LANES = ("interactive", "bulk")


@dataclass
class Held:
    """A waiting request: the wire message plus the planner's state about it."""

    request: Request
    arrived_ms: int
    arrival: int  # arrival counter: breaks ties so order is stable
    size_bytes: int
    cost_tokens: int


@dataclass
class _FairShare:
    """Fair-queuing state of one flow (a tenant in a lane, or a lane in a model).

    A flow's next request starts at the finish tag of its previous one while the flow stays
    backlogged; a flow that becomes backlogged starts at max(its finish, virtual time).
    """

    finish: float = 0.0
    next_start: float = 0.0
    num_waiting: int = 0

    def on_add(self, vtime: float) -> None:
        if self.num_waiting == 0:
            self.next_start = max(self.finish, vtime)
        self.num_waiting += 1

    def on_pop(self, finish: float) -> None:
        self.finish = self.next_start = finish


@dataclass
class _TenantQueue:
    """One tenant's requests in one lane, earliest deadline first (lazy deletion)."""

    heap: list[tuple[int, int, str]] = field(default_factory=list)  # (deadline_ms, arrival, request_id)
    share: _FairShare = field(default_factory=_FairShare)

    def head(self, held: dict[str, Held]) -> Held | None:
        while self.heap and self.heap[0][2] not in held:
            heapq.heappop(self.heap)  # left by a cancel, an expiry or a release
        return held[self.heap[0][2]] if self.heap else None


@dataclass(frozen=True)
class _Choice:
    """The next request and the fair-queuing tags its dequeue sets."""

    held: Held
    lane: str
    tenant: str
    lane_start: float
    lane_finish: float
    tenant_start: float
    tenant_finish: float


class ModelQueue:
    """Every request waiting for one model, with its lanes and tenant queues."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.is_fifo = config.lane_policy == "fifo"  # arrival order only: no lanes, tenants or EDF
        self.held: dict[str, Held] = {}  # insertion order = arrival order
        self.num_tokens = 0  # sum of cost_tokens of held requests
        self._tenants: dict[str, dict[str, _TenantQueue]] = {lane: {} for lane in LANES}
        self._lane_share = {lane: _FairShare() for lane in LANES}
        self._vtime = dict.fromkeys(LANES, 0.0)  # per lane: tenants' virtual time
        self._model_vtime = 0.0  # lanes' virtual time (weighted policy)

    def add(self, held: Held) -> None:
        req = held.request
        self.held[req.request_id] = held
        self.num_tokens += held.cost_tokens
        if self.is_fifo:
            return
        lane = self._lane_share[req.priority]
        lane.on_add(self._model_vtime)
        tenants = self._tenants[req.priority]
        queue = tenants.setdefault(req.tenant, _TenantQueue())
        queue.share.on_add(self._vtime[req.priority])
        heapq.heappush(queue.heap, (req.deadline_ms, held.arrival, req.request_id))
        if len(queue.heap) > 64 and len(queue.heap) > 4 * len(self.held):  # many stale entries
            queue.heap = [e for e in queue.heap if e[2] in self.held]
            heapq.heapify(queue.heap)

    def remove(self, request_id: str) -> Held | None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.num_tokens -= held.cost_tokens
            if self.is_fifo:
                return held
            req = held.request
            self._lane_share[req.priority].num_waiting -= 1
            self._tenants[req.priority][req.tenant].share.num_waiting -= 1
        return held

    def oldest_arrived_ms(self) -> int:
        return next(iter(self.held.values())).arrived_ms

    def first_deadline_ms(self) -> int:
        return min(h.request.deadline_ms for h in self.held.values())

    def peek(self) -> Held | None:
        """The request that would leave next, or None when empty."""
        if self.is_fifo:
            return next(iter(self.held.values()), None)
        choice = self._choose()
        return choice.held if choice else None

    def pop(self) -> Held:
        """Remove and return the next request; advances the fair-queuing clocks."""
        if self.is_fifo:
            assert self.held, "pop from an empty ModelQueue"
            held = self.remove(next(iter(self.held)))
            assert held is not None
            return held
        choice = self._choose()
        assert choice is not None, "pop from an empty ModelQueue"
        self._lane_share[choice.lane].on_pop(choice.lane_finish)
        self._model_vtime = choice.lane_start
        self._tenants[choice.lane][choice.tenant].share.on_pop(choice.tenant_finish)
        self._vtime[choice.lane] = choice.tenant_start
        removed = self.remove(choice.held.request.request_id)
        assert removed is not None
        self._forget_idle_tenants(choice.lane)
        return choice.held

    def _choose(self) -> _Choice | None:
        heads = {lane: head for lane in LANES if (head := self._head_of_lane(lane)) is not None}
        candidates = [lane for lane in LANES if lane in heads]
        if not candidates:
            return None
        if self.config.lane_policy == "strict":
            lane = candidates[0]  # LANES is in priority order
            tenant, held, t_start, t_finish = heads[lane]
            return _Choice(held, lane, tenant, 0.0, 0.0, t_start, t_finish)
        best: _Choice | None = None
        for lane in candidates:
            tenant, held, t_start, t_finish = heads[lane]
            start = self._lane_share[lane].next_start
            finish = start + held.cost_tokens / self._lane_weight(lane)
            choice = _Choice(held, lane, tenant, start, finish, t_start, t_finish)
            if best is None or (finish, held.request.deadline_ms, held.arrival) < (
                best.lane_finish,
                best.held.request.deadline_ms,
                best.held.arrival,
            ):
                best = choice
        return best

    def _head_of_lane(self, lane: str) -> tuple[str, Held, float, float] | None:
        """(tenant, its head request, start tag, finish tag) of the tenant that goes next in `lane`."""
        best: tuple[str, Held, float, float] | None = None
        for tenant, queue in self._tenants[lane].items():
            held = queue.head(self.held)
            if held is None:
                continue
            start = queue.share.next_start
            finish = start + held.cost_tokens / self.config.tenant_weights.get(tenant, 1.0)
            if best is None or (finish, held.request.deadline_ms, held.arrival) < (
                best[3],
                best[1].request.deadline_ms,
                best[1].arrival,
            ):
                best = (tenant, held, start, finish)
        return best

    def _lane_weight(self, lane: str) -> float:
        return 1.0 if lane == "interactive" else self.config.bulk_weight

    def _forget_idle_tenants(self, lane: str) -> None:
        """Drop tenants with nothing waiting whose finish tag is behind: they would start at the
        lane's virtual time anyway, so forgetting them changes no order (and bounds memory)."""
        tenants = self._tenants[lane]
        for tenant in [t for t, q in tenants.items() if q.share.num_waiting == 0]:
            if tenants[tenant].share.finish <= self._vtime[lane]:
                del tenants[tenant]
