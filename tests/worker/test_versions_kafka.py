"""The worker follows the registry, against the real broker: hot load, drain, verification, budget,
goldens (services/worker/versions.py; docs/design.md, "The model registry")."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from schemas.codec import decode, decode_registry_record, decode_reply, encode
from schemas.messages import Batch, ReplyDelta, ReplyEnd, WorkerHeartbeat
from schemas.model_repo import ModelConfig
from schemas.registry import ModelHealthEvent, ModelRoute, ModelVersionRecord
from schemas.topics import Topics
from services.worker.app import WorkerService
from services.worker.config import WorkerSettings
from services.worker.hosts.goldens import record_goldens
from tests.kafka_helpers import produce, read_until, wait_committed
from weir.kafka.admin import ensure_topics
from weir.metrics import value
from weir.models.manifest import pack
from weir.models.signing import generate_keypair, sign
from weir.registry import promote, publish, read_registry, register, set_desired

from .factories import make_request

pytestmark = pytest.mark.kafka
# How long a request for a version the worker refused is watched for an answer, once a request in
# the same worker was answered: it reads its batch topics in one loop, so an answer would be due at
# once; 3 s is the 2 s wait plus the 1 s read this replaces.
NEVER_SERVED_S = 3.0
from tests.conftest import BOOTSTRAP  # noqa: E402 - WEIR_KAFKA_BOOTSTRAP, else 127.0.0.1:9092

ECHO_REPO = """
[models.echo]
engine = "echo"
max_model_len = 4096
"""


def worker_settings(tmp_path: Path, **overrides) -> WorkerSettings:
    repo = tmp_path / "models.toml"
    repo.write_text(ECHO_REPO)
    fields = dict(
        kafka_bootstrap=BOOTSTRAP,
        topic_prefix=f"t{uuid.uuid4().hex[:8]}",
        model_repo=str(repo),
        heartbeat_interval_ms=200,
        audit_fingerprint_model="",
        engine_isolation="thread",
        drain_quiet_ms=500,
    )
    fields.update(overrides)
    return WorkerSettings(**fields)


async def wait_beat(topics: Topics, is_it: Callable[[WorkerHeartbeat], bool], timeout_s: float = 60) -> WorkerHeartbeat:
    """The first heartbeat for which is_it() holds (read from the topic's start)."""

    def beats(records) -> list[WorkerHeartbeat]:
        return [hb for hb in (decode(WorkerHeartbeat, r.value) for r in records) if is_it(hb)]

    records = await read_until(BOOTSTRAP, [topics.workers], lambda rs: bool(beats(rs)), timeout_s)
    found = beats(records)
    assert found, f"no such heartbeat came; the last: {decode(WorkerHeartbeat, records[-1].value) if records else None}"
    return found[0]


def state_of(hb: WorkerHeartbeat, served_id: str) -> str | None:
    status = hb.versions.get(served_id)
    return status.state if status is not None else None


def ends_of(records) -> dict[str, ReplyEnd]:
    return {e.request_id: e for e in (decode_reply(r.value) for r in records) if isinstance(e, ReplyEnd)}


async def health_events(topics: Topics, is_done: Callable[[list[ModelHealthEvent]], bool]) -> list[ModelHealthEvent]:
    def events(records) -> list[ModelHealthEvent]:
        return [decode(ModelHealthEvent, r.value) for r in records]

    return events(await read_until(BOOTSTRAP, [topics.model_health], lambda rs: is_done(events(rs)), 30))


async def serve_text(topics: Topics, batch_id: str, replies: str) -> str:
    """What tiny@1 answers to a greedy prompt (its ReplyEnd naming tiny@1)."""
    request = make_request("def add(a, b):", model="tiny", reply_to=replies, max_tokens=6, temperature=0.0)
    batch = Batch(batch_id=batch_id, model="tiny@1", requests=[request], batcher_id="test")
    await produce(BOOTSTRAP, topics.batches("tiny@1"), [(batch_id, encode(batch))])
    records = await read_until(BOOTSTRAP, [replies], lambda rs: request.request_id in ends_of(rs), 60)
    end = ends_of(records)[request.request_id]
    assert end.model_version == "tiny@1" and end.error is None and end.usage.completion_tokens > 0
    return "".join(
        e.text
        for e in (decode_reply(r.value) for r in records)
        if isinstance(e, ReplyDelta) and e.request_id == request.request_id
    )


async def start(settings: WorkerSettings) -> tuple[WorkerService, asyncio.Task]:
    await ensure_topics(BOOTSTRAP, [*settings.topics.core_specs(), settings.topics.reply_spec("test")])
    service = WorkerService(settings)
    return service, asyncio.create_task(service.serve())


async def test_a_pushed_version_is_served_and_the_old_one_drains_without_cutting_a_request(tmp_path):
    settings = worker_settings(tmp_path, echo_step_delay_ms=20)
    topics, replies = settings.topics, settings.topics.replies("test")
    _service, task = await start(settings)
    try:
        await wait_beat(topics, lambda hb: state_of(hb, "echo@1") == "ready" and hb.is_ready)
        state = await read_registry(settings)
        assert state.versions["echo@1"].desired == "loaded" and state.routes["echo"].default_version == "1"  # seeded

        v2 = ModelConfig(name="echo", version="2", engine="echo", max_model_len=4096)
        await publish(settings, register(state, ModelVersionRecord(manifest=pack(v2), registered_by="test")))
        beat = await wait_beat(topics, lambda hb: state_of(hb, "echo@2") == "ready")
        assert sorted(beat.models) == ["echo@1", "echo@2"] and "echo@2" in beat.partitions
        quick = make_request("one two", model="echo@2", reply_to=replies, max_tokens=8)
        await produce(
            BOOTSTRAP,
            topics.batches("echo@2"),
            [("b2", encode(Batch(batch_id="b2", model="echo@2", requests=[quick], batcher_id="test")))],
        )
        records = await read_until(BOOTSTRAP, [replies], lambda rs: quick.request_id in ends_of(rs))
        assert ends_of(records)[quick.request_id].model_version == "echo@2"

        # A long request runs on echo@1 when echo@2 is promoted (echo@1 asked to unload): it finishes.
        slow = make_request("word " * 150, model="echo", reply_to=replies, max_tokens=400)  # ~3 s at 20 ms a step
        await produce(
            BOOTSTRAP,
            topics.batches("echo@1"),
            [("b1", encode(Batch(batch_id="b1", model="echo@1", requests=[slow], batcher_id="test")))],
        )
        await read_until(
            BOOTSTRAP, [replies], lambda rs: any(decode_reply(r.value).request_id == slow.request_id for r in rs)
        )
        await publish(settings, promote(await read_registry(settings), "echo@2", by="test"))
        draining = await wait_beat(topics, lambda hb: state_of(hb, "echo@1") == "draining", 30)
        assert "echo@1" in draining.partitions and "echo@1" not in draining.models

        records = await read_until(BOOTSTRAP, [replies], lambda rs: slow.request_id in ends_of(rs), 60)
        end = next(
            r for r in records if isinstance(e := decode_reply(r.value), ReplyEnd) and e.request_id == slow.request_id
        )
        finished = decode_reply(end.value)
        assert finished.error is None and finished.finish_reason == "stop" and finished.model_version == "echo@1"
        text = "".join(
            e.text
            for e in (decode_reply(r.value) for r in records)
            if isinstance(e, ReplyDelta) and e.request_id == slow.request_id
        )
        assert text.split() == ["word"] * 150  # not cut

        gone = await wait_beat(topics, lambda hb: "echo@1" not in hb.versions and state_of(hb, "echo@2") == "ready", 30)
        assert gone.sent_ms >= end.timestamp and gone.models == ["echo@2"] and "echo@1" not in gone.partitions
        lag = await wait_committed(BOOTSTRAP, topics.worker_group("echo@1"), topics.batches("echo@1"))
        assert all(c == e for c, e in lag.values()), lag
        events = await health_events(topics, lambda es: any(e.event == "unloaded" for e in es))
        assert [(e.model, e.event) for e in events] == [
            ("echo@1", "loaded"),
            ("echo@2", "loaded"),
            ("echo@1", "unloaded"),
        ]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_changed_file_fails_its_version_and_one_too_big_is_refused_while_the_others_serve(tmp_path, llama_dir):
    copy = shutil.copytree(llama_dir, tmp_path / "tiny-2")
    tiny = ModelConfig(name="tiny", version="2", engine="torch", path=copy, max_model_len=128, warmup=["def "])
    manifest = pack(tiny)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight, after packing
    weights.write_bytes(bytes(data))
    big = ModelConfig(name="echo", version="3", engine="echo", max_model_len=4096)

    settings = worker_settings(tmp_path, worker_memory_bytes=1_000_000)
    topics, replies = settings.topics, settings.topics.replies("test")
    _service, task = await start(settings)
    try:
        await wait_beat(topics, lambda hb: state_of(hb, "echo@1") == "ready")
        state = await read_registry(settings)
        await publish(
            settings,
            [
                *register(state, ModelVersionRecord(manifest=manifest)),
                ModelVersionRecord(manifest=pack(big), budget_bytes=5_000_000),
            ],
        )
        beat = await wait_beat(
            topics, lambda hb: state_of(hb, "tiny@2") == "failed" and state_of(hb, "echo@3") == "refused"
        )
        failed, refused = beat.versions["tiny@2"], beat.versions["echo@3"]
        assert "model.safetensors" in (failed.reason or "") and "changed since the version was packed" in (
            failed.reason or ""
        )
        assert refused.reason == "needs 5000000 bytes, 1000000 of 1000000 free on this worker"
        assert beat.models == ["echo@1"] and set(beat.partitions) == {"echo@1"} and beat.is_ready

        # echo@1 keeps serving; a batch on tiny@2's topic is read by no one.
        await ensure_topics(BOOTSTRAP, topics.model_specs("tiny@2"))
        never = make_request("def ", model="tiny@2", reply_to=replies, max_tokens=4)
        served = make_request("still here", model="echo@1", reply_to=replies, max_tokens=8)
        await produce(
            BOOTSTRAP,
            topics.batches("tiny@2"),
            [("t", encode(Batch(batch_id="t", model="tiny@2", requests=[never], batcher_id="test")))],
        )
        await produce(
            BOOTSTRAP,
            topics.batches("echo@1"),
            [("e", encode(Batch(batch_id="e", model="echo@1", requests=[served], batcher_id="test")))],
        )
        await read_until(BOOTSTRAP, [replies], lambda rs: served.request_id in ends_of(rs))
        # the worker polls every batch topic it serves in one loop: the request it does serve has
        # been answered, so one for tiny@2, if it were read, would be answered within this bound too
        assert never.request_id not in ends_of(
            await read_until(BOOTSTRAP, [replies], lambda rs: never.request_id in ends_of(rs), timeout_s=NEVER_SERVED_S)
        )
        events = await health_events(topics, lambda es: {"load_failed", "refused"} <= {e.event for e in es})
        assert {(e.model, e.event) for e in events} >= {("tiny@2", "load_failed"), ("echo@3", "refused")}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_corrupted_weights_fail_the_periodic_goldens_and_the_version_is_reloaded(tmp_path, llama_dir):
    config = ModelConfig(name="tiny", version="1", engine="torch", path=llama_dir, max_model_len=128, warmup=["def "])
    goldens = await asyncio.to_thread(record_goldens, config, ["def add(a, b):"], 6, WorkerSettings(device="cpu"))
    settings = worker_settings(tmp_path, models="tiny", fault_hooks=True, golden_interval_s=1.0)
    topics, replies = settings.topics, settings.topics.replies("test")
    await ensure_topics(BOOTSTRAP, settings.topics.core_specs())
    state = await read_registry(settings)
    await publish(settings, register(state, ModelVersionRecord(manifest=pack(config), goldens=goldens)))
    service, task = await start(settings)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=service.http_app()), base_url="http://worker")
    try:
        ready = await wait_beat(topics, lambda hb: state_of(hb, "tiny@1") == "ready")
        assert ready.versions["tiny@1"].golden_checked_ms is not None and ready.versions["tiny@1"].engine == "torch-cpu"
        before = await serve_text(topics, "before", replies)
        assert before
        missing = await http.post("/faults/corrupt-weights", params={"model": "tiny@9"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        hit = await http.post("/faults/corrupt-weights", params={"model": "tiny@1"})
        assert hit.status_code == 200 and hit.json() == {"model": "tiny@1", "corrupted_instances": 1}

        unhealthy = await wait_beat(topics, lambda hb: state_of(hb, "tiny@1") == "unhealthy", 30)
        assert "tiny@1" not in unhealthy.models and "tiny@1" not in unhealthy.partitions
        events = await health_events(topics, lambda es: any(e.event == "reloaded" for e in es))
        assert [e.event for e in events] == ["loaded", "golden_failed", "reloaded"]
        await wait_beat(topics, lambda hb: hb.sent_ms > events[-1].created_ms and state_of(hb, "tiny@1") == "ready")
        metrics = (await http.get("/metrics")).text
        assert value(metrics, "weir_worker_version_reloads", model="tiny@1") == 1
        assert value(metrics, "weir_worker_golden_failures", model="tiny@1") == 1

        # Served again, from verified weights: as before the corruption.
        assert await serve_text(topics, "after", replies) == before
    finally:
        await http.aclose()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_version_seeded_from_models_toml_records_its_goldens_here_and_is_reloaded_when_corrupted(
    tmp_path, llama_dir
):
    settings = worker_settings(tmp_path, models="tiny", fault_hooks=True, golden_interval_s=1.0)
    Path(settings.model_repo).write_text(f"""
[models.tiny]
engine = "torch"
path = "{llama_dir}"
max_model_len = 128
warmup = ["def add(a, b):"]
""")
    topics, replies = settings.topics, settings.topics.replies("test")
    service, task = await start(settings)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=service.http_app()), base_url="http://worker")
    try:
        ready = await wait_beat(topics, lambda hb: state_of(hb, "tiny@1") == "ready")
        assert ready.versions["tiny@1"].golden_checked_ms is not None
        assert (await read_registry(settings)).versions["tiny@1"].goldens == []  # seeded without: kept on the worker
        local = service.versions.versions["tiny@1"].goldens
        expected = await asyncio.to_thread(record_goldens, service.seeds[0], None, 8, WorkerSettings(device="cpu"))
        assert local == expected and local[0].expected_token_ids  # what a push would have recorded
        assert (
            value((await http.get("/metrics")).text, "weir_worker_version_goldens", model="tiny@1", source="local") == 2
        )
        before = await serve_text(topics, "before", replies)

        assert (await http.post("/faults/corrupt-weights", params={"model": "tiny@1"})).status_code == 200
        unhealthy = await wait_beat(topics, lambda hb: state_of(hb, "tiny@1") == "unhealthy", 30)
        assert "tiny@1" not in unhealthy.models
        events = await health_events(topics, lambda es: any(e.event == "reloaded" for e in es))
        assert [e.event for e in events] == ["loaded", "golden_failed", "reloaded"]
        assert events[0].detail.endswith("2 goldens (local)")  # greedy, and the seeded sampled case
        await wait_beat(topics, lambda hb: hb.sent_ms > events[-1].created_ms and state_of(hb, "tiny@1") == "ready")
        assert service.versions.versions["tiny@1"].goldens == local  # the reload is checked against the first load's
        assert await serve_text(topics, "after", replies) == before
    finally:
        await http.aclose()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_fault_hook_is_not_found_unless_fault_hooks_are_on(tmp_path):
    service = WorkerService(worker_settings(tmp_path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=service.http_app()), base_url="http://w") as http:
        answer = await http.post("/faults/corrupt-weights", params={"model": "echo@1"})
    assert answer.status_code == 404 and "WEIR_FAULT_HOOKS" in answer.json()["error"]["message"]


