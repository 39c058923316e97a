"""Admission from the queue on the whole pipeline (issue 35): streams started together on a paced
echo model are admitted when the worker runs them all at once, even though its drain rate was
measured while it ran one request at a time; a request that cannot make its deadline is still
refused. docs/gateway.md, "Admission control"; services/gateway/queue_wait.py."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from schemas.codec import decode
from schemas.messages import WorkerHeartbeat, now_ms
from weir.bus import BusSettings, read_topic

from .conftest import start_pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STEP_MS = 50  # the echo model's pace: 20 words a second
WORDS = 60  # each stream echoes 60 words: 3 s at that pace (slower on a loaded machine)
WAVE = 24  # streams started together, twice


@pytest.fixture(scope="module")
def paced_echo(tmp_path_factory):
    p = start_pipeline(
        tmp_path_factory.mktemp("queue"),
        WEIR_MODELS="echo",
        WEIR_AUDIT_FINGERPRINT_MODEL="",
        WEIR_ECHO_STEP_DELAY_MS=str(STEP_MS),
        WEIR_LAG_INTERVAL_S="1",
    )
    yield p
    p.stack.stop_all()


def body(i: int) -> dict:
    return {
        "model": "echo",
        "prompt": " ".join(f"w{i}-{n}" for n in range(WORDS)),
        "max_tokens": WORDS + 1,
        "stream": True,
    }


async def stream(client: httpx.AsyncClient, i: int, timeout_s: float) -> tuple[int, str]:
    """(status, the error code or the streamed text) of one streamed completion."""
    headers = {"x-weir-timeout-s": str(timeout_s)}
    async with client.stream("POST", "/v1/completions", json=body(i), headers=headers) as response:
        raw = (await response.aread()).decode()
    if response.status_code != 200:
        return response.status_code, raw
    return 200, raw


async def echo_running(p, at_least: int, timeout_s: float = 60) -> WorkerHeartbeat:
    """The first fresh heartbeat of the echo worker with `at_least` requests running."""
    settings = BusSettings(kafka_bootstrap=p.bootstrap, topic_prefix=p.topics.prefix)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _key, value in await read_topic(settings, p.topics.workers):
            hb = decode(WorkerHeartbeat, value)
            if now_ms() - hb.sent_ms < 3000 and hb.num_running >= at_least:
                return hb
        await asyncio.sleep(0.2)
    raise AssertionError(f"no heartbeat showed {at_least} echo requests running")


@pytest.mark.timeout(600)
async def test_streams_started_together_are_not_refused_on_a_rate_measured_one_at_a_time(paced_echo):
    p = paced_echo
    async with httpx.AsyncClient(base_url=p.base_url, timeout=120) as client:
        # One request at a time for 6 busy seconds or more: the measured rate is at most 1/3 end a second.
        for i in range(2):
            status, text = await stream(client, i, 90)
            assert status == 200 and "[DONE]" in text
        first = [asyncio.create_task(stream(client, 100 + i, 90)) for i in range(WAVE)]
        hb = await echo_running(p, WAVE * 3 // 4)
        # At the measured rate alone the queue would be "24 ahead at 0.33/s", 72 s or more: the old
        # estimate refused every request below, 45 s from its deadline.
        assert hb.finished_per_s is not None and hb.finished_per_s < 1.0, hb
        assert hb.service_s is not None and WORDS * STEP_MS / 1000 <= hb.service_s < 60, hb
        # The estimate still refuses what cannot fit: a request with half a second left (the gateway
        # reads the heartbeat a moment after this test did: a request it admits before ends in a timeout).
        probes = []
        for attempt in range(5):
            probes.append(await stream(client, 900 + attempt, 0.5))
            if probes[-1][0] == 429:
                break
        assert probes[-1][0] == 429 and "queue_too_long" in probes[-1][1], probes
        second = [asyncio.create_task(stream(client, 200 + i, 45)) for i in range(WAVE)]
        results = await asyncio.gather(*first, *second)
    refused = [text for status, text in results if status != 200]
    assert refused == [], f"{len(refused)} refused, e.g. {refused[0][:300]}"
    unfinished = [text for _, text in results if '"finish_reason":"stop"' not in text or "[DONE]" not in text]
    assert unfinished == [], f"{len(unfinished)} of {len(results)} did not finish, e.g. {unfinished[0][-400:]}"
