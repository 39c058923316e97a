"""`weir up` gives each service the HTTP port its variable names, as the README says; otherwise
its default, or any free port when that one is taken."""

from __future__ import annotations

import contextlib
import socket

import pytest

from weir.launcher import DEFAULT_HTTP_PORTS, HTTP_PORT_ENV, free_ports, service_ports


def test_a_port_variable_is_honoured() -> None:
    audit, batcher, worker = free_ports(3)
    env = {"WEIR_AUDIT_API_PORT": str(audit), "WEIR_BATCHER_HTTP_PORT": str(batcher),
           "WEIR_WORKER_HTTP_PORT": str(worker)}  # fmt: skip
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
