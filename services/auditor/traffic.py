"""Traffic counts and the canary guard of the auditor (docs/design.md, "Traffic policies").

The auditor sees every answered request once, in its ledger (a redelivered event is not new), so
it is where a name's traffic is counted: requests per version and assignment, and errors
(finish_reason "error" or "timeout": a version that hangs until its requests' deadlines is failing
too). TrafficCounter starts from the ledger (counts since the ledger began,
so a restart loses nothing) and adds each new record; the app's timer publishes the names that
changed as TrafficCounts on the compacted Topics.traffic, key = name (`weir models show`).

The canary guard watches each version's last `min_requests` live requests (mirror copies are not
traffic of the version's own: their errors are the comparison's business). When a version that is
a canary of its name errs on more than `max_error_rate` of them, or a worker reports its golden
check failed (Topics.model_health), the guard writes the name's route with that canary at 0%
(weir.registry.set_route: the rest of the policy stays) and a ModelHealthEvent "canary_stopped"
saying why. Its window starts empty at each start and after each stop: only requests served
while it runs count against a canary.

One auditor replica is assumed: with several, each would count only its partitions of the audit
topic and their TrafficCounts would overwrite each other's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from schemas.codec import DecodeError, decode, encode
from schemas.messages import AuditEvent
from schemas.registry import ModelHealthEvent, ModelRoute, ModelVersionRecord, RegistryState, TrafficCounts, split_ref
from schemas.topics import Topics
from weir.registry import RegistryError, set_route

log = logging.getLogger(__name__)

ERRORS = frozenset({"error", "timeout"})  # the finish_reasons counted as errors
UNASSIGNED = "unassigned"  # events of producers that record no assignment


class TrafficCounter:
    """name -> name@version -> assignment -> requests, and name -> name@version -> errors."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, dict[str, int]]] = {}
        self.errors: dict[str, dict[str, int]] = {}
        self.changed: set[str] = set()

    def add(self, model_version: str, assignment: str | None, finish_reason: str, n: int = 1) -> None:
        name = split_ref(model_version)[0]
        by_assignment = self.counts.setdefault(name, {}).setdefault(model_version, {})
        key = assignment or UNASSIGNED
        by_assignment[key] = by_assignment.get(key, 0) + n
        if finish_reason in ERRORS:
            errors = self.errors.setdefault(name, {})
            errors[model_version] = errors.get(model_version, 0) + n
        self.changed.add(name)

    def load(self, rows: Iterable[tuple[str, str | None, str, int]]) -> None:
        """Start from the ledger's (model_version, assignment, finish_reason, count) groups."""
        for model_version, assignment, finish_reason, n in rows:
            self.add(model_version, assignment, finish_reason, n)

    def observe(self, event: AuditEvent) -> None:
        """Count one new ledger record."""
        self.add(event.model_version, event.assignment, event.finish_reason)

    def snapshot(self, name: str) -> TrafficCounts:
        return TrafficCounts(
            name=name,
            counts={served_id: dict(a) for served_id, a in self.counts.get(name, {}).items()},
            errors=dict(self.errors.get(name, {})),
        )

    def take_changed(self) -> list[TrafficCounts]:
        """The counts of every name that changed since the last call."""
        out = [self.snapshot(name) for name in sorted(self.changed)]
        self.changed.clear()
        return out


class ErrorWindows:
    """Each version's last `size` live requests (True: it ended in error)."""

    def __init__(self, size: int, max_error_rate: float) -> None:
        if size < 1 or not 0 <= max_error_rate < 1:
            raise ValueError(f"need min_requests >= 1 and 0 <= max_error_rate < 1, not {size}, {max_error_rate}")
        self.size = size
        self.max_error_rate = max_error_rate
        self.windows: dict[str, deque[bool]] = {}

    def observe(self, event: AuditEvent) -> str | None:
        """Why `event`'s version should stop being a canary (its window is full and errs more than the
        bound), or None. Mirror copies are not counted."""
        if event.shadow_of is not None or event.assignment == "mirror":
            return None
        window = self.windows.setdefault(event.model_version, deque(maxlen=self.size))
        window.append(event.finish_reason in ERRORS)
        if len(window) < self.size:
            return None
        rate = sum(window) / len(window)
        if rate <= self.max_error_rate:
            return None
        return f"error rate {rate:.0%} over its last {len(window)} requests passes the bound {self.max_error_rate:.0%}"

    def reset(self, served_id: str) -> None:
        self.windows.pop(served_id, None)


