"""POST /tokenize and /detokenize (vLLM's), answered by the gateway with the model's tokenizer.json:
no broker (the routes never publish), the app over ASGI."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

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
    response = await client.post("/tokenize", json={"model": "weir-tiny-py", "prompt": TEXT, "add_special_tokens": False,
                                                    "return_token_strs": True})  # fmt: skip
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
        ("/tokenize", {"model": "weir-tiny-py", "messages": [{"role": "user", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"model": "weir-tiny-py"}, 400, "prompt"),
        ("/tokenize", {"model": "weir-tiny-py", "prompt": "x", "truncate": 3}, 400, "truncate"),
        ("/tokenize", {"model": "weir-tiny-py", "prompt": 3}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "weir-tiny-py", "tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"model": "weir-tiny-py", "tokens": ["a"]}, 400, "tokens.0"),
    ],
)
async def test_what_cannot_be_tokenized_is_a_400_naming_it(client: httpx.AsyncClient, path, body, status, param) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
