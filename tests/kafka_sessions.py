"""Test sessions sharing one broker: what they created is deleted by the last one to leave.

Each session used to delete, at its end, every topic that was new since it began. With two
sessions on one broker (two developers' runs, a CI job beside a local one, the parallel worktrees
of one machine) that deleted the topics the other was still using, mid-test: its services then
logged `Topic ... not found in cluster metadata` and its tests failed at random. Now a session
registers itself (a file per process id, under the temp dir, per bootstrap address) and, when it
ends, adds its new topics to a shared pending list; the last session alive deletes the whole list.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class SharedBrokerSessions:
    """The test sessions of this machine that use the broker at `bootstrap`."""

    def __init__(self, bootstrap: str, root: Path | None = None) -> None:
        name = bootstrap.replace(":", "_").replace(",", "+")
        self.dir = (root or Path(tempfile.gettempdir())) / f"weir-test-sessions-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / "lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def join(self) -> None:
        with self._locked():
            (self.dir / f"{self.pid}.session").touch()

    def leave(self, created: Iterable[str]) -> list[str]:
        """Unregister, add `created` to the pending topics, and return what to delete now: every
        pending topic when no other session is alive, else nothing (the last one deletes it all)."""
        with self._locked():
            (self.dir / f"{self.pid}.session").unlink(missing_ok=True)
            pending_file = self.dir / "pending.json"
            pending = set(json.loads(pending_file.read_text())) if pending_file.exists() else set()
            pending |= set(created)
            others = []
            for entry in self.dir.glob("*.session"):
                if entry.stem.isdigit() and _alive(int(entry.stem)):
                    others.append(entry)
                else:
                    entry.unlink(missing_ok=True)  # a session that died without leaving
            if others:
                pending_file.write_text(json.dumps(sorted(pending)))
                return []
            pending_file.unlink(missing_ok=True)
            return sorted(pending)
