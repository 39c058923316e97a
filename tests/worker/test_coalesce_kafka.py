"""Coalesced reply deltas on the real broker: a run whose outputs come faster than Kafka
acknowledges them writes merged deltas, its regeneration at low load writes one delta per output,
and a gateway's ReplyRouter reading both from the topic delivers each position once: the text of
an undisturbed run (docs/wire-contract.md, "Reading replies")."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas.codec import decode_reply
from schemas.messages import ReplyDelta, ReplyEnd
from schemas.reply_stream import ReplyCursor
from schemas.topics import Topics
from services.gateway.replies import ReplyRouter
from services.worker.kafka.delivery import Writer
from services.worker.kafka.dispatch import Dispatch
from services.worker.kafka.intake import InFlight, Intake
from services.worker.kafka.publisher import Publisher
from tests.conftest import BOOTSTRAP
from tests.kafka_helpers import read_until
from weir.bus import BusSettings, make_producer
from weir.kafka.admin import ensure_topics

from .factories import make_model_config, make_output, make_request

pytestmark = pytest.mark.kafka

WORDS = ["def", " main", "():", "\n", "    ", "ret", "urn", " 0", "\n"]


def outputs(rid: str) -> list:
    """One output per token; the last one ends the request with `length`."""
    outs = [make_output(rid, i, text=w, token_ids=[50 + i]) for i, w in enumerate(WORDS[:-1])]
    last = len(WORDS) - 1
    outs.append(
        make_output(
            rid,
            last,
            text=WORDS[-1],
            token_ids=[50 + last],
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=len(WORDS),
            prompt_text="p",
            output_text="".join(WORDS),
        )
    )
    return outs


async def write_two_runs(loaded_first: bool = True) -> tuple[str, str]:
    """A request's first run, dying after six tokens, its outputs faster than Kafka acknowledges
    them, then its regeneration at low load, through the real Publisher (`loaded_first` False: the
    first run at low load dying after three tokens, the regeneration under load); (request_id,
    reply topic)."""
    topics = Topics(f"t{uuid.uuid4().hex[:8]}")
    reply_to = topics.replies("coalesce")
    audit_sink = topics.replies("audit-sink")  # the runs' AuditEvents land here, out of the way
    await ensure_topics(BOOTSTRAP, [topics.reply_spec("coalesce"), topics.reply_spec("audit-sink")])
    producer = make_producer(BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=topics.prefix), "coalesce-test")
    await producer.start()
    try:
        writer = Writer(producer)
        request = make_request("p", model="tiny", reply_to=reply_to)
        host = SimpleNamespace(weights_sha256="0" * 64, cancel=lambda rid: None)

        async def run(outs: list, pace: bool) -> None:
            intake = Intake()
            flight = InFlight(request, "b1", host=host)
            intake.in_flight[request.request_id] = flight
            config = make_model_config("tiny")
            publisher = Publisher(
                config, writer, audit_sink, intake, Dispatch(config, []), worker_id="w", audit_key=b"k" * 32
            )
            for out in outs:
                await publisher.send_output(flight, out)  # back to back: faster than any acknowledgement
                if pace:  # low load: each record is acknowledged before the next output
                    await asyncio.wait_for(asyncio.gather(*flight.futures), 10)
            if flight.lane is not None:
                await asyncio.wait_for(flight.lane.drained(), 10)
            await asyncio.wait_for(asyncio.gather(*flight.futures), 10)

        if loaded_first:
            await run(outputs(request.request_id)[:6], pace=False)  # the first run dies after six tokens
            await run(outputs(request.request_id), pace=True)  # regenerated: same seed, same tokens
        else:
            await run(outputs(request.request_id)[:3], pace=True)
            await run(outputs(request.request_id), pace=False)
    finally:
        await producer.stop()
    return request.request_id, reply_to


async def test_a_run_coalesced_under_load_and_its_regeneration_read_as_one_undisturbed_reply():
    request_id, reply_to = await write_two_runs()
    records = await read_until(
        BOOTSTRAP, [reply_to], lambda rs: any(decode_reply(r.value).type == "end" for r in rs), 30
    )
    events = [decode_reply(r.value) for r in records]
    first_run = events[: len(events) - len(WORDS) - 1]
    assert [(e.seq, e.count) for e in first_run] == [(0, 1), (1, 5)]  # merged while the first was in flight
    assert [(e.seq, e.count) for e in events[len(first_run) : -1]] == [(i, 1) for i in range(len(WORDS))]
    assert isinstance(events[-1], ReplyEnd) and events[-1].seq == len(WORDS)

    router = ReplyRouter()
    queue = router.register(request_id)
    cursor = ReplyCursor()
    for event in events:
        router.on_event(event)
        cursor.take(event)
    delivered = []
    while not queue.empty():
        delivered.append(queue.get_nowait())
    assert "".join(e.text for e in delivered if isinstance(e, ReplyDelta)) == "".join(WORDS)
    assert [e.seq for e in delivered] == [0, 1, 6, 7, 8, 9]  # the rerun's positions 0..5 were dropped
    assert [t for e in delivered if isinstance(e, ReplyDelta) for t in e.token_ids] == [
        50 + i for i in range(len(WORDS))
    ]
    assert cursor.missing == 0 and cursor.have == len(WORDS)


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
@pytest.mark.parametrize("loaded_first", [True, False])
async def test_the_readmes_kcat_and_jq_reader_prints_the_undisturbed_text(loaded_first: bool):
    request_id, reply_to = await write_two_runs(loaded_first)
    records = await read_until(
        BOOTSTRAP, [reply_to], lambda rs: any(decode_reply(r.value).type == "end" for r in rs), 30
    )
    assert any(decode_reply(r.value).count > 1 for r in records if decode_reply(r.value).type == "delta")
    kcat_output = b"".join(r.value + b"\n" for r in records)  # what `kcat -C ... -e` prints: one value a line
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    start = readme.index("      | jq -nj")
    jq = (
        readme[start : readme.index("\n\n", start)]
        .replace("      | ", "", 1)
        .replace("--arg rid r1", f"--arg rid {request_id}")
    )
    done = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", jq], input=kcat_output, capture_output=True, timeout=30, check=True
    )
    assert done.stdout.decode() == "".join(WORDS) + "\n[length]\n"
