"""`weir up --secure` on a fresh $WEIR_HOME, as a user runs it (issue 35): its own secure broker on
free ports (never the shared one), every service logged in as its own principal with the ACLs of
schemas/access.py, one request served; the CLI of that home finds the deployment by itself
(weir/deployment.py); no consumer group's session expires during start (weir/heap.py); a second
start of the same home comes up again without the auditor's rate-card warning."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from weir.kafka import launcher
from weir.stack import free_ports

from .conftest import REPO_ROOT
from .test_weir_up import Up

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

START_S = 300  # a secure broker's first start, then four services, on a busy 2-core box
# What a fresh home must not inherit from the test run: where it would find another deployment.
FOREIGN = (
    "WEIR_KAFKA_BOOTSTRAP",
    "WEIR_TOPIC_PREFIX",
    "WEIR_KAFKA_SECURITY",
    "WEIR_KAFKA_USER",
    "WEIR_KAFKA_PASSWORD_FILE",
    "WEIR_KAFKA_PORT",
    "WEIR_KAFKA_DATA_DIR",
    "WEIR_AUDIT_DB",
    "WEIR_GATEWAY_ADMIN_TOKEN",
    "WEIR_AUDIT_HMAC_KEY",
    "WEIR_AUDIT_CHECKPOINT_KEY",
)


def fresh_home(tmp_path: Path) -> Path:
    """An empty $WEIR_HOME but for Kafka's jars (resolved once per machine from Maven, not state)."""
    if not launcher.jars_resolved() or shutil.which("java") is None:
        pytest.skip("Kafka's jars are not resolved here (weir kafka up resolves them) or java is missing")
    home = tmp_path / "home"
    (home / "kafka").mkdir(parents=True)
    (home / "kafka" / launcher.KAFKA_VERSION).symlink_to(launcher.lib_dir().parent)
    return home


def start(home: Path, out: Path, ports: list[int], prefix: str) -> Up:
    """`weir up --secure` of `home`; ports: Kafka's, the gateway's, then the auditor's, batcher's and
    worker's (free ones: other stacks on this machine take the defaults)."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    env.update(
        {
            "WEIR_HOME": str(home),
            "PYTHONUNBUFFERED": "1",
            "WEIR_MODELS": "echo",
            "WEIR_AUDIT_API_PORT": str(ports[2]),
            "WEIR_BATCHER_HTTP_PORT": str(ports[3]),
            "WEIR_WORKER_HTTP_PORT": str(ports[4]),
        }
    )
    with open(out, "ab") as handle:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weir.cli",
                "up",
                "--secure",
                "--kafka-port",
                str(ports[0]),
                "--port",
                str(ports[1]),
                "--topic-prefix",
                prefix,
                "--model-repo",
                str(REPO_ROOT / "models.toml"),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    return Up(proc, out, f"http://127.0.0.1:{ports[1]}", prefix)


def stop(up: Up) -> int:
    if up.proc.poll() is None:
        up.proc.send_signal(signal.SIGTERM)
        try:
            return up.proc.wait(90)
        except subprocess.TimeoutExpired:
            up.proc.kill()
    return up.proc.wait()


def cli(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """A `weir` command of that home, in a shell that knows nothing but $WEIR_HOME."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN}
    env["WEIR_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "weir.cli", *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def chat(up: Up) -> str:
    body = {"model": "echo", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 8}
    answer = httpx.post(f"{up.base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


@pytest.mark.timeout(2 * START_S + 300)
def test_weir_up_secure_starts_on_a_fresh_home_serves_and_its_cli_finds_it(tmp_path: Path) -> None:
    home = fresh_home(tmp_path)
    ports, prefix = free_ports(5), f"e2esec{uuid.uuid4().hex[:6]}"
    out = tmp_path / "weir-up.out"
    up = start(home, out, ports, prefix)
    try:
        up.wait_for(r"Weir is up\.", START_S)
        assert chat(up)  # served through every service, each as its own principal
        assert re.search(r"^  models +echo@1\*  \(\* default version", up.text(), re.M), up.text()  # the registry's
        bootstrap = f"127.0.0.1:{ports[0]}"
        assert (
            f"export WEIR_HOME={home.resolve()} WEIR_KAFKA_BOOTSTRAP={bootstrap} WEIR_TOPIC_PREFIX={prefix} "
            "WEIR_KAFKA_SECURITY=sasl WEIR_KAFKA_USER=admin" in up.text()
        )
        record = json.loads((home / "deployment.json").read_text())
        assert (record["bootstrap"], record["topic_prefix"], record["security"], record["state"]) == (
            bootstrap,
            prefix,
            "sasl",
            "up",
        )

        # The CLI of this home, with no flag nor variable: this deployment, not 127.0.0.1:9092's.
        listed = cli(home, "models", "list", "--timeout", "30")
        assert listed.returncode == 0, listed.stderr
        assert re.search(r"^echo +1\*", listed.stdout, re.M), listed.stdout
        assert f"WEIR_KAFKA_BOOTSTRAP={bootstrap}" in listed.stderr and f"WEIR_TOPIC_PREFIX={prefix}" in listed.stderr
        made = cli(home, "topics", "create", "--reply", "admin-check", "--model-repo", str(REPO_ROOT / "models.toml"))
        assert made.returncode == 0 and f"on {bootstrap}" in made.stdout, made.stdout + made.stderr

        logs = {p.stem: p.read_text(errors="replace") for p in (home / "logs").glob("*.log")}
        for name, text in logs.items():
            assert "Heartbeat session expired" not in text, f"{name}: {text[-3000:]}"
            assert "TopicAuthorizationFailed" not in text and "Authorization failed" not in text, (
                f"{name}: {text[-3000:]}"
            )
    finally:
        assert stop(up) == 0, up.text()[-3000:]
    assert not (home / "deployment.json").exists()  # a stopped deployment is not found
    gone = cli(home, "models", "list", "--timeout", "3")
    assert f"127.0.0.1:{ports[0]}" not in gone.stderr

    # A second start of the same home: its passwords, topics and ledger are kept, and it comes up.
    up = start(home, out, ports, prefix)
    try:
        up.wait_for(r"(?s)Weir is up\..*Weir is up\.", START_S)
        assert chat(up)
        auditor = (home / "logs" / "auditor.log").read_text(errors="replace")
        assert "publishing rate cards failed" not in auditor, auditor[-3000:]
    finally:
        assert stop(up) == 0, up.text()[-3000:]
