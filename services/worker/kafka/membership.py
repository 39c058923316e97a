"""How a worker's model server belongs to its version's consumer group (docs/design.md,
"Scale-out and failover"): session and heartbeat (how soon a dead worker's partitions move),
static membership (a worker restarted in place gets them back with no rebalance), leaving on a
clean stop, and refusing to run twice under one instance name.

Measured on the real broker with aiokafka 0.14 (docs/worker.md, "Failover"): a static member
sends no LeaveGroup when it stops, so a SIGTERM would leave its partitions to the session
timeout; `stop_consumer` makes it leave by member id, which the broker accepts (0.4 s to the survivor's
assignment). aiokafka puts no group.instance.id in heartbeats and commits, so the broker's
FENCED_INSTANCE_ID never reaches a member whose instance another process took: it only hears
UNKNOWN_MEMBER_ID, rejoins under the same instance id and takes it back, and the two steal it
from each other every heartbeat, both reading every partition. `FenceWatch` notices a lost
membership while the session was live and drops the instance id, so this consumer carries on as
a dynamic member beside the one that took it. It does not stop the worker: a coordinator that
moved (its broker killed) can forget a live member too, and a worker that stopped on that would
turn a broker's failure into a worker's (found by an outside test under `weir chaos`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer

_UNKNOWN_MEMBER = ""  # aiokafka's UNKNOWN_MEMBER_ID: what reset_generation() leaves


@dataclass(frozen=True)
class Membership:
    """A model server's group settings (WorkerSettings: worker_session_timeout_ms,
    worker_group_heartbeat_ms, worker_instance)."""

    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1500
    instance: str | None = None  # group.instance.id; None: dynamic membership

    @classmethod
    def of(cls, settings: Any) -> Membership:
        """From a WorkerSettings."""
        return cls(settings.worker_session_timeout_ms, settings.group_heartbeat_ms(), settings.worker_instance)


class FenceWatch:
    """Notices that a static member lost its membership while its session was live.

    A session expires only after `session_timeout_ms` without a successful heartbeat, so a member
    told UNKNOWN_MEMBER_ID sooner than that was not expired by the coordinator: its instance id
    was taken by another member (the broker replaces the member of a static instance that joins
    again). Wraps the coordinator's heartbeat (aiokafka 0.14's `_do_heartbeat`, looked up on every
    beat); `notice()` says so once.
    """

    def __init__(self, consumer: AIOKafkaConsumer, membership: Membership) -> None:
        self.membership = membership
        self.fenced_by: str | None = None
        self._told = False
        # the coordinator counts from when it got the last heartbeat, a round trip before we heard back
        self._live_s = 0.75 * membership.session_timeout_ms / 1000
        self._last_ok = time.monotonic()
        coordinator = consumer._coordinator  # see the class docstring
        beat = coordinator._do_heartbeat

        async def watched_heartbeat() -> bool:
            before = coordinator.member_id
            ok = await beat()
            now = time.monotonic()
            lost = before != _UNKNOWN_MEMBER and coordinator.member_id == _UNKNOWN_MEMBER
            if lost and now - self._last_ok < self._live_s:
                self.fenced_by = f"member {before} of {coordinator.group_id} lost {now - self._last_ok:.1f} s after its last heartbeat"
                # aiokafka rejoins at once; under the instance id that would fence the other process
                # back (which would then stop too). As a dynamic member it only joins beside it
                # until this consumer stops and leaves.
                coordinator._group_instance_id = None
            if ok:
                self._last_ok = now
            return ok

        coordinator._do_heartbeat = watched_heartbeat

    def notice(self) -> str | None:
        """Once, after the membership was lost while live: what happened, for the log; else None."""
        if self.fenced_by is None or self._told:
            return None
        self._told = True
        return (
            f"{self.fenced_by} under group.instance.id {self.membership.instance!r}: another worker joined "
            "under the same WEIR_WORKER_INSTANCE (give each its own), or the group's coordinator moved (a "
            "broker died); this worker carries on as a dynamic member"
        )


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """Stop a model server's consumer, leaving the group first as a static member too (aiokafka
    leaves only as a dynamic one), so the other workers take its partitions at once instead of
    after the session. Keeping them would pay only for a restart quicker than the session."""
    consumer._coordinator._group_instance_id = None  # aiokafka sends LeaveGroup only then
    await consumer.stop()
