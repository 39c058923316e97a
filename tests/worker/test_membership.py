"""The worker's group settings (services/worker/kafka/membership.py): derived and refused as documented."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.worker.config import WorkerSettings
from services.worker.kafka.membership import Membership
from weir.bus import BusSettings, consumer_settings


def test_the_group_heartbeat_is_a_quarter_of_the_session_unless_set_and_never_reaches_it(monkeypatch):
    monkeypatch.delenv("WEIR_WORKER_INSTANCE", raising=False)
    assert Membership.of(WorkerSettings(worker_session_timeout_ms=2000)) == Membership(2000, 500, None)
    assert (
        Membership.of(WorkerSettings(worker_group_heartbeat_ms=300, worker_instance="worker-1")).heartbeat_interval_ms
        == 300
    )
    with pytest.raises(ValidationError, match="WEIR_WORKER_GROUP_HEARTBEAT_MS"):
        WorkerSettings(worker_session_timeout_ms=2000, worker_group_heartbeat_ms=2000)
    with pytest.raises(ValidationError):
        WorkerSettings(worker_instance="worker 1")  # not a legal group.instance.id here
    with pytest.raises(ValueError, match="below the session"):
        consumer_settings(BusSettings(), session_timeout_ms=2000, heartbeat_interval_ms=2000)
