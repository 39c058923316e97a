"""A broker restart (kill -9, then up again on the same data dir) with streams in flight: the
services ride it out and every stream ends once with the text of its seeded rerun."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from weir.kafka import launcher
from weir.stack import free_ports

from .conftest import start_pipeline
from .test_faults import KILL_AFTER_FIRST_TOKEN_S, NUM_REQUESTS, assert_each_ends_once, stream_one

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
BROKER_DOWN_S = 2.0  # the broker stays dead this long before it is started again on its data dir


@pytest.mark.parametrize(
    "delivery_timeout_ms",
    [
        30_000,  # the default: the outage (~15 s here) is shorter, and the producers' retries cover it
        3_000,  # shorter than the outage: sends fail, and the services must redo what they lost
    ],
)
async def test_a_broker_killed_and_restarted_mid_stream_loses_no_request(tmp_path, delivery_timeout_ms: int) -> None:
    port, controller_port = free_ports(2)
    broker = launcher.BrokerConfig(port=port, controller_port=controller_port, data_dir=tmp_path / "broker")
    await launcher.up(broker, timeout_s=120)
    pipeline = None
    try:
        pipeline = await asyncio.to_thread(
            start_pipeline, tmp_path, broker.bootstrap, WEIR_PRODUCER_REQUEST_TIMEOUT_MS=str(delivery_timeout_ms)
        )
        log: dict = {}
        started = asyncio.Event()
        async with httpx.AsyncClient(
            base_url=pipeline.base_url, timeout=300, limits=httpx.Limits(max_connections=64)
        ) as client:
            tasks = [asyncio.create_task(stream_one(client, i, started, log, i * 0.05)) for i in range(NUM_REQUESTS)]
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.sleep(KILL_AFTER_FIRST_TOKEN_S)
            in_flight = NUM_REQUESTS - len(log)
            pid = launcher.running_pid(broker)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(BROKER_DOWN_S)  # the outage (a scenario setting, not a wait for an event)
            await launcher.up(broker, timeout_s=120)  # same data dir: what was acknowledged is there
            await asyncio.wait_for(asyncio.gather(*tasks), 300)
        assert in_flight >= 20
        await assert_each_ends_once(pipeline, log)
        assert pipeline.stack.dead() == [], "a service died with the broker"
    finally:
        if pipeline is not None:
            pipeline.stack.stop_all()
        await asyncio.to_thread(launcher.stop, broker)
