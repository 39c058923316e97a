"""The pure parts of the routes, without a broker or a server: Last-Event-ID, error bodies,
embedding usage, the model list a caller sees, readiness, request ids, and the app's lifespan."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.messages import ReplyEnd, Usage, WorkerHeartbeat
from services.gateway.app import running
from services.gateway.openai_format import ApiError
from services.gateway.routes.completions import new_request_id
from services.gateway.routes.embeddings import embedding_usage
from services.gateway.routes.errors import known_error
from services.gateway.routes.operations import readiness_body
from services.gateway.routes.streams import last_event_id
from services.gateway.streaming import stream_headers


@pytest.mark.parametrize(("value", "seq"), [(None, -1), ("", -1), ("-1", -1), ("0", 0), ("17", 17)])
def test_last_event_id_is_the_seq_the_client_saw_or_minus_one(value, seq):
    assert last_event_id(value) == seq


@pytest.mark.parametrize("value", ["x", "1.5", "-2", " 3", "--1", "+1", "\u00b2", "1" * 19, "9" * 5000])
def test_a_last_event_id_that_is_no_event_id_is_a_400_naming_the_header(value):
    with pytest.raises(ApiError) as caught:
        last_event_id(value)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "Last-Event-ID", "invalid_value")


class Body(BaseModel):
    n: int


def test_known_errors_become_openai_error_bodies_with_their_status():
    api = ApiError(429, "slow down", code="rate_limit_exceeded")
    assert known_error(api) == (429, api.body())
    not_found = known_error(StarletteHTTPException(404, "Not Found"))
    assert not_found is not None and (not_found[0], not_found[1]["error"]["code"]) == (404, "not_found")
    not_allowed = known_error(StarletteHTTPException(405, "Method Not Allowed"))
    assert not_allowed is not None and not_allowed[1]["error"]["code"] == "method_not_allowed"
    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"n": "x"})
    invalid = known_error(caught.value)
    assert invalid is not None and invalid[0] == 400
    request_invalid = known_error(RequestValidationError([{"loc": ("query", "limit"), "msg": "bad"}]))
    assert request_invalid is not None and request_invalid[0] == 400
    assert request_invalid[1]["error"]["code"] == "invalid_value"


def test_an_unexpected_error_is_not_known():
    assert known_error(RuntimeError("bug")) is None


def test_embedding_usage_sums_the_prompt_tokens_of_every_part():
    ends = [
        ReplyEnd(request_id=f"embd-1-{i}", seq=0, finish_reason="stop", usage=Usage(prompt_tokens=n))
        for i, n in enumerate([3, 4])
    ]
    usage = embedding_usage("embd-1", ends)
    assert (usage.request_id, usage.usage.prompt_tokens, usage.usage.completion_tokens) == ("embd-1", 7, 0)


def heartbeat(worker_id: str, models: list[str]) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        models=models,
        is_ready=True,
        num_running=0,
        num_waiting=0,
        max_num_seqs=8,
        free_kv_blocks=100,
        block_size_tokens=16,
        sent_ms=0,
    )


def test_readiness_counts_live_workers_per_model():
    live = {"echo": [heartbeat("w1", ["echo"]), heartbeat("w2", ["echo"])]}
    assert readiness_body(True, "ready", "gw-1", live) == {
        "ready": True,
        "reason": "ready",
        "gateway_id": "gw-1",
        "live_workers": {"echo": 2},
    }
    assert readiness_body(False, "no live worker heartbeat", "gw-1", {})["live_workers"] == {}


def test_request_ids_carry_openai_prefixes_and_differ():
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", new_request_id("chat.completions"))
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", new_request_id("completions"))
    assert new_request_id("completions") != new_request_id("completions")


def test_stream_headers_say_where_a_resumable_stream_is_read_again():
    assert stream_headers("cmpl-1", "gw-1", is_resumable=False) == {"x-request-id": "cmpl-1", "x-weir-gateway": "gw-1"}
    assert stream_headers("cmpl-1", "gw-1", is_resumable=True)["x-weir-resume-url"] == "/v1/streams/cmpl-1"


class Part:
    """Something the lifespan starts and stops; records the order in `log`."""

    def __init__(self, name: str, log: list[str], fails_to_start: bool = False) -> None:
        self.name, self.log, self.fails_to_start = name, log, fails_to_start

    async def start(self) -> None:
        self.log.append(f"start {self.name}")
        if self.fails_to_start:
            raise ConnectionError(self.name)

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")


async def test_the_lifespan_starts_bus_registry_guard_streams_batches_dashboard_lag_and_stops_them_in_reverse():
    log: list[str] = []
    parts = SimpleNamespace(
        bus=Part("bus", log),
        catalog=Part("registry", log),
        guard=Part("guard", log),
        remote=Part("streams", log),
        lag=Part("lag", log),
    )
    async with running(parts, Part("batches", log), Part("dashboard", log)):
        log.append("serving")
    assert log == [
        "start bus",
        "start registry",
        "start guard",
        "start streams",
        "start batches",
        "start dashboard",
        "start lag",
        "serving",
        "stop lag",
        "stop dashboard",
        "stop batches",
        "stop streams",
        "stop guard",
        "stop registry",
        "stop bus",
    ]


async def test_a_store_that_cannot_start_still_stops_the_guard_and_the_bus():
    log: list[str] = []
    parts = SimpleNamespace(
        bus=Part("bus", log),
        catalog=Part("registry", log),
        guard=Part("guard", log),
        remote=Part("streams", log),
        lag=Part("lag", log),
    )
    with pytest.raises(ConnectionError):
        async with running(parts, Part("batches", log, fails_to_start=True), Part("dashboard", log)):
            log.append("serving")
    assert log == [
        "start bus",
        "start registry",
        "start guard",
        "start streams",
        "start batches",
        "stop streams",
        "stop guard",
        "stop registry",
        "stop bus",
    ]
