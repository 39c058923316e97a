"""Routing: which worker, and which of its partitions, a batch goes to. Pure; time passed in.

The batcher reads every WorkerHeartbeat (the compacted workers topic, from the beginning) into a
`Router`. Models are routed by version, `name@version` (a "served_id"; docs/design.md, invariant 10):
a worker is routable for a served_id when its latest heartbeat reports `versions[served_id].state == "ready"`,
lists partitions of the served_id's batch topic that it owns, and is younger than `worker_timeout_ms`
(by its `sent_ms`). When no worker has the served_id ready, one that has it "draining" (its version was
unloaded or replaced by a promotion, and it still reads its topic) takes the requests pinned to
it. A heartbeat without `versions` (a worker from before the registry) is routable for no served_id:
such a worker reads a bare-name topic the batcher no longer writes. `version_problem` says when a
served_id cannot be served at all (failed or refused on every live worker that reports it); the
batcher rejects its requests instead of holding them to their deadline. Its room is what the heartbeat advertises
(free_kv_blocks x block_size_tokens) less the tokens of the batches planned for it that the
worker had not read when it sent the heartbeat: a reservation is dropped once a heartbeat's
`next_offsets` for its partition passes the batch's offset, or the partition is no longer the
worker's (its next owner reads it). A heartbeat without `next_offsets` for the model drops the
reservations planned before its `sent_ms`.

Prefix affinity: the head request's prefix (a chat's system message, else the first
`prefix_chars` characters of its text) is hashed over the model's live workers by rendezvous
hashing, so requests sharing a prefix go to the worker that has it cached, and only the prefixes
of a worker that leaves move. When that worker has no room for the head, the batch goes to the
live worker with the most room instead; when none has room for the head, an idle worker (nothing
running, waiting or planned) takes it alone, so an underestimated room never stalls a model. A version that no heartbeat has
ever named, where no heartbeat reports `versions` (no worker yet, or only workers from before the
registry), is routed without a partition (UNBOUNDED: keyed, Kafka picks), so a deployment without
heartbeats still works; otherwise a version no worker has ready or draining (stale, full, still
loading, or loaded nowhere) is held.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from schemas.messages import EmbedRequest, GenerateRequest, WorkerHeartbeat
from services.batcher.planner import UNBOUNDED, Reservation, Slot

Request = GenerateRequest | EmbedRequest

DEFAULT_PREFIX_CHARS = 256


def prefix_key(req: Request, max_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The part of a request that decides its affinity: the system message of a chat, else the
    first max_chars characters of its text."""
    if isinstance(req, EmbedRequest):
        return req.inputs[0][:max_chars]
    if req.messages is not None:
        system = [m.content for m in req.messages if m.role == "system"]
        if system:
            return system[0][:max_chars]
        return req.messages[0].content[:max_chars] if req.messages else ""
    return (req.prompt or "")[:max_chars]


def _score(key: str, worker_id: str) -> int:
    """Rendezvous weight of a worker for a key: the highest one wins."""
    return int.from_bytes(hashlib.blake2b(f"{worker_id}\0{key}".encode(), digest_size=8).digest(), "big")


@dataclass
class _Worker:
    """The latest heartbeat of one worker and what was planned for it since."""

    heartbeat: WorkerHeartbeat
    planned: list[Reservation] = field(default_factory=list)  # not yet read by the worker

    def room_tokens(self) -> int:
        hb = self.heartbeat
        return hb.free_kv_blocks * hb.block_size_tokens - sum(r.num_tokens for r in self.planned)

    def is_idle(self) -> bool:
        """Nothing runs or waits on the worker, and nothing planned for it is unread."""
        hb = self.heartbeat
        return hb.num_running == 0 and hb.num_waiting == 0 and not self.planned

    def is_reflected(self, r: Reservation) -> bool:
        """Whether the current heartbeat already counts reservation r (or r is not this worker's)."""
        hb = self.heartbeat
        next_offsets = hb.next_offsets.get(r.model)
        if next_offsets is None:  # a worker that reports no read positions: go by time
            return r.planned_ms <= hb.sent_ms
        if r.offset is None:  # not acknowledged by Kafka yet: the worker cannot have read it
            return False
        if r.partition not in hb.partitions.get(r.model, []):
            return True  # the partition moved: its next owner reads the batch
        return next_offsets.get(r.partition, 0) > r.offset

    def is_fresh(self, now_ms: int, timeout_ms: int) -> bool:
        return now_ms - self.heartbeat.sent_ms <= timeout_ms

    def state_of(self, served_id: str) -> str | None:
        """What the heartbeat says version `served_id` does on this worker (None: it does not report it)."""
        status = self.heartbeat.versions.get(served_id)
        return None if status is None else status.state

    def is_live(self, served_id: str, now_ms: int, timeout_ms: int, state: str = "ready") -> bool:
        """Fresh, reports `served_id` in `state`, and owns partitions of its topic."""
        hb = self.heartbeat
        return (
            self.state_of(served_id) == state
            and bool(hb.partitions.get(served_id))
            and self.is_fresh(now_ms, timeout_ms)
        )


