"""Device discovery (NVIDIA GPUs through NVML, the CPU otherwise) and the engine each model runs on.

detect_devices()            one probe, NVML opened and closed (the CLI, one-off checks)
DeviceProbe                 the worker's: NVML opened once, probed on a thread at most every
                            interval, the last answer cached (heartbeats ask every second)
resolve_engine(config, d)   engine="auto" made concrete, and the runtime's label
engine_label(engine)        the runtime a built engine actually uses (heartbeats report it)
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.dispatch import triton_available
from schemas.messages import DeviceInfo
from schemas.model_repo import ModelConfig, detect_engine
from services.worker.engine import EchoEngine, EmbeddingEngine, Engine, EngineLike

log = logging.getLogger(__name__)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_device() -> DeviceInfo:
    """The host CPU, with the machine's memory."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * page_size
        total = pages * page_size
    except (ValueError, OSError):
        total = avail = 0
    return DeviceInfo(
        kind="cpu", name=f"{_cpu_name()} x{os.cpu_count()}", memory_total_bytes=total, memory_free_bytes=avail
    )


def _nvml_init() -> Any | None:
    """pynvml, initialised; None when the NVML library or a driver is absent."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s): using the CPU", exc)
        return None
    return pynvml


def _nvml_read(pynvml: Any) -> list[DeviceInfo]:
    """Every GPU's memory and utilisation, NVML being initialised."""
    devices = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        devices.append(
            DeviceInfo(
                kind="cuda",
                name=name.decode() if isinstance(name, bytes) else name,
                memory_total_bytes=int(mem.total),
                memory_free_bytes=int(mem.free),
                utilization_pct=float(util),
            )
        )
    return devices


def nvml_devices() -> list[DeviceInfo]:
    """GPUs that NVML reports; [] when the NVML library or a driver is absent."""
    pynvml = _nvml_init()
    if pynvml is None:
        return []
    try:
        return _nvml_read(pynvml)
    finally:
        pynvml.nvmlShutdown()


def _gpus_or_cpu(gpus: list[DeviceInfo]) -> list[DeviceInfo]:
    return gpus if gpus and torch.cuda.is_available() else [cpu_device()]


def detect_devices() -> list[DeviceInfo]:
    """GPUs when present (and usable by torch), else the CPU."""
    return _gpus_or_cpu(nvml_devices())


class DeviceProbe:
    """The worker's device probe: at most one probe per `interval_s`, on a thread, cached.

    Heartbeats go out every second from the event loop; a probe there (nvmlInit, a query per GPU,
    nvmlShutdown) blocked the loop that keeps the Kafka clients alive. NVML is initialised once,
    on the probe's thread, and shut down by close(). `probe` replaces the probing (tests).
    """

    def __init__(self, interval_s: float = 10.0, probe: Callable[[], list[DeviceInfo]] | None = None) -> None:
        self.interval_s = interval_s
        self._probe = probe or self._probe_nvml
        self._pynvml: Any | None = None
        self._is_nvml_tried = False
        self._nvml_lock = threading.Lock()  # the probe's thread against close()
        self._lock = asyncio.Lock()
        self._cached: list[DeviceInfo] | None = None
        self._probed_at = 0.0

    async def devices(self) -> list[DeviceInfo]:
        """The devices, probed anew (off the loop) when the last probe is `interval_s` old."""
        async with self._lock:  # callers that come during a probe share its answer
            if self._cached is None or time.monotonic() - self._probed_at >= self.interval_s:
                self._cached = await asyncio.to_thread(self._probe)
                self._probed_at = time.monotonic()
            return self._cached

    def _probe_nvml(self) -> list[DeviceInfo]:
        with self._nvml_lock:
            if not self._is_nvml_tried:
                self._is_nvml_tried = True
                self._pynvml = _nvml_init()
            if self._pynvml is None:
                return _gpus_or_cpu([])
            return _gpus_or_cpu(_nvml_read(self._pynvml))

    def close(self) -> None:
        """Shut NVML down (the worker is stopping); a later devices() opens it again."""
        with self._nvml_lock:
            if self._pynvml is not None:
                self._pynvml.nvmlShutdown()
            self._pynvml = None
            self._is_nvml_tried = False


def choose_device(requested: str) -> torch.device:
    """'auto' picks cuda when torch can use it; 'cuda' without a GPU is a configuration error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("WEIR_DEVICE=cuda but no CUDA device is usable; set WEIR_DEVICE=cpu or auto")
    return torch.device(requested)


def cpu_threads(requested: int) -> int:
    """torch intra-op threads for CPU inference (WEIR_ENGINE_THREADS): `requested`, or when 0 the
    cores the worker owns (its CPU affinity) less one for its own loop, at least one.

    An engine's step is ~120 projections and ~1,000 small ops, each an OpenMP parallel region: with
    as many threads as cores on a box that other processes also want, every region waits for a
    descheduled thread (docs/benchmarks.md, "Quantized weights": 2 threads on the loaded 2-core box
    made one step's projections 13-30x slower than 1 thread). So the default keeps one core free;
    a box whose cores are the engine's alone sets WEIR_ENGINE_THREADS to all of them.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)  # owned
    return requested or max(1, cores - 1)


def resolve_engine(config: ModelConfig, device: torch.device) -> tuple[str, str]:
    """(engine, label) a model entry runs with on `device`: engine="auto" made concrete
    (schemas/model_repo.py: detect_engine) and the runtime it will use, as heartbeats say it.

    The onnx label is what the device would give; a built engine says what it got (engine_label:
    onnxruntime falls back to the CPU when its CUDA provider does not load)."""
    engine = config.engine
    if engine == "auto":
        engine = detect_engine(config.path, config.source)
    if engine == "echo":
        return engine, "echo"
    if engine == "onnx":
        return engine, "onnxruntime-cuda" if device.type == "cuda" and _ort_has_cuda() else "onnxruntime-cpu"
    return engine, torch_label(device)


def _ort_has_cuda() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


def torch_label(device: torch.device) -> str:
    """torch-cpu; on CUDA torch-cuda+triton when the engine's ops run as Triton kernels (kernels/:
    rms_norm, rotary, silu_and_mul, paged attention; kernels.dispatch), else torch-cuda."""
    if device.type == "cuda" and triton_available():
        return "torch-cuda+triton"
    return f"torch-{device.type}"


def engine_label(engine: EngineLike) -> str:
    """The runtime a built engine actually uses: torch-cpu, torch-cuda(+triton), onnxruntime-cpu,
    onnxruntime-cuda (the provider its session took), or echo."""
    if isinstance(engine, Engine):
        return torch_label(engine.device)
    if isinstance(engine, EmbeddingEngine):
        return "onnxruntime-cuda" if engine.provider == "CUDAExecutionProvider" else "onnxruntime-cpu"
    if isinstance(engine, EchoEngine):
        return "echo"
    return type(engine).__name__
