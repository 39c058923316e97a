"""`weir up` gives each service the HTTP port its variable names, as the README says; otherwise
its default, or any free port when that one is taken; and each instance of a service (--workers,
--gateways) its own port, name and id."""

from __future__ import annotations

import contextlib
import socket

import pytest

from weir import stack as up
from weir.kafka.launcher import BrokerConfig
from weir.stack import (
    DEFAULT_HTTP_PORTS,
    HTTP_PORT_ENV,
    free_ports,
    instance_envs,
    instance_names,
    port_taken,
    service_of,
    service_ports,
)


def test_a_port_variable_is_honoured() -> None:
    audit, batcher, worker = free_ports(3)
    env = {
        "WEIR_AUDIT_API_PORT": str(audit),
        "WEIR_BATCHER_HTTP_PORT": str(batcher),
        "WEIR_WORKER_HTTP_PORT": str(worker),
    }
    assert service_ports(28000, env) == {"gateway": 28000, "auditor": audit, "batcher": batcher, "worker": worker}


def test_without_variables_a_taken_default_moves_to_a_free_port_and_a_chosen_one_is_left_alone() -> None:
    with socket.socket() as held:
        with contextlib.suppress(OSError):  # where 8100 is in use already, it is taken either way
            held.bind(("127.0.0.1", DEFAULT_HTTP_PORTS["auditor"]))
        ports = service_ports(28000, {})
    assert ports["auditor"] != DEFAULT_HTTP_PORTS["auditor"] and len(set(ports.values())) == 4
    (chosen,) = free_ports(1)
    ports = service_ports(28000, {"WEIR_WORKER_HTTP_PORT": str(chosen)})
    assert ports["worker"] == chosen and list(ports.values()).count(chosen) == 1


@pytest.mark.parametrize("value", ["http", "0", "70000", "-1", "28000"])
def test_a_bad_or_clashing_variable_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match=HTTP_PORT_ENV["batcher"]):
        service_ports(28000, {"WEIR_BATCHER_HTTP_PORT": value})


def test_each_instance_gets_its_own_port_next_to_the_first_where_free() -> None:
    gateway = next(p for p in free_ports(8) if not port_taken(p + 1) and not port_taken(p + 2))
    worker = next(p for p in free_ports(8) if not port_taken(p + 1) and abs(p - gateway) > 2)
    audit, batcher = [p for p in free_ports(8) if p not in {gateway + 1, gateway + 2, worker, worker + 1}][:2]
    env = {
        "WEIR_WORKER_HTTP_PORT": str(worker),
        "WEIR_AUDIT_API_PORT": str(audit),
        "WEIR_BATCHER_HTTP_PORT": str(batcher),
    }
    with socket.socket() as held:  # gateway+2 is taken: gateway-3 moves to a free port instead
        held.bind(("127.0.0.1", gateway + 2))
        ports = service_ports(gateway, env, counts={"gateway": 3, "worker": 2})
    assert ports == {
        "gateway": gateway,
        "gateway-2": gateway + 1,
        "gateway-3": ports["gateway-3"],
        "auditor": audit,
        "worker": worker,
        "worker-2": worker + 1,
        "batcher": batcher,
    }
    assert len(set(ports.values())) == len(ports) and ports["gateway-3"] != gateway + 2


def test_each_instance_has_its_own_id_and_reply_topic_and_keeps_its_service(tmp_path) -> None:
    ports = {"gateway": 28001, "gateway-2": 28002, "worker": 28003, "worker-2": 28004, "auditor": 28005}
    envs = instance_envs(ports, BrokerConfig(secure=False))
    secure = instance_envs(ports, BrokerConfig(data_dir=tmp_path, secure=True, secrets_dir=tmp_path / "secrets"))
    assert [secure[n]["WEIR_KAFKA_USER"] for n in ports] == ["gateway", "gateway", "worker", "worker", "auditor"]
    assert secure["worker-2"]["WEIR_WORKER_INSTANCE"] == "worker-2"  # its principal's login and its own id
    assert [envs[n]["WEIR_GATEWAY_ID"] for n in ("gateway", "gateway-2")] == ["gateway-up-28001", "gateway-up-28002"]
    assert [envs[n]["WEIR_WORKER_INSTANCE"] for n in ("worker", "worker-2")] == ["worker-1", "worker-2"]
    assert envs["auditor"] == {}
    assert instance_names("worker", 3) == ["worker", "worker-2", "worker-3"]
    assert [service_of(n) for n in ports] == ["gateway", "gateway", "worker", "worker", "auditor"]


