"""POST /tokenize and /detokenize (vLLM's), answered by the gateway with the model's tokenizer.json:
no broker (the routes never publish), the app over ASGI. A chat's ids are proved equal to the
prompt ids the worker's engine builds for the same chat body (translated as /v1/chat/completions
translates it, through the wire record, into Engine.add)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from services.gateway.app import create_app
from services.gateway.config import GatewaySettings

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = Tokenizer.from_file(str(ROOT / "models" / "weir-tiny-py" / "tokenizer.json"))
TEXT = "def main():\n    print('héllo')\n"


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(model_repo=str(ROOT / "models.toml"), kafka_bootstrap="127.0.0.1:1", auth_mode="open")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings)), base_url="http://gw") as c:
        yield c


async def test_tokenize_is_the_models_tokenizer_and_detokenize_inverts_it(client: httpx.AsyncClient) -> None:
    want = TOKENIZER.encode(TEXT, add_special_tokens=False)
    response = await client.post(
        "/tokenize",
        json={"model": "weir-tiny-py", "prompt": TEXT, "add_special_tokens": False, "return_token_strs": True},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body == {"count": len(want.ids), "max_model_len": 1024, "tokens": want.ids, "token_strs": want.tokens}
    plain = (await client.post("/tokenize", json={"model": "weir-tiny-py@1", "prompt": TEXT})).json()
    assert plain["tokens"] == TOKENIZER.encode(TEXT).ids and plain["token_strs"] is None
    back = await client.post("/detokenize", json={"model": "weir-tiny-py", "tokens": want.ids})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "echo", "prompt": "x"}, 400, "model"),  # no tokenizer: refused, not estimated
        # a model without a chat template: its chat has no template rendering to count
        ("/tokenize", {"model": "weir-tiny-py", "messages": [{"role": "user", "content": "x"}]}, 400, "messages"),
        (
            "/tokenize",
            {"model": "weir-tiny-py", "prompt": "x", "add_generation_prompt": True},
            400,
            "add_generation_prompt",
        ),
        ("/tokenize", {"model": "weir-tiny-py", "prompt": "x", "tools": []}, 400, "tools"),
        ("/tokenize", {"model": "weir-tiny-py"}, 400, "prompt"),
        ("/tokenize", {"model": "weir-tiny-py", "prompt": "x", "truncate": 3}, 400, "truncate"),
        ("/tokenize", {"model": "weir-tiny-py", "prompt": 3}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "weir-tiny-py", "tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "weir-tiny-py", "tokens": ["a"]}, 400, "tokens.0"),
    ],
)
async def test_what_cannot_be_tokenized_is_a_400_naming_it(
    client: httpx.AsyncClient, path, body, status, param
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


# HuggingFaceTB/SmolLM2-135M-Instruct's template (ChatML, no tools: a chat with tools is rewritten
# as plain Hermes turns first), verbatim.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that reads `tools` (as Llama 3.1's and Qwen 2.5's do): it gets the wire fields and tools as dicts.
TOOLS = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] or '' }}{% if m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}"
    "{% endif %}{% if m['tool_call_id'] is defined %} ({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# mistralai/Mistral-7B-Instruct-v0.1's: refuses any order but user/assistant/user/...
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ message['content'] }}{% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHATS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Write def main():"}]},
    "system and parts": {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "wörld"}]},
        ]
    },
    "tool turns": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ],
    },
}


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory) -> Path:
    """weir-tiny-py (its tokenizer and weights) served under three chat templates, and a models.toml naming them."""
    root = tmp_path_factory.mktemp("chat-models")
    config = json.loads((ROOT / "models" / "weir-tiny-py" / "tokenizer_config.json").read_text())
    entries = []
    templates = (
        ("tiny-chatml", CHATML),
        ("tiny-tools", TOOLS),
        ("tiny-mistral", MISTRAL),
        ("tiny-broken", "{% for %}"),
    )
    for name, template in templates:
        shutil.copytree(ROOT / "models" / "weir-tiny-py", root / name)
        (root / name / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        entries.append(
            f'[models.{name}]\npath = "{root / name}"\nengine = "torch"\nversion = "1"\n'
            "max_batch_size = 4\nmax_model_len = 1024\n"
        )
    (root / "models.toml").write_text("\n".join(entries))
    return root


@pytest.fixture(scope="module")
async def chat_client(chat_models: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(
        model_repo=str(chat_models / "models.toml"), kafka_bootstrap="127.0.0.1:1", auth_mode="open"
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings)), base_url="http://gw") as c:
        yield c


def engine_prompt_ids(models: Path, name: str, chat: dict[str, Any]) -> list[int]:
    """The prompt ids the worker's engine runs for `chat` sent to /v1/chat/completions: the body
    translated by the gateway's translator, through the wire record (as Kafka carries it), into
    Engine.add."""
    import torch

    from schemas.messages import GenerateRequest, now_ms
    from schemas.model_repo import load_model_repo
    from services.gateway.openai_format import parse_body, to_generate_request
    from services.worker.engine import Engine, EngineConfig

    model = load_model_repo(models / "models.toml").models[name]
    body = parse_body("chat.completions", json.dumps({"model": name, **chat}))
    now = now_ms()
    request = to_generate_request(
        "chat.completions",
        body,
        model,
        request_id=f"tok-{name}",
        reply_to="weir.replies.test",
        now_ms=now,
        client_timeout_s=None,
        max_timeout_s=60.0,
    )
    request = GenerateRequest.model_validate_json(request.model_dump_json())
    engine = Engine(models / name, EngineConfig(max_model_len=1024, kv_cache_bytes=4 << 20), torch.device("cpu"))
    assert engine.add(request, now) is None, "the engine refused the chat"
    seq = engine._seqs[request.request_id]  # the queued sequence: its ids are the prompt's until a step runs
    return seq.token_ids[: seq.num_prompt_tokens]


@pytest.mark.parametrize("name", ["tiny-chatml", "tiny-tools"])
@pytest.mark.parametrize("chat", list(CHATS))
async def test_a_chats_ids_are_the_prompt_ids_the_engine_runs(chat_client, chat_models, name, chat) -> None:
    response = await chat_client.post("/tokenize", json={"model": name, **CHATS[chat], "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    want = engine_prompt_ids(chat_models, name, CHATS[chat])
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 1024
    assert body["token_strs"] == [TOKENIZER.id_to_token(i) for i in want]
    # vLLM's defaults, explicit, give the same ids; the generation prompt and special tokens are honoured
    explicit = {
        "add_generation_prompt": True,
        "add_special_tokens": False,
        "continue_final_message": False,
        "chat_template_kwargs": None,
    }
    same = await chat_client.post("/tokenize", json={"model": name, **CHATS[chat], **explicit})
    assert same.status_code == 200 and same.json()["tokens"] == want, same.text
    bare = (
        await chat_client.post("/tokenize", json={"model": name, **CHATS[chat], "add_generation_prompt": False})
    ).json()
    assert len(bare["tokens"]) < len(want) and want[: len(bare["tokens"])] == bare["tokens"]


async def test_a_chat_with_tools_renders_them(chat_client) -> None:
    """The tools reach the template (or the Hermes preamble): a chat counts more tokens with them."""
    chat = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
    for name in ("tiny-chatml", "tiny-tools"):
        without = (await chat_client.post("/tokenize", json={"model": name, **chat})).json()["count"]
        with_tools = (await chat_client.post("/tokenize", json={"model": name, **chat, "tools": [WEATHER]})).json()
        assert with_tools["count"] > without
        assert "get_weather" in TOKENIZER.decode(with_tools["tokens"])


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "tiny-chatml", "messages": [{"role": "user"}]}, 400, "messages.0.content", None),
        ({"model": "tiny-chatml", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", None),
        ({"model": "tiny-chatml", "messages": "hello"}, 400, "messages", None),
        ({"model": "tiny-chatml", "messages": []}, 400, "messages", None),
        (
            {"model": "tiny-chatml", "messages": [{"role": "tool", "tool_call_id": "zz", "content": "x"}]},
            400,
            "messages.0.tool_call_id",
            "invalid_value",
        ),
        (
            {"model": "tiny-chatml", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools.0.function",
            "missing_required_parameter",
        ),
        (
            {"model": "tiny-chatml", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            400,
            "prompt",
            "invalid_value",
        ),
        (
            {"model": "tiny-chatml", "messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
            "unsupported_parameter",
        ),
        (
            {
                "model": "tiny-chatml",
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"enable_thinking": False},
            },
            400,
            "chat_template_kwargs",
            "unsupported_parameter",
        ),
        (
            {"model": "tiny-chatml", "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            400,
            "chat_template",
            "unsupported_parameter",
        ),
        (
            {
                "model": "tiny-mistral",
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            },
            400,
            "messages",
            "chat_template_error",
        ),
        ({"model": "tiny-broken", "messages": [{"role": "user", "content": "x"}]}, 400, "model", "chat_template_error"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model", None),
    ],
)
async def test_a_chat_that_cannot_be_tokenized_is_a_4xx_naming_it(chat_client, body, status, param, code) -> None:
    response = await chat_client.post("/tokenize", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


async def test_a_model_without_a_chat_template_says_so(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/tokenize", json={"model": "weir-tiny-py", "messages": [{"role": "user", "content": "x"}]}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "chat_template_missing" and "has no chat template" in error["message"]
