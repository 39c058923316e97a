"""`weir gateway` (services.gateway.app:main) as a process: serves, stops cleanly, fails clearly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from uuid import uuid4

import httpx
import pytest

from tests.ports import DeadPort, HeldPort
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CMD = [sys.executable, "-c", "import sys; from services.gateway.app import main; sys.exit(main(sys.argv[1:]))"]


def env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "WEIR_TOPIC_PREFIX": f"t{uuid4().hex[:8]}",
        "PYTHONPATH": str(ROOT),
        "WEIR_AUTH_MODE": "open",
        **extra,
    }


@pytest.mark.kafka
def test_main_serves_until_sigterm() -> None:
    with HeldPort() as held:  # the gateway serves the test's socket: no pick-then-release race
        port = held.port
        proc = subprocess.Popen(
            [*CMD, "--port", str(port)],
            cwd=ROOT,
            env=held.env(env()),
            pass_fds=held.pass_fds,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:

        def answered() -> httpx.Response | None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
            except httpx.TransportError:
                return None

        response = wait_until(answered, timeout_s=60, what="the gateway's /readyz to answer")
        assert response.status_code == 503 and response.json()["reason"] == "no live worker heartbeat"
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models == {"object": "list", "data": []}  # ready versions only: no worker runs here
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr


def test_main_without_kafka_exits_3_with_a_reason() -> None:
    with DeadPort() as dead:  # bound, never listening: no Kafka can answer there while the test runs
        proc = subprocess.run(
            [*CMD, "--port", "0", "--kafka-bootstrap", f"127.0.0.1:{dead.port}"],
            cwd=ROOT,
            env=env(WEIR_STARTUP_TIMEOUT_S="1"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 3
    assert "is Kafka up" in proc.stderr and "Traceback" not in proc.stderr


def test_main_with_a_bad_model_repo_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CMD, "--model-repo", str(tmp_path / "missing.toml")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "WEIR_MODEL_REPO" in proc.stderr
