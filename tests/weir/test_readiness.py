"""What `weir up` says while it waits (weir/readiness.py): a line when something becomes ready,
one when what the others say changes, and the reasons from real /readyz answers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from tests.ports import DeadPort
from weir.readiness import NOT_ANSWERING, Probe, ReadinessBoard, probe, wait_all_ready
from weir.service import ops_app

T0 = 1000.0


def test_a_line_when_a_service_becomes_ready_with_the_seconds_since_start() -> None:
    board = ReadinessBoard(["kafka", "worker"], started_s=T0)
    assert board.update("kafka", Probe(False, "booting"), T0 + 1) == []
    assert board.update("kafka", Probe(True, "ready"), T0 + 6.25) == ["  kafka ready (6.2 s)"]
    assert board.update("kafka", Probe(True, "ready"), T0 + 7) == []  # said once
    assert board.waiting_for() == ["worker"] and not board.is_all_ready
    assert board.update("worker", Probe(True, "ready"), T0 + 12) == ["  worker ready (12.0 s)"]
    assert board.is_all_ready and board.ready_at_s == {"kafka": 6.25, "worker": 12.0}


def test_a_waiting_line_only_when_what_the_services_say_changes() -> None:
    board = ReadinessBoard(["worker", "gateway"], started_s=T0)
    assert board.waiting_line(T0 + 1) == f"    1.0 s  worker: {NOT_ANSWERING}; gateway: {NOT_ANSWERING}"
    assert board.waiting_line(T0 + 2) is None
    board.update("worker", Probe(False, "loading the models: tiny: warming up"), T0 + 3)
    board.update("gateway", Probe(False, "no live worker heartbeat"), T0 + 3)
    assert board.waiting_line(T0 + 3) == (
        "    3.0 s  worker: loading the models: tiny: warming up; gateway: no live worker heartbeat"
    )
    assert board.waiting_line(T0 + 4) is None
    board.update("worker", Probe(True, "ready"), T0 + 5)
    assert board.waiting_line(T0 + 5) == "    5.0 s  gateway: no live worker heartbeat"


@pytest.fixture
def readyz() -> Iterator[tuple[str, dict]]:
    """A real ops endpoint (weir/service.py's) whose readiness the test sets."""
    state: dict = {"ready": False, "reason": "loading the models: tiny: warming up"}
    app = ops_app(lambda: (state["ready"], {"reason": None if state["ready"] else state["reason"]}), lambda: "")
    sock = socket.create_server(("127.0.0.1", 0))  # bound here and served as it is: never free meanwhile
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield f"http://127.0.0.1:{port}/readyz", state
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_probe_reads_the_reason_of_a_503_and_the_200(readyz: tuple[str, dict]) -> None:
    url, state = readyz
    assert probe(url) == Probe(False, "loading the models: tiny: warming up")
    state["ready"] = True
    assert probe(url) == Probe(True, "ready")


def test_probe_of_a_port_nobody_listens_on() -> None:
    with DeadPort() as dead:
        assert probe(f"http://127.0.0.1:{dead.port}/readyz") == Probe(False, NOT_ANSWERING)


def test_wait_all_ready_says_each_step_and_stops_on_a_dead_service() -> None:
    answers = {
        "kafka": iter([Probe(False, "booting"), Probe(True, "ready")]),
        "worker": iter([Probe(False, "loading"), Probe(False, "loading"), Probe(True, "ready")]),
    }
    said: list[str] = []
    board = ReadinessBoard(["kafka", "worker"], started_s=0.0)
    wait_all_ready(board, lambda name: next(answers[name]), list, lambda name: "", 1e12, said.append, poll_s=0)
    assert [line.split(" s  ", 1)[-1] for line in said if " s  " in line] == [
        "kafka: booting; worker: loading",
        "worker: loading",
    ]
    assert [line.split(" (")[0] for line in said if "ready (" in line] == ["  kafka ready", "  worker ready"]

    with pytest.raises(RuntimeError, match="worker exited during startup:\nTraceback"):
        wait_all_ready(
            ReadinessBoard(["worker"], 0.0),
            lambda name: Probe(False, "loading"),
            lambda: ["worker"],
            lambda name: "Traceback ...",
            1e12,
            said.append,
            poll_s=0,
        )
    with pytest.raises(TimeoutError, match=r"not ready in time: worker \(loading\)"):
        wait_all_ready(
            ReadinessBoard(["worker"], 0.0),
            lambda name: Probe(False, "loading"),
            list,
            lambda name: "",
            0.0,
            said.append,
            poll_s=0,
        )


def test_a_service_that_answered_before_and_not_now_is_busy_not_starting_over() -> None:
    """issue 35: a worker whose loop was busy for a moment read as `starting: importing` again."""
    board = ReadinessBoard(["worker"], started_s=T0)
    board.update("worker", Probe(False, "bringing up the model versions: echo@1: golden"), T0 + 1)
    assert board.waiting_line(T0 + 1) == "    1.0 s  worker: bringing up the model versions: echo@1: golden"
    board.update("worker", Probe(False, NOT_ANSWERING), T0 + 2)
    assert board.waiting_line(T0 + 2) is None  # nothing changed that a user should read


def test_probe_of_a_503_whose_body_never_comes_is_an_answer_not_an_error() -> None:
    """The headers of a 503, then nothing (a service whose loop stalled mid-answer): weir up died of
    the read's timeout (issue 35); now it is that 503."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]

        def answer_headers_only() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{"
                )
                threading.Event().wait(2.0)  # hold the connection while the probe times out

        thread = threading.Thread(target=answer_headers_only, daemon=True)
        thread.start()
        assert probe(f"http://127.0.0.1:{port}/readyz", timeout_s=0.5) == Probe(False, "HTTP 503")
        thread.join(5)
