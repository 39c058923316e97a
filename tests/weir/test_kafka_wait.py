"""A service started before its broker waits for it (WEIR_KAFKA_WAIT_S, as `weir up` sets it while
the broker boots) and then serves; without a broker in that time it exits 3, as before."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.waiting import wait_until
from weir.kafka import launcher
from weir.service import EXIT_BROKER
from weir.stack import free_ports, wait_http_ok

REPO = Path(__file__).resolve().parents[2]


def start_batcher(port: int, http_port: int, wait_s: float, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "WEIR_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
        "WEIR_KAFKA_WAIT_S": str(wait_s),
        "WEIR_BATCHER_HTTP_PORT": str(http_port),
        "WEIR_TOPIC_PREFIX": f"wait{uuid.uuid4().hex[:8]}",
        "WEIR_MODEL_REPO": str(REPO / "models.toml"),
        "PYTHONPATH": str(REPO),
    }
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "weir.cli", "batcher"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def wait_for_text(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    def logged() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")
        return text in log.read_text(errors="replace")

    wait_until(logged, timeout_s=timeout_s, interval_s=0.2, what=f"{text!r} in {log.name}")


@pytest.mark.kafka
def test_a_service_started_before_its_broker_waits_and_then_serves(tmp_path: Path) -> None:
    port, controller_port, http_port = free_ports(3)
    cfg = launcher.BrokerConfig(port=port, controller_port=controller_port, data_dir=tmp_path / "broker")
    log = tmp_path / "batcher.log"
    proc = start_batcher(port, http_port, 300, log)
    try:
        wait_for_text(log, f"waiting up to 300 s for the Kafka cluster at 127.0.0.1:{port}", proc)
        launcher.start(cfg)  # only now is there a broker
        wait_http_ok(f"http://127.0.0.1:{http_port}/readyz", 240)
        assert proc.poll() is None
    finally:
        proc.terminate()
        returncode = proc.wait(60)
        launcher.stop(cfg)
    assert returncode == 0, log.read_text(errors="replace")


def test_without_a_broker_in_the_wait_a_service_exits_3(tmp_path: Path) -> None:
    port, http_port = free_ports(2)
    log = tmp_path / "batcher.log"
    proc = start_batcher(port, http_port, 1, log)
    assert proc.wait(120) == EXIT_BROKER
    assert "Kafka did not answer" in log.read_text(errors="replace")