class Router:
    """The live-worker table of one batcher, and the choice of a slot for each batch.

    Implements planner.Placement. Each batcher replica counts only the batches it sent itself.
    """

    def __init__(self, *, worker_timeout_ms: int, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> None:
        self.worker_timeout_ms = worker_timeout_ms
        self.prefix_chars = prefix_chars
        self._workers: dict[str, _Worker] = {}

    def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        """Take a worker's heartbeat, unless a newer one of it is known already."""
        worker = self._workers.get(hb.worker_id)
        if worker is None:
            self._workers[hb.worker_id] = _Worker(hb)
            return
        if hb.sent_ms < worker.heartbeat.sent_ms:
            return
        worker.heartbeat = hb
        worker.planned = [r for r in worker.planned if not worker.is_reflected(r)]

    @property
    def num_workers(self) -> int:
        """Workers with a heartbeat in the table, live or not."""
        return len(self._workers)

    def knows(self, served_id: str) -> bool:
        """Whether heartbeats decide where `served_id` goes: one (live or not) names it, or one reports
        `versions` at all. Workers that report versions announce each one they serve, so a
        version none of them reports ready is held (by the batcher, until its deadline), never
        sent to a topic that nobody may read again (a version drained everywhere)."""
        return any(w.heartbeat.versions or served_id in w.heartbeat.models for w in self._workers.values())

    def live_workers(self, served_id: str, now_ms: int, state: str = "ready") -> list[str]:
        """Ids of the workers whose fresh heartbeat has `served_id` in `state` and owns partitions of it."""
        timeout = self.worker_timeout_ms
        return sorted(wid for wid, w in self._workers.items() if w.is_live(served_id, now_ms, timeout, state))

    def routable_workers(self, served_id: str, now_ms: int) -> list[str]:
        """The workers batches of `served_id` may go to now: those that have it ready, else those
        draining it (requests pinned to a version just before a promotion moved its name on)."""
        return self.live_workers(served_id, now_ms) or self.live_workers(served_id, now_ms, "draining")

    def version_problem(self, served_id: str, now_ms: int) -> str | None:
        """Why `served_id` cannot be served, or None: every fresh heartbeat that reports it says failed
        or refused (at least one does), and none has it ready or draining. The reason names each
        worker and what it said, so the client learns why (e.g. a file that did not verify)."""
        said: list[str] = []
        for wid, worker in sorted(self._workers.items()):
            state = worker.state_of(served_id)
            if state is None or not worker.is_fresh(now_ms, self.worker_timeout_ms):
                continue
            if state not in ("failed", "refused"):
                return None  # loading, ready, draining...: it may yet be served
            said.append(f"{state} on {wid}: {worker.heartbeat.versions[served_id].reason or 'no reason given'}")
        return f"model version {served_id!r} cannot be served: " + "; ".join(said) if said else None

    def room_tokens(self, worker_id: str) -> int:
        """The room left on a worker, in tokens (may be negative after a stale heartbeat)."""
        return self._workers[worker_id].room_tokens()

    def place(self, model: str, head: Request, cost_tokens: int, now_ms: int) -> Slot | None:
        """The slot for a batch of version `model` (a served_id) led by `head`: its prefix's worker when
        it has room for the head, else the routable worker with the most room; None when none has
        room (the batch waits)."""
        if not self.knows(model):
            return UNBOUNDED
        live = self.routable_workers(model, now_ms)
        if not live:
            return None
        key = prefix_key(head, self.prefix_chars)
        preferred = max(live, key=lambda wid: _score(key, wid))
        if self.room_tokens(preferred) >= cost_tokens:
            chosen = preferred
        else:
            chosen = max(live, key=lambda wid: (self.room_tokens(wid), wid))
            if self.room_tokens(chosen) < cost_tokens:
                idle = [wid for wid in live if self._workers[wid].is_idle()]
                if not idle:
                    return None
                # Progress over precision: an idle worker takes the head alone even when its
                # estimate exceeds the advertised room (its engine preempts or refuses it).
                chosen = max(idle, key=lambda wid: _score(key, wid))
                return self._slot(model, chosen, key, cost_tokens)
        return self._slot(model, chosen, key, self.room_tokens(chosen))

    def _slot(self, model: str, worker_id: str, key: str, room_tokens: int) -> Slot:
        partitions = sorted(self._workers[worker_id].heartbeat.partitions[model])
        return Slot(worker_id, partitions[_score(key, model) % len(partitions)], room_tokens)

    def record(self, model: str, slot: Slot, num_tokens: int, now_ms: int) -> Reservation | None:
        """Count a batch planned for slot's worker at now_ms against its room; returns the
        reservation, whose offset the batcher sets once Kafka acknowledged the batch."""
        if slot.worker_id is None or slot.partition is None or slot.worker_id not in self._workers:
            return None
        reservation = Reservation(slot.worker_id, model, slot.partition, num_tokens, now_ms)
        self._workers[slot.worker_id].planned.append(reservation)
        return reservation
