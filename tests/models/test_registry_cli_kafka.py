"""`weir models` end to end against the real broker: push, list, show, load/unload/retire, promote
(refused without a live worker that has the version ready), seed, and a registry topic holding
forged records (docs/design.md, "The model registry", invariant 10)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import orjson
import pytest

from schemas.codec import encode
from schemas.messages import VersionStatus, WorkerHeartbeat, now_ms
from schemas.model_repo import ModelConfig
from schemas.registry import GoldenCase, ModelRoute
from schemas.topics import Topics
from tests.conftest import BOOTSTRAP
from weir import cli as weir_cli
from weir.bus import BusSettings, make_producer
from weir.models import cli as models_cli
from weir.models.manifest import read_manifest_file
from weir.models.signing import generate_keypair
from weir.registry import read_registry

pytestmark = pytest.mark.kafka

TINY = Path(__file__).resolve().parents[2] / "models" / "weir-tiny-py"


@pytest.fixture
def prefix() -> str:
    return f"h{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("models") / "tiny"
    shutil.copytree(TINY, where)
    return where


def weir(prefix: str, *argv: str) -> int:
    """`weir models ARGV` as the console script runs it, on this test's prefix."""
    return weir_cli.main(["models", *argv, "--bootstrap", BOOTSTRAP, "--topic-prefix", prefix])


def _json(capsys, prefix: str, *argv: str) -> dict:
    capsys.readouterr()
    assert weir(prefix, *argv, "--json") == 0
    return orjson.loads(capsys.readouterr().out)


def _settings(prefix: str) -> BusSettings:
    return BusSettings(kafka_bootstrap=BOOTSTRAP, topic_prefix=prefix)


