"""EngineLoader (services/worker/loading.py): every engine of every model opens at once, says what
it is doing, is opened with its model's sink (the queue its server reads later), and a failure
stops the rest."""

from __future__ import annotations

import asyncio
import re

import pytest

from schemas.model_repo import ModelConfig
from services.worker.loading import STARTING, EngineLoader
from tests.worker.factories import make_model_config, make_output


class FakeHost:
    """What the loader needs of an engine host: stop()."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_stopped = False

    def stop(self, timeout_s: float = 5.0) -> None:
        self.is_stopped = True


class Opener:
    """open_engine for the loader: each open waits until the test releases its model."""

    def __init__(self) -> None:
        self.begun: list[str] = []
        self.cancelled: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.failures: dict[str, Exception] = {}
        self.hosts: list[FakeHost] = []
        self.on_outputs: dict[str, object] = {}
        self.on_status: dict[str, object] = {}

    async def __call__(self, config: ModelConfig, on_outputs, on_status) -> FakeHost:
        self.begun.append(config.name)
        self.on_outputs[config.name], self.on_status[config.name] = on_outputs, on_status
        try:
            await self.release.setdefault(config.name, asyncio.Event()).wait()
        except asyncio.CancelledError:
            self.cancelled.append(config.name)
            raise
        if config.name in self.failures:
            raise self.failures[config.name]
        host = FakeHost(config.name)
        self.hosts.append(host)
        return host


def sinks(*names: str) -> dict:
    """A sink per model, for engines that emit nothing in these tests."""
    return {name: [].append for name in names}


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_every_engine_begins_loading_before_any_is_done() -> None:
    opener = Opener()
    loader = EngineLoader(
        [make_model_config("big", instances=2), make_model_config("small")], opener, sinks("big", "small")
    )
    loader.start()
    await settle()
    assert sorted(opener.begun) == ["big", "big", "small"]  # side by side, none released yet
    assert loader.still_loading() == ["big", "small"]
    assert loader.describe() == f"big: {STARTING}; small: {STARTING}"
    opener.on_status["big"]("warming up")
    assert loader.describe() == f"big: warming up; small: {STARTING}"

    opener.release["small"].set()
    await settle()
    assert loader.still_loading() == ["big"] and loader.describe() == "big: warming up"
    opener.release["big"].set()
    hosts = await loader.wait()
    assert {name: [h.name for h in found] for name, found in hosts.items()} == {
        "big": ["big", "big"],
        "small": ["small"],
    }
    assert loader.still_loading() == [] and loader.describe() == ""


async def test_each_engine_is_opened_with_its_models_sink_and_outputs_wait_there() -> None:
    opener = Opener()
    for name in ("tiny", "echo"):
        opener.release[name] = asyncio.Event()
        opener.release[name].set()  # they load at once
    queues: dict[str, asyncio.Queue] = {"tiny": asyncio.Queue(), "echo": asyncio.Queue()}
    loader = EngineLoader(
        [make_model_config("tiny"), make_model_config("echo", engine="echo")],
        opener,
        {name: q.put_nowait for name, q in queues.items()},
    )
    loader.start()
    await loader.wait()
    out = make_output("r1", finish_reason="stop")
    opener.on_outputs["echo"]([out])  # before any server reads: the queue keeps it
    assert queues["tiny"].empty() and queues["echo"].get_nowait() == [out]


def test_a_model_without_a_sink_is_refused() -> None:
    with pytest.raises(ValueError, match="no sink for the outputs of echo"):
        EngineLoader([make_model_config("tiny"), make_model_config("echo", engine="echo")], Opener(), sinks("tiny"))


async def test_a_model_that_cannot_load_stops_the_others_and_says_why() -> None:
    opener = Opener()
    opener.failures["broken"] = ValueError("model 'broken': no config.json in /models/broken")
    loader = EngineLoader(
        [make_model_config("ok"), make_model_config("slow"), make_model_config("broken")],
        opener,
        sinks("ok", "slow", "broken"),
    )
    loader.start()
    await settle()
    opener.release["ok"].set()
    await settle()
    opener.release["broken"].set()
    with pytest.raises(
        ValueError, match=re.escape("model 'broken': no config.json")
    ):  # the model's own error, not a group
        await loader.wait()
    assert opener.cancelled == ["slow"]  # still loading: cancelled (a real process is stopped then)
    await loader.discard()
    assert [(h.name, h.is_stopped) for h in opener.hosts] == [("ok", True)]


async def test_discard_while_loading_cancels_and_stops_what_opened() -> None:
    opener = Opener()
    loader = EngineLoader([make_model_config("a"), make_model_config("b")], opener, sinks("a", "b"))
    loader.start()
    await settle()
    opener.release["a"].set()
    await settle()
    await loader.discard()  # the worker stops before serving (Kafka away, a signal)
    assert opener.cancelled == ["b"]
    assert [(h.name, h.is_stopped) for h in opener.hosts] == [("a", True)]