def stop_canary(state: RegistryState, served_id: str, why: str, by: str) -> list[ModelVersionRecord | ModelRoute]:
    """The route record that takes canary `served_id` to 0% (the rest of the policy kept), or [] when
    `served_id` is no canary with a share above 0. RegistryError when set_route refuses the policy."""
    name, version = split_ref(served_id)
    route = state.routes.get(name)
    if version is None or route is None or route.canary.get(version, 0) <= 0:
        return []
    return set_route(
        state, name, by, canary={**route.canary, version: 0.0}, reason=f"canary {served_id} stopped: {why}"
    )


Publish = Callable[[str, bytes, bytes], Awaitable[None]]  # (topic, key, value)


class CanaryGuard:
    """Acts on the error windows' verdicts and on golden failures: stop_canary, then the event."""

    def __init__(
        self,
        windows: ErrorWindows,
        state: Callable[[], RegistryState],
        publish: Publish,
        models_topic: str,
        health_topic: str,
        by: str,
    ) -> None:
        self.windows = windows
        self.state = state
        self.publish = publish
        self.models_topic = models_topic
        self.health_topic = health_topic
        self.by = by
        self.pending: dict[str, str] = {}  # served_id -> why, acted on by act()
        self.num_stopped = 0
        self.num_skipped = 0  # model health records that were not ModelHealthEvents

    def observe(self, event: AuditEvent) -> None:
        """Feed one new ledger record; a version whose window passes the bound is due (act())."""
        why = self.windows.observe(event)
        if why is not None and self._is_canary(event.model_version):
            self.pending.setdefault(event.model_version, why)

    def on_health(self, event: ModelHealthEvent) -> None:
        if event.event == "golden_failed" and self._is_canary(event.model):
            self.pending.setdefault(event.model, f"golden check failed on {event.worker_id}: {event.detail}"[:900])

    def _is_canary(self, served_id: str) -> bool:
        name, version = split_ref(served_id)
        route = self.state().routes.get(name)
        return version is not None and route is not None and route.canary.get(version, 0) > 0

    async def act(self) -> int:
        """Stop every due canary; returns how many were stopped. A refused route is logged and dropped."""
        stopped = 0
        while self.pending:
            served_id, why = self.pending.popitem()
            try:
                records = stop_canary(self.state(), served_id, why, self.by)
            except RegistryError as exc:
                log.error("canary guard: cannot stop %s (%s): %s", served_id, why, exc)
                continue
            if not records:
                continue
            event = ModelHealthEvent(worker_id=self.by, model=served_id, event="canary_stopped", detail=why)
            try:
                for record in records:
                    await self.publish(self.models_topic, record.key.encode(), encode(record))
                await self.publish(self.health_topic, served_id.encode(), encode(event))
            except Exception:
                self.pending.setdefault(served_id, why)  # the next act() tries again
                raise
            self.windows.reset(served_id)
            log.warning("canary guard: %s set to 0%%: %s", served_id, why)
            stopped += 1
        self.num_stopped += stopped
        return stopped


def register_health_handler(broker: Any, topics: Topics, guard: CanaryGuard) -> None:
    """Subscribe the guard to Topics.model_health, from its end, in a group of its own (each failure
    is acted on once across restarts). A record that is no ModelHealthEvent is skipped with a log
    line: it changes nothing (docs/design.md, invariant 6)."""

    async def raw(msg: Any) -> bytes:
        return bytes(msg.body)

    @broker.subscriber(
        topics.model_health,
        group_id=topics.canary_guard_group,
        auto_offset_reset="latest",
        decoder=raw,
        title="auditor/canary-guard",
        description="Golden failures of canary versions: the canary is taken to 0%.",
    )
    async def on_model_health(body: bytes) -> None:
        try:
            event = decode(ModelHealthEvent, body)
        except DecodeError as exc:
            guard.num_skipped += 1
            log.warning("model health record skipped: %s", exc)
            return
        guard.on_health(event)
        await guard.act()
