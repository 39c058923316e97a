"""Two test sessions on one broker: neither deletes the other's topics; the last one out deletes all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.kafka_sessions import SharedBrokerSessions


def test_the_last_session_to_leave_deletes_what_every_session_created(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another live session
    try:
        mine = SharedBrokerSessions("127.0.0.1:9092", tmp_path)
        mine.join()
        (mine.dir / f"{other.pid}.session").touch()
        (mine.dir / "999999999.session").touch()  # one that died without leaving: not waited for
        assert mine.leave(["a.requests", "a.control"]) == []  # the other may still use them
        assert not (mine.dir / f"{os.getpid()}.session").exists()
        assert not (mine.dir / "999999999.session").exists()
    finally:
        other.kill()
        other.wait()
    last = SharedBrokerSessions("127.0.0.1:9092", tmp_path)
    last.join()
    assert last.leave(["b.requests"]) == ["a.control", "a.requests", "b.requests"]
    assert last.leave([]) == []  # nothing pending any more