async def _produce(prefix: str, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(_settings(prefix), client_id="test-models")
    await producer.start()
    try:
        for key, value in items:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def _heartbeat(worker: str, versions: dict[str, str], sent_ms: int | None = None) -> tuple[bytes, bytes]:
    hb = WorkerHeartbeat(worker_id=worker, models=[s for s, v in versions.items() if v == "ready"], is_ready=True,
                         num_running=0, num_waiting=0, max_num_seqs=4, free_kv_blocks=10, block_size_tokens=8,
                         versions={s: VersionStatus(state=v) for s, v in versions.items()},
                         sent_ms=sent_ms if sent_ms is not None else now_ms())
    return worker.encode(), encode(hb)


def _push(prefix: str, tiny: Path, version: str, *extra: str) -> int:
    return weir(prefix, "push", str(tiny), "--name", "tiny", "--version", version, "--no-goldens", "--out", str(tiny.parent / f"tiny@{version}.manifest.json"), *extra)


def test_push_list_show_and_desired_states(prefix: str, tiny: Path, tmp_path: Path, capsys) -> None:
    generate_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    # --from-toml takes an entry by --name: weir-tiny-py's settings, under the name tiny
    assert weir(prefix, "push", str(tiny), "--name", "tiny", "--version", "1", "--from-toml", "models.toml") == 2
    assert "has no entry [models.tiny]" in capsys.readouterr().err
    assert weir(prefix, "push", str(tiny), "--name", "tiny", "--version", "1", "--no-goldens",
                "--max-model-len", "256", "--budget-bytes", "100000000") == 0
    assert "it is the default of its name" in capsys.readouterr().out
    assert weir(prefix, "push", str(tiny), "--name", "tiny", "--version", "2", "--no-goldens", "--quantization", "int8",
                "--sign-key", str(tmp_path / "k.key"), "--out", str(tmp_path / "t2.json")) == 0
    manifest, signature = read_manifest_file(tmp_path / "t2.json")
    assert signature is not None and manifest.serving["quantization"] == "int8"

    listing = _json(capsys, prefix, "list")
    (model,) = listing["models"]
    assert model["name"] == "tiny" and model["default_version"] == "1"
    assert [(v["version"], v["desired"]) for v in model["versions"]] == [("1", "loaded"), ("2", "loaded")]

    shown = _json(capsys, prefix, "show", "tiny@2")
    (v2,) = shown["versions"]
    assert v2["digest"] == manifest.digest() and v2["signature_key_id"] == signature.key_id
    assert {f["path"] for f in v2["files"]} == {f.path for f in manifest.files} and "model.safetensors" in str(v2)
    assert shown["route"]["default_version"] == "1" and v2["goldens"] == 0 and v2["budget_bytes"] is None
    assert v2["quantization"] == "int8"
    v1 = _json(capsys, prefix, "show", "tiny@1")["versions"][0]
    assert v1["budget_bytes"] == 100000000 and v1["signature_key_id"] is None and v1["quantization"] == "none"
    capsys.readouterr()
    assert weir(prefix, "show", "tiny@2") == 0
    assert "quantization int8" in capsys.readouterr().out

    assert weir(prefix, "unload", "tiny@1") == 2  # the default cannot be unloaded
    assert "default version of 'tiny'; promote another version first" in capsys.readouterr().err
    assert weir(prefix, "unload", "tiny@2") == 0
    assert weir(prefix, "load", "tiny@2") == 0
    assert weir(prefix, "retire", "tiny@2") == 0
    assert weir(prefix, "load", "tiny@2") == 2
    assert "retired; push it again under a new version" in capsys.readouterr().err
    assert weir(prefix, "show", "tiny@9") == 2
    state = asyncio.run(read_registry(_settings(prefix)))
    assert state.versions["tiny@2"].desired == "retired" and state.versions["tiny@1"].desired == "loaded"

    capsys.readouterr()
    assert weir(prefix, "list") == 0
    table = capsys.readouterr().out
    assert "tiny  1*       loaded" in table and "tiny  2        retired" in table


def test_push_refuses_another_manifest_under_a_registered_version(prefix: str, tiny: Path, capsys) -> None:
    assert _push(prefix, tiny, "1") == 0
    assert _push(prefix, tiny, "1", "--max-batch-size", "3") == 2  # other serving settings: another manifest
    assert "tiny@1 is registered with other files" in capsys.readouterr().err
    assert _push(prefix, tiny, "1", "--budget-bytes", "1000") == 2  # the same again: its budget would be lost
    assert "tiny@1 is registered already with these files and settings" in capsys.readouterr().err
    assert asyncio.run(read_registry(_settings(prefix))).versions["tiny@1"].budget_bytes is None


def test_push_records_the_goldens_it_is_given(prefix: str, tiny: Path, capsys) -> None:
    calls: list[tuple[ModelConfig, list[str], int]] = []

    def recorder(config: ModelConfig, prompts: list[str], max_tokens: int) -> list[GoldenCase]:
        calls.append((config, prompts, max_tokens))
        return [GoldenCase(prompt=p, max_tokens=max_tokens, expected_token_ids=[1, 2]) for p in prompts]

    argv = ["push", str(tiny), "--name", "tiny", "--version", "3", "--goldens", "def f():", "--goldens", "x = ",
            "--golden-max-tokens", "4", "--out", str(tiny.parent / "g.json"), "--bootstrap", BOOTSTRAP,
            "--topic-prefix", prefix]
    assert models_cli.main(argv, record_goldens=recorder) == 0
    ((config, prompts, max_tokens),) = calls
    assert config.served_id == "tiny@3" and config.path == tiny.resolve()
    assert (prompts, max_tokens) == (["def f():", "x = "], 4)
    record = asyncio.run(read_registry(_settings(prefix))).versions["tiny@3"]
    assert [g.prompt for g in record.goldens] == ["def f():", "x = "]
    # without a recorder (weir/ alone), goldens cannot be recorded: refused, nothing registered
    assert models_cli.main([*argv[:5], "4", *argv[6:]]) == 2
    assert "recording goldens needs the worker's engines" in capsys.readouterr().err
    assert models_cli.main([*argv[:5], "4", *argv[6:], "--no-goldens"]) == 2  # contradicts --goldens
    assert "tiny@4" not in asyncio.run(read_registry(_settings(prefix))).versions


def test_push_records_real_goldens_with_the_workers_engine(prefix: str, tiny: Path, capsys) -> None:
    """The console script's push (weir/cli.py -> services/worker/models_cli.py) runs the model."""
    assert weir(prefix, "push", str(tiny), "--name", "tiny", "--version", "g", "--goldens", "def main():",
                "--golden-max-tokens", "3", "--out", str(tiny.parent / "real.json")) == 0
    assert "2 goldens" in capsys.readouterr().out  # greedy, and the seeded sampled case of the same prompt
    (golden, sampled) = asyncio.run(read_registry(_settings(prefix))).versions["tiny@g"].goldens
    assert golden.prompt == "def main():" and golden.kind == "generate" and len(golden.expected_token_ids) == 3
    assert sampled.prompt == "def main():" and sampled.temperature == 1.0 and len(sampled.expected_token_ids) == 3


def test_promote_needs_a_live_worker_with_the_version_ready(prefix: str, tiny: Path, capsys) -> None:
    assert _push(prefix, tiny, "1") == 0 and _push(prefix, tiny, "2") == 0
    workers = Topics(prefix).workers
    assert weir(prefix, "promote", "tiny@2") == 2
    assert "no live worker has tiny@2 ready (no live worker reports it)" in capsys.readouterr().err
    stale = now_ms() - 60_000
    asyncio.run(_produce(prefix, workers, [_heartbeat("w-old", {"tiny@2": "ready"}, sent_ms=stale),
                                           _heartbeat("w1", {"tiny@1": "ready", "tiny@2": "loading"}),
                                           (b"junk", b"not a heartbeat")]))
    assert weir(prefix, "promote", "tiny@2") == 2  # w-old is not live; w1 is still loading it
    assert "live workers report: w1:loading" in capsys.readouterr().err

    listing = _json(capsys, prefix, "list")
    assert listing["live_workers"] == ["w1"] and listing["skipped_heartbeats"] == 1
    by_version = {v["version"]: v["workers"] for v in listing["models"][0]["versions"]}
    assert by_version["1"]["w1"]["state"] == "ready" and by_version["2"]["w1"]["state"] == "loading"

    asyncio.run(_produce(prefix, workers, [_heartbeat("w1", {"tiny@1": "ready", "tiny@2": "ready"})]))
    assert weir(prefix, "promote", "tiny@2") == 0
    assert "tiny@1 asked to unload" in capsys.readouterr().out
    state = asyncio.run(read_registry(_settings(prefix)))
    assert state.routes["tiny"].default_version == "2" and state.routes["tiny"].previous_version == "1"
    assert state.versions["tiny@1"].desired == "unloaded"
    assert weir(prefix, "promote", "tiny@2") == 2  # already the default
    assert weir(prefix, "load", "tiny@1") == 0
    assert weir(prefix, "promote", "tiny@1", "--force") == 0  # no live worker has it ready: forced
    assert asyncio.run(read_registry(_settings(prefix))).routes["tiny"].default_version == "1"


def test_forged_registry_records_are_skipped_by_list(prefix: str, tiny: Path, capsys) -> None:
    assert _push(prefix, tiny, "1") == 0
    good = asyncio.run(read_registry(_settings(prefix))).versions["tiny@1"]
    forged_route = ModelRoute(name="tiny", default_version="666")
    asyncio.run(_produce(prefix, Topics(prefix).models, [
        (b"version:evil@1", encode(good)),          # a valid record under another key
        (b"route:other", encode(forged_route)),      # a route under another name's key
        (b"version:tiny@1", b"{not json"),
        (b"version:tiny@1", b'{"kind": "version", "manifest": {}}'),
    ]))
    listing = _json(capsys, prefix, "list")
    assert [m["name"] for m in listing["models"]] == ["tiny"]
    assert listing["models"][0]["default_version"] == "1" and listing["skipped_records"] == 4
    capsys.readouterr()
    assert weir(prefix, "list") == 0
    assert "4 malformed registry record(s) skipped" in capsys.readouterr().out


def test_seed_registers_entries_whose_directories_exist(
    prefix: str, tiny: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_HOME", str(tmp_path / "home"))
    repo = tmp_path / "models.toml"
    repo.write_text(f'[models.tiny]\npath = "{tiny}"\nversion = "5"\n\n[models.echo]\nengine = "echo"\n\n'
                    f'[models.gone]\npath = "{tmp_path / "nowhere"}"\n\n'
                    f'[models.gguf]\nengine = "torch"\nsource = "{tmp_path / "x.gguf"}"\n')
    assert weir(prefix, "seed", "--model-repo", str(repo)) == 0
    out = capsys.readouterr().out
    assert "registered tiny@5" in out and "registered echo@1" in out
    assert f"skipped gone: directory {tmp_path / 'nowhere'} does not exist\n" in out
    # a GGUF source not imported yet: its directory under WEIR_HOME is missing
    assert "skipped gguf: directory " in out and "models/gguf does not exist; build it first (weir models prepare)" in out
    state = asyncio.run(read_registry(_settings(prefix)))
    assert set(state.versions) == {"tiny@5", "echo@1"} and state.routes["tiny"].default_version == "5"
    imported = tmp_path / "home" / "models" / "gguf"  # as `weir models prepare` would leave it
    imported.mkdir(parents=True)
    (imported / "model.safetensors").write_bytes(b"w" * 32)
    assert weir(prefix, "seed", "--model-repo", str(repo)) == 0
    out = capsys.readouterr().out
    assert "kept tiny@5: already registered" in out and "registered gguf@1" in out
    gguf = asyncio.run(read_registry(_settings(prefix))).versions["gguf@1"].manifest
    assert gguf.location == str(imported.resolve()) and [f.path for f in gguf.files] == ["model.safetensors"]


def test_an_unreachable_broker_is_one_line_and_exit_2(capsys) -> None:
    assert weir_cli.main(["models", "list", "--bootstrap", "127.0.0.1:1", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weir models list: error: no Kafka broker answered at 127.0.0.1:1") and err.count("\n") == 1