def test_a_restarted_instance_runs_its_own_service_with_its_own_settings(tmp_path, monkeypatch) -> None:
    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(up.subprocess, "Popen", lambda argv, env, **_: started.append((argv, env)) or argv)
    stack = up.Stack(
        {"WEIR_WORKER_HTTP_PORT": "1"},
        tmp_path,
        http_ports={"worker-2": 28004},
        own_env={"worker-2": {"WEIR_WORKER_INSTANCE": "worker-2"}},
    )
    stack.start("worker-2", service="worker")
    stack.start("worker-2")  # as weir up's supervise() restarts it
    for argv, env in started:
        assert (
            argv[-1] == "worker"
            and env["WEIR_WORKER_HTTP_PORT"] == "28004"
            and env["WEIR_WORKER_INSTANCE"] == "worker-2"
        )
    with pytest.raises(ValueError, match="worker-2 runs worker, not gateway"):
        stack.start("worker-2", service="gateway")


@pytest.mark.parametrize("value", ["0", "9", "two", "-1"])
def test_weir_up_refuses_a_count_outside_one_to_eight(value: str, capsys) -> None:
    for flag in ("--workers", "--gateways"):
        with pytest.raises(SystemExit):
            up.build_parser().parse_args([flag, value])
        assert "not a number of instances from 1 to 8" in capsys.readouterr().err
    assert up.build_parser().parse_args(["--workers", "8", "--gateways", "2"]).workers == 8
    for counts in ({"worker": 9}, {"gateway": 0}, {"auditor": 2}):  # nor does service_ports take them
        with pytest.raises(ValueError, match="weir up runs 1 to 8 of worker, gateway each"):
            service_ports(28000, {}, counts=counts)


def test_a_stack_holds_each_port_from_its_pick_through_restarts_and_hands_the_socket_down(
    tmp_path, monkeypatch
) -> None:
    # The pick-then-release race: a port picked free, released, then bound by the service later may
    # meanwhile be handed to another service (a `make test` lost a run to it). The stack binds each
    # port itself, keeps it while the stack lives, and passes the socket (weir/service.py: HTTP_FD_ENV).
    started: list[tuple[dict[str, str], tuple[int, ...]]] = []
    monkeypatch.setattr(
        up.subprocess, "Popen", lambda argv, env, pass_fds=(), **_: started.append((env, pass_fds)) or argv
    )
    with socket.create_server(("127.0.0.1", 0)) as taken:
        taken_port = taken.getsockname()[1]
        stack = up.Stack({}, tmp_path, http_ports={"batcher": taken_port})
        for name in ("gateway", "worker", "worker", "batcher"):  # the worker restarted once
            stack.start(name)
        gateway, worker, worker_again, batcher = started
        assert batcher[1] == () and up.HTTP_FD_ENV not in batcher[0]  # taken: the service says so itself
        assert batcher[0]["WEIR_BATCHER_HTTP_PORT"] == str(taken_port)
    ports = {name: stack.http_ports[name] for name in ("gateway", "worker")}
    assert len(set(ports.values())) == 2 and 0 not in ports.values()
    for (env, fds), name in ((gateway, "gateway"), (worker, "worker"), (worker_again, "worker")):
        assert fds == (int(env[up.HTTP_FD_ENV]),) == (stack.listeners[name].fileno(),)
        assert env[up.HTTP_PORT_ENV[name]] == str(ports[name])
    for port in ports.values():  # listening while no service runs: nobody else can be given the port
        assert up.port_taken(port)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    stack.procs.clear()  # none really started
    stack.stop_all()
    assert stack.listeners == {}
