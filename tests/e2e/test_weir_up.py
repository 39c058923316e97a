"""`weir up` itself, as a user runs it, with two workers and two gateways: each gateway answers
with its own reply topic, both workers are live, a kill -9 of both workers under load (streams on
both gateways) restarts each and loses no request; SIGTERM stops every process it started."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.waiting import until, wait_until
from weir.kafka.admin import delete_prefixed_topics, list_topic_names
from weir.stack import free_ports

from .conftest import BOOTSTRAP, REPO_ROOT
from .test_faults import MODEL, NUM_REQUESTS, assert_each_ends_once, stream_one

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
KILL_AFTER_FIRST_TOKEN_S = 0.5  # as tests/e2e/test_faults.py: where in the flood the workers' kill lands


@dataclass
class Up:
    """A running `weir up` and what its output said."""

    proc: subprocess.Popen
    out: Path
    base_url: str
    prefix: str

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            match = re.search(pattern, self.text())
            assert match or self.proc.poll() is None, f"weir up exited:\n{self.text()}"
            return match

        return wait_until(found, timeout_s=timeout_s, interval_s=0.3, what=f"{pattern!r} in weir up's output")

    def services(self) -> dict[str, tuple[int, str]]:
        """Each instance's pid and URL, from the banner's services lines."""
        self.wait_for(r"services \(pid", 5)
        found = re.findall(r"^ +((?:auditor|worker|batcher|gateway)(?:-\d)?) +(\d+) +(http://\S+)$", self.text(), re.M)
        return {name: (int(pid), url) for name, pid, url in found}

    def pids(self) -> dict[str, int]:
        return {name: pid for name, (pid, _) in self.services().items()}


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def weir_up(tmp_path):
    prefix = f"e2eup{uuid.uuid4().hex[:8]}"
    (port,) = free_ports(1)
    out = tmp_path / "weir-up.out"
    # Only the two models this test asks for: each of the two workers loads them (the embedding
    # model of TEST_MODELS would cost both workers' start-up and nothing here uses it).
    env = {
        **os.environ,
        "WEIR_AUDIT_DB": str(tmp_path / "audit.sqlite"),
        "PYTHONUNBUFFERED": "1",
        "WEIR_MODELS": f"{MODEL},echo",
    }
    with open(out, "wb") as handle:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weir.cli",
                "up",
                "--port",
                str(port),
                "--topic-prefix",
                prefix,
                "--workers",
                "2",
                "--gateways",
                "2",
                "--log-dir",
                str(tmp_path / "logs"),
                "--model-repo",
                str(REPO_ROOT / "models.toml"),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    up = Up(proc, out, f"http://127.0.0.1:{port}", prefix)
    try:
        up.wait_for(r"Weir is up\.", 300)
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        asyncio.run(delete_prefixed_topics(BOOTSTRAP, prefix))


async def assert_two_of_each(up: Up) -> list[str]:
    """Both gateways answer a chat completion, each with its own id and reply topic, and each sees
    two live workers of the test model; returns the gateways' URLs."""
    urls = [up.services()[name][1] for name in ("gateway", "gateway-2")]
    assert re.search(rf"^ +{re.escape(urls[1])}/v1 ", up.text(), re.M), "the banner lists the second gateway"
    ids = []
    async with httpx.AsyncClient(timeout=60) as client:
        for url in urls:
            body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            answer = await client.post(f"{url}/v1/chat/completions", json=body)
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"], answer.text

            async def both_live(url: str = url) -> dict | None:  # the heartbeats of both workers reach each gateway
                ready = (await client.get(f"{url}/readyz")).json()
                return ready if ready["live_workers"].get(f"{MODEL}@1") == 2 else None

            ready = await until(both_live, timeout_s=30, interval_s=0.5, what=f"both workers live at {url}")
            ids.append(ready["gateway_id"])
    assert ids == [f"gateway-up-{url.rsplit(':', 1)[1]}" for url in urls]
    replies = [f"{up.prefix}.replies.{gateway_id}" for gateway_id in ids]
    assert (
        set(replies) <= set(await list_topic_names(BOOTSTRAP)) and f"the gateways': {', '.join(replies)}" in up.text()
    )
    return urls


async def test_weir_up_restarts_each_killed_worker_and_every_stream_ends_once(weir_up: Up, tmp_path: Path) -> None:
    pids = weir_up.pids()
    assert set(pids) == {"auditor", "worker", "worker-2", "batcher", "gateway", "gateway-2"}
    async with httpx.AsyncClient(timeout=10) as client:  # every service's printed URL answers
        for name, (_, url) in weir_up.services().items():
            assert (await client.get(f"{url}/healthz")).status_code == 200, name
            assert (await client.get(f"{url}/readyz")).json()["ready"] is True, name
            metrics = await client.get(f"{url}/metrics")
            assert metrics.status_code == 200 and "# TYPE" in metrics.text, name
    gateways = await assert_two_of_each(weir_up)
    log: dict = {}
    started = asyncio.Event()
    limits = httpx.Limits(max_connections=64)
    async with (
        httpx.AsyncClient(base_url=gateways[0], timeout=300, limits=limits) as one,
        httpx.AsyncClient(base_url=gateways[1], timeout=300, limits=limits) as two,
    ):
        tasks = [asyncio.create_task(stream_one((one, two)[i % 2], i, started, log, 0.0)) for i in range(NUM_REQUESTS)]
        await asyncio.wait_for(started.wait(), 120)
        await asyncio.sleep(KILL_AFTER_FIRST_TOKEN_S)  # where in the flood the fault lands (not a wait for an event)
        in_flight = NUM_REQUESTS - len(log)
        # Both workers: each is restarted on its own (nobody restarts them but weir up). One of
        # the two alone is the failover case (docs/design.md, "Scale-out and failover"), `weir chaos`'s.
        for name in ("worker", "worker-2"):
            os.kill(pids[name], signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    assert in_flight >= 20
    restarted = []
    for name in ("worker", "worker-2"):
        restarted.append(await asyncio.to_thread(weir_up.wait_for, rf"{name} restarted \(pid (\d+)\)", 5))
        assert f"weir up: {name} exited (killed by SIGKILL); restarting it" in weir_up.text()
    await assert_each_ends_once(weir_up, log)
    assert weir_up.proc.poll() is None, "weir up stopped instead of restarting the workers"

    # SIGTERM (what kill, systemd and docker send) stops all of it, the restarted workers too
    services = [*pids.values(), *(int(found.group(1)) for found in restarted)]
    weir_up.proc.send_signal(signal.SIGTERM)
    assert weir_up.proc.wait(60) == 0
    assert "stopped" in weir_up.text()
    assert [pid for pid in services if is_alive(pid)] == [], "weir up left services running"
    for log in (tmp_path / "logs").glob("*.log"):  # a clean stop writes no traceback
        assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
