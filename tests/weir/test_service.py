"""The shared service runner (weir/service.py): exit codes, signals, the ops endpoint, logging.

A tiny service (below) runs under `run_service` in a child process, so signals and exit codes are
the real ones. No broker: its start raises what a missing broker raises when asked to.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from tests.ports import DeadPort, HeldPort
from tests.waiting import wait_until
from weir.service import (
    EXIT_BROKER,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    HTTP_FD_ENV,
    ConfigError,
    ops_app,
    run_service,
    service_parser,
)

REPO = Path(__file__).resolve().parents[2]


class TinyService:
    name = "tiny"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.is_running = False

    async def start(self) -> None:
        if self.mode == "no-broker":
            raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")
        if self.mode == "not-authorised":  # what a secure broker answered the auditor (issue 35)
            raise TopicAuthorizationFailedError("creating topic 'weir.replies.shadow' failed: Authorization failed.")

    async def run(self, stop: asyncio.Event) -> None:
        self.is_running = True
        if self.mode == "crash":
            raise RuntimeError("the model's device is gone")
        await stop.wait()
        if self.mode == "stubborn":
            await asyncio.sleep(3600)  # ignores the stop: the runner cancels it after stop_timeout_s

    async def close(self) -> None:
        print("closed", file=sys.stderr, flush=True)

    def http_app(self) -> Any:
        return ops_app(lambda: (self.is_running, {"mode": self.mode}), lambda: "tiny_up 1\n")


def main(argv: list[str]) -> int:
    parser = service_parser("tiny", "a test service", 0, "WEIR_TINY_PORT")
    parser.add_argument("--mode", default="ok")

    def build(args: Any) -> tuple[TinyService, str, int]:
        if args.mode == "bad-config":
            raise ConfigError("max_tokens=0 must be >= 1")
        return TinyService(args.mode), "127.0.0.1", args.http_port or 0

    return run_service("tiny", argv, parser, build, stop_timeout_s=1.0)


def spawn(*argv: str, held: HeldPort | None = None) -> subprocess.Popen[str]:
    """The tiny service as a process; with `held`, serving on that socket (as a Stack passes it)."""
    code = "import sys; from tests.weir.test_service import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env=held.env(env) if held else env,
        pass_fds=held.pass_fds if held else (),
    )


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(url: str, proc: subprocess.Popen[str]) -> tuple[int, str]:
    def answered() -> tuple[int, str] | None:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            return get(url)
        except OSError:
            return None

    return wait_until(answered, timeout_s=30, interval_s=0.1, what=f"{url} to answer")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_ops_endpoint_then_stops_cleanly_on_a_signal(sig: signal.Signals) -> None:
    with HeldPort() as held:
        port = held.port
        proc = spawn("--http-port", str(port), "--log-format", "json", held=held)
    base = f"http://127.0.0.1:{port}"
    status, body = wait_for(f"{base}/readyz", proc)
    while status == 503:  # served from before run() starts: not ready yet, and says so
        assert json.loads(body) == {"ready": False, "mode": "ok"}
        status, body = get(f"{base}/readyz")
    assert (status, json.loads(body)) == (200, {"ready": True, "mode": "ok"})
    assert get(f"{base}/healthz") == (200, '{"status":"ok"}')
    assert get(f"{base}/metrics")[1] == "tiny_up 1\n"
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_OK, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert {"service": "tiny", "level": "INFO"}.items() <= lines[-1].items(), lines
    assert any(line["msg"] == f"{sig.name}: stopping" for line in lines)
    assert "Traceback" not in stderr and "closed" in stderr


@pytest.mark.parametrize(
    "argv, code, said",
    [
        (["--mode", "bad-config"], EXIT_CONFIG, "max_tokens=0 must be >= 1"),
        (["--mode", "no-broker"], EXIT_BROKER, "is Kafka up (`weir kafka up`)"),
        (["--mode", "not-authorised"], EXIT_CONFIG, "Kafka refused this client (TopicAuthorizationFailedError"),
        (["--mode", "crash"], EXIT_FAILED, "the model's device is gone"),
        (["--log-level", "LOUD"], EXIT_CONFIG, "log level 'LOUD'"),
    ],
)
def test_exit_codes_say_what_went_wrong(argv: list[str], code: int, said: str) -> None:
    proc = spawn(*argv)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == code, stderr
    assert said in stderr


def test_a_taken_port_is_a_configuration_error() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        proc = spawn("--http-port", str(taken.getsockname()[1]))
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_CONFIG and "set --http-port" in stderr, stderr


def test_a_service_that_ignores_stop_is_cancelled_within_the_bound() -> None:
    with HeldPort() as held:
        port = held.port
        proc = spawn("--mode", "stubborn", "--http-port", str(port), held=held)
    wait_for(f"http://127.0.0.1:{port}/healthz", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_OK and "did not stop within 1 s; cancelling" in stderr, stderr


def test_a_passed_socket_is_served_without_a_bind_of_its_own() -> None:
    # The launcher's socket (weir/stack.py: Stack.listeners) is served as it is: the port was
    # never free between the pick and the serve. The tiny service asks for port 0 (any) here.
    with HeldPort() as held:
        proc = spawn("--log-format", "json", held=held)
        wait_for(f"http://127.0.0.1:{held.port}/healthz", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_OK and f"127.0.0.1:{held.port}" in stderr, stderr


@pytest.mark.parametrize("wrong", ["another port", "not a socket", "not listening"])
def test_a_passed_socket_that_is_not_the_configured_one_is_refused(wrong: str) -> None:
    with HeldPort() as held, DeadPort() as dead, open(os.devnull) as devnull:
        if wrong == "another port":
            proc = spawn("--http-port", str(dead.port), held=held)
        else:
            fd = devnull.fileno() if wrong == "not a socket" else dead.sock.fileno()
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from tests.weir.test_service import main; sys.exit(main(sys.argv[1:]))",
                ],
                cwd=REPO,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, HTTP_FD_ENV: str(fd)},
                pass_fds=(fd,),
            )
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_CONFIG, stderr
    said = {
        "another port": f"not on the configured 127.0.0.1:{dead.port}",
        "not a socket": "is not an open socket",
        "not listening": "is not a listening TCP socket",
    }[wrong]
    assert said in stderr and "Traceback" not in stderr, stderr


async def test_connections_are_accepted_with_nagle_off() -> None:
    # socket.create_server makes proto-0 sockets, on which asyncio leaves Nagle on: every streamed
    # response after the first on a keep-alive connection then waited for the client's delayed ACK.
    import socket

    from weir.service import HttpServer, bind

    sock = bind("127.0.0.1", 0)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # what create_server gives
    HttpServer(lambda scope, receive, send: None, sock, {})
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        with socket.create_connection(sock.getsockname()[:2]):
            accepted, _ = sock.accept()
            with accepted:  # what uvicorn's connections get
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()
