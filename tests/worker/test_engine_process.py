"""EngineProcess: the engine in a spawned child, spoken to over pipes from the event loop.

Real child processes (spawned, as the worker runs them). The echo engine keeps them quick, and
the default model's directory checks that a torch engine loads and generates there too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from schemas.model_repo import ModelConfig, load_model_repo
from services.worker.config import WorkerSettings
from services.worker.engine import EngineOutput
from services.worker.hosts.runner import EngineProcess
from tests.waiting import until, wait_until

from .factories import make_request

REPO_ROOT = Path(__file__).resolve().parents[2]


class Collector:
    """on_outputs for a test: keeps every output, wakes waiters."""

    def __init__(self) -> None:
        self.outputs: list[EngineOutput] = []
        self.num_calls = 0
        self.changed = asyncio.Event()

    def __call__(self, outputs: list[EngineOutput]) -> None:
        self.num_calls += 1
        self.outputs.extend(outputs)
        self.changed.set()

    async def until(self, predicate: Callable[[], object], *, timeout_s: float, what: str) -> None:
        """tests/waiting.py's until, looking again at each batch of outputs rather than polling."""
        await until(predicate, timeout_s=timeout_s, what=what, wake=self.changed)

    def finals(self) -> dict[str, EngineOutput]:
        return {o.request_id: o for o in self.outputs if o.is_final}


def echo_config(**overrides) -> ModelConfig:
    return ModelConfig(name="tiny", engine="echo", max_model_len=64, max_num_seqs=4, **overrides)


async def open_process(config: ModelConfig, collector: Collector, **settings) -> EngineProcess:
    process = EngineProcess(config, WorkerSettings(**settings), "cpu", asyncio.get_running_loop(), collector)
    await process.open()
    process.start()
    return process


async def test_outputs_come_back_in_order_and_pending_settles() -> None:
    collector = Collector()
    process = await open_process(echo_config(), collector)
    try:
        assert process.weights_sha256  # reported by the child once loaded
        requests = [make_request(f"hello there number {i}", max_tokens=5) for i in range(6)]
        for request in requests:
            process.submit(request)
        await collector.until(
            lambda: len(collector.finals()) == len(requests), timeout_s=30, what="every request's final output"
        )
        assert process.num_pending == 0
        for request in requests:
            seqs = [o.seq for o in collector.outputs if o.request_id == request.request_id]
            assert seqs == sorted(seqs) and seqs[0] == 0
            text = "".join(o.text for o in collector.outputs if o.request_id == request.request_id)
            assert text and request.prompt.startswith(text)  # echo: the prompt back, max_tokens pieces
        assert process.failure is None
        assert set(process.stats) >= {"num_running", "num_waiting", "free_kv_blocks"}
    finally:
        process.stop(5.0)
    assert not process._process.is_alive()


async def test_cancel_reaches_the_child() -> None:
    collector = Collector()
    process = await open_process(echo_config(), collector, echo_step_delay_ms=50)
    try:
        request = make_request("a long prompt " * 4, max_tokens=50)
        process.submit(request)
        await collector.until(
            lambda: any(o.request_id == request.request_id for o in collector.outputs),
            timeout_s=30,
            what="the request's first output",
        )
        process.cancel(request.request_id)
        await collector.until(
            lambda: request.request_id in collector.finals(), timeout_s=10, what="the request's final output"
        )
        assert collector.finals()[request.request_id].finish_reason == "cancelled"
    finally:
        process.stop(5.0)


async def test_a_model_that_cannot_load_is_refused_with_the_childs_reason(tmp_path: Path) -> None:
    config = ModelConfig(name="broken", engine="torch", path=tmp_path)  # an empty directory
    process = EngineProcess(config, WorkerSettings(), "cpu", asyncio.get_running_loop(), Collector())
    with pytest.raises(ValueError, match=r"config\.json|safetensors|tokenizer"):
        await process.open()
    process.stop(1.0)
    assert not process._process.is_alive()


async def test_a_dead_child_is_a_failure_the_worker_sees() -> None:
    collector = Collector()
    process = await open_process(echo_config(), collector)
    try:
        os.kill(process._process.pid, signal.SIGKILL)
        await collector.until(
            lambda: process.failure is not None, timeout_s=10, what="the engine process's failure noticed"
        )
        assert "exited (killed by SIGKILL)" in str(process.failure)
        assert collector.num_calls >= 1  # the empty delivery that wakes publish()
        process.submit(make_request("after death"))  # ignored, never raises
    finally:
        process.stop(1.0)


async def test_the_default_model_generates_in_the_child() -> None:
    config = load_model_repo(REPO_ROOT / "models.toml").models["weir-tiny-py"]
    collector = Collector()
    process = await open_process(config, collector)
    try:
        request = make_request("def main():\n    ", model=config.name, max_tokens=12, temperature=0.0, ignore_eos=True)
        process.submit(request)
        await collector.until(
            lambda: request.request_id in collector.finals(), timeout_s=60, what="the request's final output"
        )
        final = collector.finals()[request.request_id]
        assert final.finish_reason == "length" and final.completion_tokens == 12
        assert "".join(o.text for o in collector.outputs if o.request_id == request.request_id).strip()
    finally:
        process.stop(5.0)


def test_the_child_dies_with_a_killed_worker(tmp_path: Path) -> None:
    # A stand-in worker: opens an EngineProcess, prints the child's pid, then waits to be killed -9.
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import asyncio, sys
        from schemas.model_repo import ModelConfig
        from services.worker.config import WorkerSettings
        from services.worker.hosts.runner import EngineProcess

        async def main():
            config = ModelConfig(name="tiny", engine="echo", max_model_len=64, max_num_seqs=4)
            process = EngineProcess(config, WorkerSettings(), "cpu", asyncio.get_running_loop(), lambda outputs: None)
            await process.open()
            print(process._process.pid, flush=True)
            await asyncio.sleep(300)  # a worker that stays alive until the test kills it

        if __name__ == "__main__":  # spawn imports this file again in the child
            asyncio.run(main())
    """)
    )
    worker = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        child_pid = int(worker.stdout.readline())
        assert _is_running(child_pid)
        worker.kill()
        worker.wait(10)
        wait_until(lambda: not _is_running(child_pid), timeout_s=10, what="the engine process to die with its worker")
    finally:
        if worker.poll() is None:
            worker.kill()


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, unreaped
    except FileNotFoundError:
        return False
