"""OpenAI's Batch API end to end: the official openai client against the four services as
processes; interactive requests beside a bulk job; kill -9 of the batcher mid-job; cancel; a
file refused at upload; `weir replay` of a job; `weir batch submit`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from openai import BadRequestError, OpenAI

from tests.waiting import wait_until
from weir.replay import replay

from .conftest import REPO_ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
NUM_LINES = int(os.environ.get("WEIR_TEST_BATCH_LINES", "1000"))
TERMINAL = ("completed", "failed", "cancelled", "expired")
BATCHER_DOWN_S = 1.0  # how long the killed batcher stays down (a scenario setting, not a wait for an event)


def running_with_some_done(client: OpenAI, batch_id: str):  # an openai Batch, or None
    """The batch while it runs and has finished some of its lines (None before)."""
    current = client.batches.retrieve(batch_id)
    return current if current.status == "in_progress" and current.request_counts.completed > 0 else None


@pytest.fixture(scope="module")
def client(pipeline):
    return OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="none", max_retries=3, timeout=60)


def prompt_of(i: int) -> str:
    return f"line {i} says hello to the echo model"


def write_input(path: Path, n: int, tag: str) -> Path:
    rows = [
        {
            "custom_id": f"{tag}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": prompt_of(i)}], "max_tokens": 64},
        }
        for i in range(n)
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def wait_done(client: OpenAI, batch_id: str, timeout_s: float, on_poll=None):
    def ended():  # an openai Batch, or None
        batch = client.batches.retrieve(batch_id)
        if on_poll is not None:
            on_poll(batch)
        return batch if batch.status in TERMINAL else None

    return wait_until(ended, timeout_s=timeout_s, interval_s=0.5, what=f"batch {batch_id} to end")


def output_rows(client: OpenAI, file_id: str) -> list[dict]:
    return [orjson.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def assert_all_echoed(rows: list[dict], n: int, tag: str) -> None:
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)) == n, f"{len(ids)} rows, {len(set(ids))} distinct custom_ids, want {n}"
    assert set(ids) == {f"{tag}-{i}" for i in range(n)}
    for row in rows:
        i = int(row["custom_id"].rsplit("-", 1)[1])
        assert row["error"] is None and row["response"]["status_code"] == 200
        assert row["response"]["body"]["choices"][0]["message"]["content"] == prompt_of(i)


def interactive_beside(pipeline, stop: threading.Event, log: list) -> threading.Thread:
    def loop() -> None:
        client = OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        while not stop.is_set():
            started = time.monotonic()
            reply = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "ping pong"}])
            log.append((reply.choices[0].message.content, time.monotonic() - started))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_openai_client_runs_a_batch_beside_interactive_requests(pipeline, client, tmp_path):
    path = write_input(tmp_path / "in.jsonl", NUM_LINES, "a")
    uploaded = client.files.create(file=path, purpose="batch")
    assert uploaded.bytes == path.stat().st_size and uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == path.read_bytes()
    stop, interactive = threading.Event(), []
    thread = interactive_beside(pipeline, stop, interactive)
    started = time.monotonic()
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"suite": "e2e"}
    )
    assert batch.status == "validating" and batch.metadata == {"suite": "e2e"}
    seen = set()
    batch = wait_done(client, batch.id, 300, lambda b: seen.add(b.status))
    elapsed = time.monotonic() - started
    stop.set()
    thread.join(60)
    latencies = sorted(s for _text, s in interactive)
    print(
        f"batch of {NUM_LINES} echo requests: {elapsed:.1f}s; {len(interactive)} interactive requests beside it,"
        f" latency p50 {latencies[len(latencies) // 2]:.2f}s max {latencies[-1]:.2f}s"
        if latencies
        else ""
    )
    assert batch.status == "completed", batch
    assert "in_progress" in seen
    assert batch.request_counts.total == batch.request_counts.completed == NUM_LINES
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert_all_echoed(output_rows(client, batch.output_file_id), NUM_LINES, "a")
    assert interactive and all(text == "ping pong" for text, _s in interactive)
    listed = client.batches.list(limit=10)
    assert batch.id in [b.id for b in listed.data]
    pipeline.batch_job = batch  # for the replay test


def test_kill_9_of_the_batcher_mid_job_loses_and_duplicates_nothing(pipeline, client, tmp_path):
    n = NUM_LINES
    path = write_input(tmp_path / "kill.jsonl", n, "k")
    uploaded = client.files.create(file=path, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    current = wait_until(
        lambda: running_with_some_done(client, batch.id), timeout_s=120, what="the job running with some lines done"
    )
    assert current.request_counts.completed < n, "the job ended before the kill; raise WEIR_TEST_BATCH_LINES"
    pipeline.stack.kill("batcher")
    time.sleep(BATCHER_DOWN_S)
    pipeline.stack.start("batcher")
    done = wait_done(client, batch.id, 300)
    assert done.status == "completed", (done, pipeline.stack.log_tail("batcher"))
    assert done.request_counts.completed == n and done.request_counts.failed == 0
    assert_all_echoed(output_rows(client, done.output_file_id), n, "k")


def test_a_file_with_a_bad_line_is_refused_at_upload_naming_the_line(client, tmp_path):
    path = tmp_path / "bad.jsonl"
    good = orjson.dumps(
        {
            "custom_id": "x",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
        }
    )
    path.write_bytes(good + b"\n{oops\n" + good + b"\n")
    with pytest.raises(BadRequestError) as caught:
        client.files.create(file=path, purpose="batch")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_json", error
    assert error["message"].startswith("line 2: the line is not JSON"), error


def test_cancel_stops_a_job_and_keeps_what_finished(pipeline, client, tmp_path):
    path = tmp_path / "slow.jsonl"  # the tiny model is slower than echo: the job is still running when cancelled
    rows = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "weir-tiny-py", "prompt": f"def f_{i}():\n", "max_tokens": 200, "temperature": 0},
        }
        for i in range(64)
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    uploaded = client.files.create(file=path, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    wait_until(
        lambda: running_with_some_done(client, batch.id), timeout_s=120, what="the job running with some lines done"
    )
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_done(client, batch.id, 120)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == 64 and counts.completed + counts.failed <= 64
    ids = []
    for file_id in (done.output_file_id, done.error_file_id):
        if file_id:
            ids += [r["custom_id"] for r in output_rows(client, file_id)]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # every line once: an answer or batch_cancelled


def test_replay_of_a_job_on_the_echo_model_matches(pipeline):
    job = getattr(pipeline, "batch_job", None)
    if job is None:
        pytest.skip("needs the batch of the first test")
    settings = _settings(pipeline)
    rows = asyncio.run(replay(settings, 0, int(time.time() * 1000), job.id, "echo", 120.0, with_prompts=True))
    summary = rows[-1]
    assert summary["num_requests"] == NUM_LINES and summary["num_equal"] == NUM_LINES, summary
    assert all(r["original_text"] == r["new_text"] == r["prompt"].split(": ", 1)[1] for r in rows[:-1])


def test_a_restarted_gateway_rebuilds_files_and_batches_from_kafka(pipeline, client):
    job = getattr(pipeline, "batch_job", None)
    if job is None:
        pytest.skip("needs the batch of the first test")
    before = client.files.content(job.output_file_id).content
    pipeline.stack.kill("gateway")
    pipeline.stack.start("gateway")
    pipeline.wait_ready()
    again = client.batches.retrieve(job.id)
    assert (again.status, again.request_counts, again.output_file_id) == (
        "completed",
        job.request_counts,
        job.output_file_id,
    )
    assert client.files.content(job.output_file_id).content == before
    assert client.files.retrieve(job.input_file_id).bytes > 0


def test_weir_batch_submit_and_weir_replay_by_time_window(pipeline, tmp_path):
    path = write_input(tmp_path / "cli.jsonl", 20, "cli")
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1))
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "weir.cli",
            "batch",
            "--base-url",
            pipeline.base_url,
            "submit",
            str(path),
            "--endpoint",
            "/v1/chat/completions",
            "--out",
            str(out),
            "--poll-s",
            "0.3",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert_all_echoed([orjson.loads(x) for x in out.read_text().splitlines()], 20, "cli")
    diff = tmp_path / "diff.jsonl"
    replayed = subprocess.run(
        [
            sys.executable,
            "-m",
            "weir.cli",
            "replay",
            "--since",
            since,
            "--model",
            "echo",
            "--out",
            str(diff),
            "--topic-prefix",
            pipeline.topics.prefix,
            "--timeout-s",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO_ROOT,
    )
    assert replayed.returncode == 0, replayed.stderr
    rows = [orjson.loads(x) for x in diff.read_text().splitlines()]
    assert rows[-1]["summary"] and rows[-1]["num_requests"] == 20 == rows[-1]["num_equal"]


def _settings(pipeline):
    from weir.bus import BusSettings

    return BusSettings(kafka_bootstrap=pipeline.bootstrap, topic_prefix=pipeline.topics.prefix)
