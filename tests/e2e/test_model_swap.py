"""A model version swapped while streams run, through the whole pipeline (docs/design.md, invariant 10).

The stack serves weir-tiny-py@1 (models.toml). Clients stream the bare name in a loop while
`weir models push` registers version 2 (a copy of the same weights) and `weir models promote`
makes it the default: no request may fail or be cut, every response names one version (body and
`x-weir-model-version`), requests that start after the promotion get version 2, and version 1
drains out of the worker. Then a version whose weights file is changed after it was packed is
refused with the file named, and a request pinned to it gets a clear error instead of hanging.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import REPO_ROOT
from tests.e2e.conftest import weir_models as _weir_models
from tests.waiting import until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "weir-tiny-py"
BODY = {"model": MODEL, "prompt": "def main():\n", "max_tokens": 16, "temperature": 0, "seed": 1, "stream": True}


@pytest.fixture(scope="module")
def swap_pipeline(lifecycle_pipeline, tmp_path_factory):
    return lifecycle_pipeline, tmp_path_factory.mktemp("swap")


async def _stream(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion: the versions its chunks name, its header, text, and how it ended."""
    out = {"started": time.monotonic(), "versions": set(), "text": "", "done": False, "error": None, "header": None}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        out["header"] = resp.headers.get("x-weir-model-version")
        if resp.status_code != 200:
            out["error"] = f"{resp.status_code}: {(await resp.aread())[:300]!r}"
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            out["versions"].add(chunk["model"])
            out["text"] += "".join(c.get("text", "") for c in chunk["choices"])
    return out


async def _models(client: httpx.AsyncClient) -> set[str]:
    return {m["id"] for m in (await client.get("/v1/models")).json()["data"]}


def test_a_version_is_pushed_and_promoted_while_streams_run_and_none_fails(swap_pipeline):
    p, tmp = swap_pipeline
    v2 = tmp / "tiny-v2"
    shutil.copytree(REPO_ROOT / "models" / MODEL, v2)
    asyncio.run(_swap(p, v2))


async def _swap(p, v2: Path) -> None:
    results: list[dict] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=p.base_url, timeout=120) as client:

        async def lane() -> None:
            while not stop.is_set():
                results.append(await _stream(client, BODY))

        lanes = [asyncio.create_task(lane()) for _ in range(4)]
        await until(lambda: len(results) >= 4, timeout_s=60, what="the lanes streaming from weir-tiny-py@1")
        await asyncio.to_thread(
            _weir_models,
            p,
            "push",
            str(v2),
            "--name",
            MODEL,
            "--version",
            "2",
            "--from-toml",
            str(REPO_ROOT / "models.toml"),
        )

        async def v2_ready() -> bool:
            return f"{MODEL}@2" in await _models(client)

        await until(v2_ready, timeout_s=120, interval_s=0.5, what="weir-tiny-py@2 to be ready")
        await asyncio.to_thread(_weir_models, p, "promote", f"{MODEL}@2")
        promoted = time.monotonic()

        async def v1_gone() -> bool:  # no live worker reports it any more (drained and unloaded)
            shown = orjson.loads(await asyncio.to_thread(_weir_models, p, "show", f"{MODEL}@1", "--json"))
            return not shown["versions"][0]["workers"]

        await until(v1_gone, timeout_s=60, interval_s=0.5, what="weir-tiny-py@1 to drain out of the worker")
        served_before = len(results)
        await until(
            lambda: len(results) >= served_before + 4, timeout_s=60, what="more streams from weir-tiny-py@2 alone"
        )
        stop.set()
        await asyncio.gather(*lanes)
    failed = [r for r in results if r["error"] is not None or not r["done"]]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    assert all(len(r["versions"]) == 1 for r in results), "a response named two versions"
    assert all(r["header"].split(":")[0] in r["versions"] for r in results), "header and body disagree"
    served = {next(iter(r["versions"])) for r in results}
    assert served == {f"{MODEL}@1", f"{MODEL}@2"}, served
    after = [r for r in results if r["started"] > promoted + 1.0]
    assert after and all(r["versions"] == {f"{MODEL}@2"} for r in after), "a request after the promotion got @1"
    assert len({r["text"] for r in results}) == 1, "the same weights and seed gave different text across versions"


def test_a_changed_weights_file_is_refused_by_name_and_a_pinned_request_gets_a_clear_error(swap_pipeline):
    p, tmp = swap_pipeline
    v3 = tmp / "tiny-v3"
    shutil.copytree(REPO_ROOT / "models" / MODEL, v3)
    _weir_models(
        p,
        "push",
        str(v3),
        "--name",
        MODEL,
        "--version",
        "3",
        "--from-toml",
        str(REPO_ROOT / "models.toml"),
        "--no-goldens",
    )
    asyncio.run(_check_refused(p, v3))


async def _check_refused(p, v3: Path) -> None:
    async with httpx.AsyncClient(base_url=p.base_url, timeout=120) as client:

        async def ready() -> bool:
            return f"{MODEL}@3" in await _models(client)

        await until(ready, timeout_s=120, interval_s=0.5, what="weir-tiny-py@3 to be ready")
        await asyncio.to_thread(_weir_models, p, "unload", f"{MODEL}@3")

        async def gone() -> bool:
            return f"{MODEL}@3" not in await _models(client)

        await until(gone, timeout_s=60, interval_s=0.5, what="weir-tiny-py@3 to unload")

        async def no_worker_has_it() -> bool:  # drained and its engine stopped
            shown = orjson.loads(await asyncio.to_thread(_weir_models, p, "show", f"{MODEL}@3", "--json"))
            return not shown["versions"][0]["workers"]

        await until(no_worker_has_it, timeout_s=60, interval_s=0.5, what="no worker to report weir-tiny-py@3")
        weights = v3 / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        await asyncio.to_thread(_weir_models, p, "load", f"{MODEL}@3")

        async def failed_shown() -> str | None:
            shown = await asyncio.to_thread(_weir_models, p, "show", f"{MODEL}@3")
            return shown if "failed" in shown else None

        shown = await until(failed_shown, timeout_s=60, interval_s=1.0, what="weir-tiny-py@3 to report failed")
        assert "model.safetensors" in shown, shown
        started = time.monotonic()
        resp = await client.post("/v1/completions", json={**BODY, "model": f"{MODEL}@3", "stream": False})
        assert time.monotonic() - started < 30, "a request for a failed version waited"
        assert resp.status_code not in (200, 500), resp.text
        assert f"{MODEL}@3" in resp.text, resp.text
        ok = await client.post("/v1/completions", json={**BODY, "stream": False})
        assert ok.status_code == 200, ok.text