async def test_a_fresh_default_failing_its_goldens_is_rolled_back(tmp_path, llama_dir):
    settings = worker_settings(tmp_path, models="tiny", fault_hooks=True, golden_interval_s=1.0)
    topics = settings.topics
    one = ModelConfig(name="tiny", version="1", engine="torch", path=llama_dir, max_model_len=128, warmup=["def "])
    two = one.model_copy(update={"version": "2"})
    goldens = await asyncio.to_thread(record_goldens, two, ["def add(a, b):"], 6, WorkerSettings(device="cpu"))
    await ensure_topics(BOOTSTRAP, settings.topics.core_specs())
    await publish(settings, register(await read_registry(settings), ModelVersionRecord(manifest=pack(one))))
    await publish(settings, [ModelVersionRecord(manifest=pack(two), goldens=goldens)])
    service, task = await start(settings)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=service.http_app()), base_url="http://worker")
    try:
        await wait_beat(topics, lambda hb: state_of(hb, "tiny@1") == state_of(hb, "tiny@2") == "ready")
        await publish(settings, promote(await read_registry(settings), "tiny@2", by="test"))
        await wait_beat(topics, lambda hb: "tiny@1" not in hb.versions and state_of(hb, "tiny@2") == "ready")

        assert (await http.post("/faults/corrupt-weights", params={"model": "tiny@2"})).status_code == 200
        # No gap: tiny@1 wanted loaded and ready here while tiny@2, still the default, is out of routing.
        warm = await wait_beat(
            topics, lambda hb: state_of(hb, "tiny@1") == "ready" and state_of(hb, "tiny@2") == "unhealthy", 60
        )
        assert warm.models == ["tiny@1"]
        back = await wait_beat(topics, lambda hb: state_of(hb, "tiny@1") == "ready" and "tiny@2" not in hb.versions, 60)
        assert back.models == ["tiny@1"]
        state = await read_registry(settings)
        route = state.routes["tiny"]
        assert (route.default_version, route.previous_version) == ("1", "2") and route.reason.startswith(
            "rollback of tiny@2"
        )
        assert state.versions["tiny@2"].desired == "unloaded" and state.versions["tiny@1"].desired == "loaded"

        # The order on the registry topic (one partition): tiny@1 loaded, then (once it was ready) the route.
        records = [
            (r, decode_registry_record(r.value))
            for r in await read_until(BOOTSTRAP, [topics.models], lambda rs: False, timeout_s=3)
        ]
        reloaded = [
            r
            for r, rec in records
            if isinstance(rec, ModelVersionRecord)
            and rec.served_id == "tiny@1"
            and rec.desired == "loaded"
            and rec.registered_by.startswith("worker ")
        ]
        switched = [r for r, rec in records if isinstance(rec, ModelRoute) and rec.reason.startswith("rollback of")]
        assert len(reloaded) == len(switched) == 1 and reloaded[0].offset < switched[0].offset
        assert switched[0].timestamp >= warm.sent_ms  # switched only after tiny@1 was ready here
        events = await health_events(topics, lambda es: ("tiny@2", "unloaded") in {(e.model, e.event) for e in es})
        tiny2 = [e for e in events if e.model == "tiny@2"]
        assert [e.event for e in tiny2] == ["loaded", "golden_failed", "rolled_back", "unloaded"]
        assert "(tiny@1 ready here first)" in tiny2[2].detail
    finally:
        await http.aclose()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_with_signatures_required_only_versions_signed_by_a_trusted_key_load(tmp_path):
    trusted, untrusted = tmp_path / "trusted", tmp_path / "untrusted"
    trusted.mkdir(), untrusted.mkdir()
    generate_keypair(tmp_path / "ops.key", trusted / "ops.pub")
    generate_keypair(tmp_path / "stranger.key", untrusted / "stranger.pub")
    settings = worker_settings(tmp_path, model_trusted_keys=str(trusted), require_signed_models=True, fault_hooks=True)
    topics = settings.topics
    signed, forged = (ModelConfig(name="echo", version=v, engine="echo", max_model_len=4096) for v in ("2", "3"))
    service, task = await start(settings)
    try:
        beat = await wait_beat(topics, lambda hb: state_of(hb, "echo@1") == "failed")  # the models.toml entry: unsigned
        assert beat.versions["echo@1"].reason == "signature: unsigned manifest, signatures are required"
        assert beat.is_ready and beat.models == []
        is_ready, body = service.readiness()  # ready: a failed version does not hold readiness back
        assert is_ready and body["versions"] == {
            "echo@1": "failed: signature: unsigned manifest, signatures are required"
        }
        two, three = pack(signed), pack(forged)
        await publish(
            settings,
            [
                ModelVersionRecord(manifest=two, signature=sign(two, tmp_path / "ops.key")),
                ModelVersionRecord(manifest=three, signature=sign(three, tmp_path / "stranger.key")),
            ],
        )
        beat = await wait_beat(
            topics, lambda hb: state_of(hb, "echo@2") == "ready" and state_of(hb, "echo@3") == "failed"
        )
        assert (beat.versions["echo@3"].reason or "").startswith("signature: signed by unknown key ")
        assert beat.models == ["echo@2"]
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=service.http_app()), base_url="http://w"
        ) as http:
            echo = await http.post("/faults/corrupt-weights", params={"model": "echo@2"})
            nameless = await http.post("/faults/corrupt-weights")
        assert (
            echo.status_code == 400
            and echo.json()["error"]["message"] == "echo@2: the echo engine has no weights to corrupt"
        )
        assert nameless.status_code == 400 and nameless.json()["error"]["code"] == "missing_model"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_refused_version_loads_once_an_unloaded_one_frees_its_memory(tmp_path):
    settings = worker_settings(tmp_path, worker_memory_bytes=1_000_000)
    topics = settings.topics
    first, second = (ModelConfig(name="echo", version=v, engine="echo", max_model_len=4096) for v in ("2", "3"))
    service, task = await start(settings)
    try:
        await wait_beat(topics, lambda hb: state_of(hb, "echo@1") == "ready")
        await publish(settings, [ModelVersionRecord(manifest=pack(first), budget_bytes=600_000)])
        await wait_beat(topics, lambda hb: state_of(hb, "echo@2") == "ready")
        await publish(settings, [ModelVersionRecord(manifest=pack(second), budget_bytes=600_000)])
        beat = await wait_beat(topics, lambda hb: state_of(hb, "echo@3") == "refused")
        assert beat.versions["echo@3"].reason == "needs 600000 bytes, 400000 of 1000000 free on this worker"
        assert beat.versions["echo@2"].budget_bytes == 600_000 and beat.versions["echo@3"].budget_bytes == 0

        state = await read_registry(settings)
        await publish(settings, set_desired(state, "echo@2", "unloaded", by="test"))
        beat = await wait_beat(topics, lambda hb: "echo@2" not in hb.versions and state_of(hb, "echo@3") == "ready")
        assert sorted(beat.models) == ["echo@1", "echo@3"] and beat.versions["echo@3"].budget_bytes == 600_000
        metrics = service.metrics.render()
        assert value(metrics, "weir_worker_version_budget_bytes", model="echo@3") == 600_000
        assert value(metrics, "weir_worker_version_state", model="echo@3", state="ready") == 1

        # A budget given as a share of the device: half of this machine's memory is far over 1 MB.
        half = ModelConfig(name="echo", version="4", engine="echo", max_model_len=4096)
        await publish(settings, [ModelVersionRecord(manifest=pack(half), budget_fraction=0.5)])
        beat = await wait_beat(topics, lambda hb: state_of(hb, "echo@4") == "refused")
        device = service.versions.device_bytes
        assert device > 1_000_000_000
        assert (
            beat.versions["echo@4"].reason == f"needs {int(0.5 * device)} bytes, 400000 of 1000000 free on this worker"
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_models_toml_entry_the_registry_unloaded_is_neither_loaded_nor_seeded_again(tmp_path):
    settings = worker_settings(tmp_path)
    topics = settings.topics
    one, two = (ModelConfig(name="echo", version=v, engine="echo", max_model_len=4096) for v in ("1", "2"))
    await ensure_topics(BOOTSTRAP, topics.core_specs())
    await publish(
        settings,
        [
            ModelVersionRecord(manifest=pack(one), desired="unloaded", registered_by="ops"),
            ModelVersionRecord(manifest=pack(two), registered_by="ops"),
            ModelRoute(name="echo", default_version="2"),
        ],
    )
    _service, task = await start(settings)
    try:
        beat = await wait_beat(topics, lambda hb: hb.is_ready)
        assert beat.models == ["echo@2"] and set(beat.versions) == {"echo@2"}
        state = await read_registry(settings)
        assert state.versions["echo@1"].desired == "unloaded" and state.versions["echo@1"].registered_by == "ops"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
