"""How much memory a model version takes on this worker: estimated before loading, measured after.

estimate_bytes(config, settings)   before loading: the weights as they will be loaded (element
                                   counts from the files' headers times the dtype the engine
                                   loads in) plus the KV cache the settings give each instance,
                                   times instances; the worker refuses a version that does not
                                   fit its budget (docs/design.md, invariant 10)
engine_used_bytes(engine)          after: what a built engine holds
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from schemas.model_repo import ModelConfig
from services.worker.config import WorkerSettings
from services.worker.engine import EchoEngine, EmbeddingEngine, Engine, EngineConfig, EngineLike
from services.worker.engine.model import cpu_packed_gemm_available
from services.worker.hosts.hardware import choose_device, resolve_engine

# Dtype the torch engine loads weights and KV cache in (services/worker/engine/llm_engine.py).
_LOADED_ELEMENT_BYTES = {"cpu": 4, "cuda": 2}  # float32 on the CPU, bfloat16 on CUDA


def estimate_bytes(config: ModelConfig, settings: WorkerSettings, device: torch.device | None = None) -> int:
    """Bytes `config` will take on this worker: (weights as loaded + KV cache) x instances.

    The KV cache is settings.kv_cache_bytes on the CPU; on CUDA the engine takes a share of the
    device's free memory (EngineConfig.gpu_memory_fraction), so that is what is counted there.
    FileNotFoundError when the weights are not where the entry says.
    """
    device = device or choose_device(settings.device)
    engine, _ = resolve_engine(config, device)
    if engine == "echo":
        return 0
    if engine == "onnx":
        return _onnx_bytes(config) * config.instances
    element_bytes = _LOADED_ELEMENT_BYTES.get(device.type, 4)
    if config.quantization != "none" and device.type == "cpu":  # no oneDNN copies: the quantized buffers only
        from weir.models.sources import quantized_weight_bytes

        weights = quantized_weight_bytes(config)
        if weights is None:  # a GGUF source not imported yet: 34/32 bytes per element bound it
            weights = math.ceil(_torch_elements(config) * 34 / 32)
        return (weights + _kv_cache_bytes(settings, device)) * config.instances
    weights = _torch_elements(config) * element_bytes
    if device.type == "cpu" and cpu_packed_gemm_available():
        weights *= 2  # the oneDNN copies of the projections (engine/model.py); an untied embedding is counted too
    return (weights + _kv_cache_bytes(settings, device)) * config.instances


def engine_used_bytes(engine: EngineLike) -> int:
    """Bytes a built engine holds: torch parameters and KV-cache tensors (measured); an onnx
    session's model file (what onnxruntime loads; its arena is not visible from Python); 0 for echo."""
    if isinstance(engine, Engine):
        cache = sum(t.numel() * t.element_size() for pair in engine.kv_caches for t in pair)
        return engine.model.weight_bytes + cache  # parameters, quantized buffers (tied: once), oneDNN copies
    if isinstance(engine, EmbeddingEngine):
        return sum(f.stat().st_size for f in engine.model_dir.glob("*.onnx*"))
    if isinstance(engine, EchoEngine):
        return 0
    return 0


def _kv_cache_bytes(settings: WorkerSettings, device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * EngineConfig.gpu_memory_fraction)
    return settings.kv_cache_bytes


def _torch_elements(config: ModelConfig) -> int:
    """Weight elements of a torch entry: from its safetensors headers, else its GGUF's tensors."""
    from weir.models.sources import default_model_dir, gguf_file

    model_dir = config.path if config.source is None else (config.path or default_model_dir(config.name))
    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir is not None else []
    if files:
        return sum(_safetensors_elements(f) for f in files)
    if config.source is None:
        raise FileNotFoundError(f"model {config.name!r}: no *.safetensors in {model_dir}")
    from weir.models.gguf_file import read_gguf  # not imported yet: count the GGUF's tensors

    return sum(math.prod(t.shape) for t in read_gguf(gguf_file(config.source)).tensors.values())


def _safetensors_elements(path: Path) -> int:
    """Elements of every tensor in a safetensors file, read from its JSON header only."""
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__" and "rotary_emb" not in k)


def _onnx_bytes(config: ModelConfig) -> int:
    """An onnx entry's model file(s), exported or not yet (then its source's float32 weights)."""
    from weir.embedding.onnx_export import default_export_dir, package_model_dir

    out = config.path or default_export_dir(config.name)
    exported = sorted(Path(out).glob("*.onnx*"))
    if exported:
        return sum(f.stat().st_size for f in exported)
    if config.source is None:
        raise FileNotFoundError(f"model {config.name!r}: no model.onnx in {out}")
    return sum(_safetensors_elements(f) for f in package_model_dir(config.source).glob("*.safetensors")) * 4
