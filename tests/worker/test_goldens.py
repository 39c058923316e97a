"""Golden canaries and the fault hook: recorded here, checked in an engine's own loop while it serves.

Real engines on the CPU: the repository's tiny model (models/weir-tiny-py), the echo engine and
all-MiniLM-L6-v2 (onnx); both hosts (EngineRunner on a thread, EngineProcess in a spawned child).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from schemas.messages import now_ms
from schemas.model_repo import ModelConfig, load_model_repo
from schemas.registry import GoldenCase
from services.worker.config import WorkerSettings
from services.worker.engine import EmbeddingEngine
from services.worker.engine.contract import GOLDEN_ID_PREFIX
from services.worker.hosts.engine_factory import build_engine
from services.worker.hosts.faults import FaultHookError, corrupt
from services.worker.hosts.goldens import (
    GOLDEN_SAMPLED_SEED,
    GoldenCheck,
    golden_problem,
    golden_requests,
    record_goldens,
    run_goldens,
)
from services.worker.hosts.runner import EngineProcess, EngineRunner

from .factories import make_request
from .test_engine_process import Collector

REPO = load_model_repo(Path(__file__).resolve().parents[2] / "models.toml")
TINY = REPO.models["weir-tiny-py"]
CPU = torch.device("cpu")
SETTINGS = WorkerSettings(device="cpu", kv_cache_bytes=16 << 20, torch_threads=1)


@pytest.fixture(scope="module")
def tiny_goldens() -> list[GoldenCase]:
    return record_goldens(TINY, max_tokens=6, settings=SETTINGS)


def build_tiny():
    return build_engine(TINY, SETTINGS, CPU)


# -- golden_problem (pure) ------------------------------------------------------------------


def test_golden_problem_names_the_case_and_the_first_difference() -> None:
    case = GoldenCase(prompt="def main():", max_tokens=4, expected_token_ids=[5, 6, 7, 8])
    assert golden_problem(case, [5, 6, 7, 8], None) is None
    problem = golden_problem(case, [5, 6, 9, 8], None)
    assert problem is not None and "'def main():'" in problem and "token 2 expected 7, got 9" in problem
    assert "token 2 expected 7, got (end)" in golden_problem(case, [5, 6], None)
    assert "no tokens" in golden_problem(case, None, None)


def test_golden_problem_of_a_vector_is_its_cosine() -> None:
    case = GoldenCase(kind="embed", prompt="hello", expected_vector=[1.0, 0.0], min_cosine=0.999)
    assert golden_problem(case, None, [2.0, 0.001]) is None  # same direction, any length
    problem = golden_problem(case, None, [1.0, 1.0])
    assert problem is not None and "cosine 0.707107" in problem and "below 0.999" in problem
    assert "2-d vector, got 3-d" in golden_problem(case, None, [1.0, 0.0, 0.0])
    assert "below" in golden_problem(case, None, [0.0, 0.0])  # NaN cosine fails


# -- record and run in one engine -----------------------------------------------------------


def test_a_record_written_before_sampled_goldens_reads_as_greedy() -> None:
    old = GoldenCase.model_validate_json(
        b'{"kind": "generate", "prompt": "def f():", "max_tokens": 4, '
        b'"expected_token_ids": [1, 2, 3, 4], "expected_vector": [], "min_cosine": 0.999}'
    )
    assert (old.temperature, old.seed) == (0.0, 0)
    [request] = golden_requests([old], "tiny", "t")
    assert request.temperature == 0.0 and request.max_tokens == 4


def test_recorded_goldens_pass_then_fail_once_the_weights_are_corrupted(tiny_goldens) -> None:
    assert [c.prompt for c in tiny_goldens] == [*TINY.warmup, TINY.warmup[0]]  # the last: the sampled case
    assert all(c.kind == "generate" and len(c.expected_token_ids) == 6 for c in tiny_goldens)
    engine = build_tiny()
    assert run_goldens(engine, tiny_goldens) is None
    assert not engine.has_work  # the golden requests left nothing behind
    corrupt(engine)
    problem = run_goldens(engine, tiny_goldens)
    assert problem is not None and "expected" in problem and "got" in problem


def test_the_seeded_sampled_golden_is_reproduced_by_another_engine_and_fails_with_another_seed(tiny_goldens) -> None:
    sampled = [c for c in tiny_goldens if c.temperature > 0]
    assert [(c.prompt, c.temperature, c.seed) for c in sampled] == [(TINY.warmup[0], 1.0, GOLDEN_SAMPLED_SEED)]
    assert sampled[0].expected_token_ids != tiny_goldens[0].expected_token_ids  # sampled: not the greedy answer
    engine = build_tiny()  # another instance than the one that recorded it
    assert run_goldens(engine, sampled) is None
    reseeded = sampled[0].model_copy(update={"seed": GOLDEN_SAMPLED_SEED + 1})
    problem = run_goldens(engine, [reseeded])
    assert problem is not None and f"seed {GOLDEN_SAMPLED_SEED + 1}): token" in problem
    corrupt(engine)
    assert run_goldens(engine, sampled) is not None


def test_run_goldens_refuses_to_drop_other_requests_outputs(tiny_goldens) -> None:
    engine = build_tiny()
    assert engine.add(make_request("x = ", model=TINY.name, max_tokens=4), 0) is None
    with pytest.raises(ValueError, match="on_other"):
        run_goldens(engine, tiny_goldens)
    others = []
    assert run_goldens(engine, tiny_goldens, others.extend) is None
    assert others and not any(o.request_id.startswith(GOLDEN_ID_PREFIX) for o in others)


def test_echo_goldens_pass_and_echo_has_no_weights_to_corrupt() -> None:
    echo = REPO.models["echo"]
    cases = record_goldens(echo, prompts=["one two three"], max_tokens=8)
    assert cases[0].expected_token_ids == [0, 1, 2]  # echo's "tokens" are the words' positions
    engine = build_engine(echo, SETTINGS, CPU)
    assert run_goldens(engine, cases) is None
    with pytest.raises(FaultHookError, match="no weights"):
        corrupt(engine)


# -- the hosts --------------------------------------------------------------------------------


async def test_thread_host_checks_goldens_and_refuses_the_fault_hook_unless_enabled(tiny_goldens) -> None:
    collector = Collector()
    runner = EngineRunner(build_tiny(), asyncio.get_running_loop(), collector)
    runner.start()
    try:
        assert runner.engine_label == "torch-cpu" and runner.used_bytes() > 0
        assert await runner.check_goldens(tiny_goldens) is None
        with pytest.raises(FaultHookError, match="WEIR_FAULT_HOOKS"):
            await runner.corrupt_weights()
        assert await runner.check_goldens(tiny_goldens) is None  # refused: nothing changed
    finally:
        runner.stop(5.0)
    assert collector.outputs == []  # golden outputs never reach the sink


async def test_thread_host_corrupted_fails_its_goldens(tiny_goldens) -> None:
    collector = Collector()
    runner = EngineRunner(build_tiny(), asyncio.get_running_loop(), collector, fault_hooks=True)
    runner.start()
    try:
        await runner.corrupt_weights()
        problem = await runner.check_goldens(tiny_goldens)
        assert problem is not None and problem.startswith("golden 'def main():': token")
    finally:
        runner.stop(5.0)
    assert collector.outputs == []


async def test_process_host_checks_goldens_then_fails_them_once_corrupted(tiny_goldens) -> None:
    collector = Collector()
    settings = SETTINGS.model_copy(update={"fault_hooks": True})
    process = EngineProcess(TINY, settings, "cpu", asyncio.get_running_loop(), collector)
    await process.open()
    process.start()
    try:
        assert process.engine_label == "torch-cpu" and process.used_bytes() > 0
        assert await process.check_goldens(tiny_goldens) is None
        # Recorded in the engine's own loop (a version registered without goldens): as record_goldens does.
        assert await process.record_goldens(list(TINY.warmup), 6) == tiny_goldens
        await process.corrupt_weights()
        problem = await asyncio.wait_for(process.check_goldens(tiny_goldens), 60)
        assert problem is not None and "expected" in problem
    finally:
        process.stop(5.0)
    assert collector.outputs == []


async def test_process_host_refuses_the_fault_hook_unless_enabled() -> None:
    process = EngineProcess(TINY, SETTINGS, "cpu", asyncio.get_running_loop(), Collector())
    with pytest.raises(FaultHookError, match="WEIR_FAULT_HOOKS"):
        await process.corrupt_weights()  # refused before anything reaches the child


async def test_goldens_beside_a_client_sequence_change_none_of_its_tokens(tiny_goldens) -> None:
    async def client_tokens(with_goldens: bool) -> tuple[list[int], list[str]]:
        collector = Collector()
        runner = EngineRunner(build_tiny(), asyncio.get_running_loop(), collector)
        runner.start()
        request = make_request(
            "import sys\n",
            model=TINY.name,
            max_tokens=64,
            temperature=0.9,
            seed=7,
            ignore_eos=True,
            request_id="client-1",
        )
        try:
            runner.submit(request)
            if with_goldens:  # started while the client's sequence runs, several times over
                await collector.until(
                    lambda: len(collector.outputs) >= 2, timeout_s=30, what="2 outputs of the client request"
                )
                for _ in range(3):
                    assert await runner.check_goldens(tiny_goldens) is None
                assert "client-1" not in collector.finals()  # the checks ran while it did
            await collector.until(
                lambda: "client-1" in collector.finals(), timeout_s=30, what="the client request's final output"
            )
        finally:
            runner.stop(5.0)
        ids = [t for o in collector.outputs for t in o.token_ids]
        return ids, [o.request_id for o in collector.outputs]

    alone, _ = await client_tokens(False)
    beside, request_ids = await client_tokens(True)
    assert len(alone) == 64 and beside == alone
    assert set(request_ids) == {"client-1"}  # nothing of the goldens reached the sink


# -- embeddings -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> ModelConfig:
    config = REPO.models["all-MiniLM-L6-v2"]
    try:
        from weir.embedding.onnx_export import ensure_export

        ensure_export(config)
    except FileNotFoundError as exc:
        pytest.skip(f"all-MiniLM-L6-v2 cannot be exported here: {exc}")
    return config


def test_embedding_goldens_pass_run_to_run_and_fail_once_corrupted(minilm) -> None:
    cases = record_goldens(minilm, prompts=["hello", "the quick brown fox"], settings=SETTINGS)
    assert all(c.kind == "embed" and len(c.expected_vector) == 384 and c.min_cosine == 0.999 for c in cases)
    engine = build_engine(minilm, SETTINGS, CPU)
    assert isinstance(engine, EmbeddingEngine)
    # The drift that justifies min_cosine: the same inputs, another engine, alone and batched.
    check = GoldenCheck(engine, cases)
    while not check.is_done:
        check.take(engine.step(now_ms()))
    drift = max(1 - _cosine(c.expected_vector, check.vectors[i]) for i, c in enumerate(cases))
    assert drift < 1e-6  # far inside 1 - 0.999
    assert run_goldens(engine, cases) is None
    corrupt(engine)
    problem = run_goldens(engine, cases)
    assert problem is not None and "below 0.999" in problem


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
