"""The restart policy of `weir up` (weir/supervision.py), with explicit times."""

from __future__ import annotations

import signal

import pytest

from weir.supervision import RestartPolicy, Supervisor, describe_exit


def test_first_exit_restarts_at_once_then_the_delay_doubles_up_to_the_cap() -> None:
    sup = Supervisor(RestartPolicy(first_delay_s=0, base_delay_s=1, max_delay_s=4, healthy_after_s=60, max_restarts=6))
    sup.on_start("worker", 0.0)
    delays = []
    now = 0.0
    for _ in range(6):
        now += 5  # each run dies 5 s after its start: a crash loop
        delays.append(sup.on_exit("worker", now))
        sup.on_start("worker", now)
    assert delays == [0, 1, 2, 4, 4, 4]


def test_by_default_a_crash_loop_is_retried_forever_at_the_capped_delay() -> None:
    sup = Supervisor()
    sup.on_start("batcher", 0.0)
    delays = []
    for t in range(1, 101):
        delays.append(sup.on_exit("batcher", float(t)))
        sup.on_start("batcher", float(t))
    assert None not in delays and delays[-1] == sup.policy.max_delay_s


def test_with_a_limit_a_service_that_keeps_dying_is_given_up() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=2))
    sup.on_start("batcher", 0.0)
    assert sup.on_exit("batcher", 1.0) is not None
    sup.on_start("batcher", 1.0)
    assert sup.on_exit("batcher", 2.0) is not None
    sup.on_start("batcher", 2.0)
    assert sup.on_exit("batcher", 3.0) is None
    assert sup.num_quick_exits("batcher") == 3


def test_a_run_that_stayed_up_starts_the_count_over() -> None:
    sup = Supervisor(RestartPolicy(base_delay_s=1, healthy_after_s=60, max_restarts=2))
    sup.on_start("worker", 0.0)
    assert sup.on_exit("worker", 1.0) == 0
    sup.on_start("worker", 1.0)
    assert sup.on_exit("worker", 2.0) == 1
    sup.on_start("worker", 2.0)
    # up for two minutes this time: a fresh kill -9, not the third crash in a row
    assert sup.on_exit("worker", 122.0) == 0
    assert sup.num_quick_exits("worker") == 1


def test_services_are_counted_apart() -> None:
    sup = Supervisor(RestartPolicy(max_restarts=1))
    for name in ("worker", "gateway"):
        sup.on_start(name, 0.0)
    assert sup.on_exit("worker", 1.0) == 0
    assert sup.on_exit("gateway", 1.0) == 0
    assert sup.num_quick_exits("auditor") == 0


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="base_delay_s"):
        RestartPolicy(base_delay_s=10, max_delay_s=5)


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(None) == "still running"


def test_each_instance_of_a_service_is_restarted_on_its_own() -> None:
    """`weir up --workers 2`: worker-2 in a crash loop neither delays nor counts against worker."""
    sup = Supervisor(RestartPolicy(first_delay_s=0, base_delay_s=1, max_delay_s=4, max_restarts=2))
    for name in ("worker", "worker-2"):
        sup.on_start(name, 0.0)
    assert [sup.on_exit("worker-2", t) for t in (1.0, 2.0, 3.0)] == [0, 1, None]  # gives up on worker-2
    assert sup.on_exit("worker", 4.0) == 0 and sup.num_quick_exits("worker") == 1
