"""What `weir up` says while it waits: the broker, then each service's /readyz until all answer 200.

Every service answers /readyz with {"ready": false, "reason": "..."} while it starts (the worker:
which models it is still loading; the gateway: no live worker heartbeat yet, ...), and nothing
before its HTTP port opens (it is still importing, or connecting to Kafka). `ReadinessBoard` turns
those answers into the lines a user sees: one when a service becomes ready, with the seconds since
`weir up` began, and one naming what the others are doing whenever that changes. Pure: the caller
passes the answers and the time; `wait_all_ready` is the loop that reads them.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

NOT_ANSWERING = "starting: importing, then waiting for Kafka (no answer on its HTTP port yet)"


@dataclass(frozen=True)
class Probe:
    """One /readyz answer: ready, or why not."""

    is_ready: bool
    reason: str


def probe(url: str, timeout_s: float = 1.0) -> Probe:
    """GET `url` (a /readyz): 200 is ready; a 503 gives its body's reason; no answer is NOT_ANSWERING."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return Probe(resp.status == 200, "ready")
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read() or b"{}").get("reason") or f"HTTP {exc.code}"
        except (ValueError, AttributeError, OSError, http.client.HTTPException):  # its body did not come (whole)
            reason = f"HTTP {exc.code}"
        return Probe(False, str(reason))
    except (urllib.error.URLError, OSError, http.client.HTTPException):  # HTTPException: a cut answer
        return Probe(False, NOT_ANSWERING)


@dataclass
class ReadinessBoard:
    """Which services are ready since when, and what the others last said."""

    names: list[str]
    started_s: float  # when `weir up` began (time.monotonic())
    ready_at_s: dict[str, float] = field(default_factory=dict)  # seconds after started_s
    reasons: dict[str, str] = field(default_factory=dict)
    _last_waiting: str = ""

    @property
    def is_all_ready(self) -> bool:
        return all(name in self.ready_at_s for name in self.names)

    def waiting_for(self) -> list[str]:
        return [name for name in self.names if name not in self.ready_at_s]

    def update(self, name: str, found: Probe, now_s: float) -> list[str]:
        """Record one answer; returns the line to print when `name` just became ready."""
        if name in self.ready_at_s:
            return []
        if found.is_ready:
            self.ready_at_s[name] = now_s - self.started_s
            self.reasons.pop(name, None)
            return [f"  {name} ready ({self.ready_at_s[name]:.1f} s)"]
        if found.reason == NOT_ANSWERING and name in self.reasons:
            # It answered before: its port is open, so a probe that got nothing this time met a busy
            # service (a long step on its loop), not one starting over; what it last said still holds.
            return []
        self.reasons[name] = found.reason
        return []

    def waiting_line(self, now_s: float) -> str | None:
        """'  12.3 s: worker: loading ...; gateway: ...' when what the waiting services say changed
        since the last such line; else None."""
        waiting = "; ".join(f"{name}: {self.reasons.get(name, NOT_ANSWERING)}" for name in self.waiting_for())
        if not waiting or waiting == self._last_waiting:
            return None
        self._last_waiting = waiting
        return f"  {now_s - self.started_s:5.1f} s  {waiting}"


def wait_all_ready(
    board: ReadinessBoard,
    probe_of: Callable[[str], Probe],
    dead: Callable[[], list[str]],
    log_tail: Callable[[str], str],
    deadline_s: float,
    say: Callable[[str], None],
    poll_s: float = 0.5,
) -> None:
    """Ask each waiting name's probe until all are ready, saying what changes.

    Raises RuntimeError (with its log's end) when a service exits meanwhile (and what a probe
    raises), TimeoutError naming what still waits and why at `deadline_s` (time.monotonic())."""
    # Side by side: a service binds its port before it connects to Kafka, so until it serves, a
    # probe of it waits for its whole timeout; one after another they hid the others for seconds.
    with ThreadPoolExecutor(max_workers=len(board.names), thread_name_prefix="readyz") as pool:
        while True:
            if exited := dead():
                raise RuntimeError(f"{exited[0]} exited during startup:\n{log_tail(exited[0])}")
            waiting = board.waiting_for()
            answers = list(pool.map(probe_of, waiting))
            now = time.monotonic()
            for name, found in zip(waiting, answers, strict=True):
                for line in board.update(name, found, now):
                    say(line)
            if board.is_all_ready:
                return
            if (still_waiting := board.waiting_line(now)) is not None:
                say(still_waiting)
            if now > deadline_s:
                still = ", ".join(f"{n} ({board.reasons.get(n, NOT_ANSWERING)})" for n in board.waiting_for())
                raise TimeoutError(f"not ready in time: {still}")
            time.sleep(poll_s)
