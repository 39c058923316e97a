"""When `weir up` restarts a service that exited by itself.

docker-compose.yml runs every service with `restart: unless-stopped`; `weir up` does the same for
its plain processes, so a kill -9 of the worker or the batcher under load is what docs/design.md's
invariant 3 promises: the service comes back, rejoins its consumer group, and redoes what it
had not committed. The policy is Kubernetes' CrashLoopBackOff in small: the first restart at once,
then a doubling delay up to a cap; a run that stayed up long enough starts the count over. Like
Docker's and Kubernetes' policies it never gives up by default: a service that dies while the
broker is away for minutes must come back when the broker does (a broken model or setting is
caught before that, while `weir up` waits for the stack to be ready, and is not retried). A limit
can be set. Pure: the caller passes the times.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """Delays and limits of restarts, per service."""

    first_delay_s: float = 0.0  # a kill -9 is the common case: come back at once
    base_delay_s: float = 1.0  # the second restart in a row waits this, then it doubles
    max_delay_s: float = 30.0
    healthy_after_s: float = 60.0  # up this long: the next exit counts as the first again
    max_restarts: int | None = None  # restarts in a row (each before healthy_after_s) before giving up

    def __post_init__(self) -> None:
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"{self.max_restarts=} must be >= 0")
        if not 0 <= self.base_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 <= {self.base_delay_s=} <= {self.max_delay_s=}")


@dataclass
class _Record:
    started_at_s: float
    num_quick_exits: int = 0  # exits in a row, each before healthy_after_s


@dataclass
class Supervisor:
    """Decides, per service, whether and when to restart it after it exits."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    _records: dict[str, _Record] = field(default_factory=dict)

    def on_start(self, name: str, now_s: float) -> None:
        """Called each time `name` is (re)started."""
        record = self._records.get(name)
        if record is None:
            self._records[name] = _Record(now_s)
        else:
            record.started_at_s = now_s

    def on_exit(self, name: str, now_s: float) -> float | None:
        """Called when `name` exited unasked. Returns seconds to wait before restarting it, or
        None when it has exited more than max_restarts times in a row (the caller gives up)."""
        record = self._records.setdefault(name, _Record(now_s))
        if now_s - record.started_at_s >= self.policy.healthy_after_s:
            record.num_quick_exits = 0
        record.num_quick_exits += 1
        n = record.num_quick_exits
        if self.policy.max_restarts is not None and n > self.policy.max_restarts:
            return None
        if n == 1:
            return self.policy.first_delay_s
        return min(self.policy.max_delay_s, self.policy.base_delay_s * 2 ** (n - 2))

    def num_quick_exits(self, name: str) -> int:
        """Exits of `name` in a row so far (0 when unknown)."""
        record = self._records.get(name)
        return record.num_quick_exits if record else 0


def describe_exit(returncode: int | None) -> str:
    """'exit code 1', 'killed by SIGKILL', ... for a Popen.returncode."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
