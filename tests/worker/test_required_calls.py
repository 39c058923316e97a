"""tool_choice "required" on the default chat model (issue 35, item 12: "two identical tool calls").

Under the array grammar a small model repeats its call: SmolLM2-135M, asked for news with a
function that takes no parameters, writes `[{"name": "get_news", "arguments": {}}, {"name":
"get_news", ...` until max_tokens. The repeat is no new call (schemas/tools.py: CallListParser),
and once the output repeats itself the engine steers the array to close: the reply is the call
made once, ending `stop` with a valid instance, not max_tokens of copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schemas.messages import ChatMessage, GenerateRequest, ToolDef, now_ms
from services.worker.engine import Engine, EngineConfig
from services.worker.kafka.events import reply_events

from .positions import contiguous

pytestmark = pytest.mark.slow  # a grammar compile on a 49k vocabulary: about a minute of CPU

REPO = Path(__file__).resolve().parents[2]
NEWS = ToolDef.model_validate(
    {"type": "function", "function": {"name": "get_news", "parameters": {"type": "object", "properties": {}}}}
)


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    from schemas.model_repo import load_model_repo
    from weir.models.sources import ensure_model_dir

    model_dir = ensure_model_dir(load_model_repo(REPO / "models.toml").models["smollm2-135m-instruct"])
    return Engine(model_dir, EngineConfig(max_model_len=512), torch.device("cpu"))


@pytest.mark.parametrize("question", ["Any news?", "Hi!"])
def test_a_repeated_call_is_made_once_and_the_array_closes(smollm2: Engine, question: str) -> None:
    request = GenerateRequest(
        request_id=f"news-{question}",
        model="smollm2-135m-instruct@1",
        tools=[NEWS],
        tool_choice="required",
        messages=[ChatMessage(role="user", content=question)],
        max_tokens=120,
        temperature=0.0,
        deadline_ms=now_ms() + 900_000,
        reply_to="weir.replies.test",
    )
    assert smollm2.add(request, now_ms()) is None
    outputs = []
    while smollm2.has_work:
        outputs += smollm2.step(now_ms())
    final = outputs[-1]
    generated = json.loads(final.output_text or "")  # a complete array: the grammar's instance
    assert len(generated) >= 2 and all(item == {"name": "get_news", "arguments": {}} for item in generated)
    assert final.finish_reason == "stop" and final.structured_valid is True
    assert final.completion_tokens < request.max_tokens  # closed after the repeat, not cut at the budget
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls or []] == [("get_news", "{}")]
    events = [e for out in outputs for e in reply_events(request, "b1", out, "smollm2-135m-instruct@1")]
    pieces = [p for e in events if e.type == "delta" for p in e.tool_calls or []]
    assert [(p.index, p.name, p.arguments) for p in pieces] == [(0, "get_news", "{}")]  # published once
    assert contiguous(events) and events[-1].seq == final.completion_tokens
