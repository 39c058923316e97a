"""Quantized linear layers on the CPU: int8 (ggml's Q8_0 layout) and int4 (ggml's Q4_1 layout).

Weights are stored per 32-value block along the input dimension K:

    int8   q int8 [N, K]       d f16 [N, K/32]              w = d * q
    int4   q uint8 [N, K/2]    d, m f16 [N, K/32]           w = d * q + m   (byte j of a block: value j
                                                                              low nibble, j + 16 high)

`q8_linear` / `q4_linear` run x[B, K] @ w^T with the AVX2 kernels of kernels/cpu_quant.cpp when they
are built (activations quantized per row and block to int8, integer dot products, as llama.cpp);
otherwise, and as the tests' oracle, `*_ref` dequantizes and calls F.linear. The extension is
compiled once per (source, torch, compiler) into $WEIR_HOME/cache/ext/ with g++ (no ninja needed);
`python -m kernels.cpu_quant` builds it ahead of time (scripts/setup.sh does). When no compiler or
no AVX2/FMA/F16C CPU is there, `extension_error()` says why and callers keep float32 weights.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

QK = 32
SOURCE = Path(__file__).with_name("cpu_quant.cpp")
_error: str | None = None


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q int8 [N, K], d f16 [N, K/32]): d = max|w| / 127 per block, q = round(w / d)."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"int8 quantization needs K a multiple of {QK}, got {k}")
    blocks = w.detach().float().reshape(n, k // QK, QK)
    d = (blocks.abs().amax(-1) / 127.0).half()
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.contiguous()


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (q uint8 [N, K/2], d f16, m f16 [N, K/32]): m = block min, d = (max - min) / 15.

    On values that already are a Q4_1 block's (a GGUF import of one) this gives back the same q.
    """
    n, k = w.shape
    if k % QK:
        raise ValueError(f"int4 quantization needs K a multiple of {QK}, got {k}")
    blocks = w.detach().float().reshape(n, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    df = d.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round((blocks - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous()


def dequantize_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.float().reshape(n, k // QK, QK) * d.float()[..., None]).reshape(n, k)


def dequantize_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, half = q.shape
    packed = q.reshape(n, half // 16, 16)
    values = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # [n, blocks, 32]
    return (values * d.float()[..., None] + m.float()[..., None]).reshape(n, half * 2)


def q8_linear_ref(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_int8(q, d).to(x.dtype), bias)


def q4_linear_ref(
    x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, dequantize_int4(q, d, m).to(x.dtype), bias)


def q8_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 on the CPU @ the int8 weight^T: the AVX2 kernel when built, else the reference."""
    if x.is_cuda or not extension_available():
        return q8_linear_ref(x, q, d, bias)
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    return torch.ops.weir_quant.q8_linear(flat, q, d, bias).reshape(*x.shape[:-1], q.shape[0])


def q4_linear(
    x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] float32 on the CPU @ the int4 weight^T: the AVX2 kernel when built, else the reference."""
    if x.is_cuda or not extension_available():
        return q4_linear_ref(x, q, d, m, bias)
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    return torch.ops.weir_quant.q4_linear(flat, q, d, m, bias).reshape(*x.shape[:-1], q.shape[0])


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    """$WEIR_KERNEL_CACHE (the image sets it: the kernels are built into it at image build), else
    $WEIR_HOME/cache/ext, WEIR_HOME as weir/home.py resolves it (kernels/ may not import weir/)."""
    if built := os.environ.get("WEIR_KERNEL_CACHE"):
        return Path(built).expanduser().resolve()
    repo = Path(__file__).resolve().parents[1]
    if env := os.environ.get("WEIR_HOME"):
        home = Path(env).expanduser().resolve()
    elif (repo / "pyproject.toml").exists() and os.access(repo, os.W_OK):
        home = repo / "var"
    else:
        home = Path.home() / ".cache" / "weir"
    return home / "cache" / "ext"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build_key(compiler: str) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"no C++ compiler ({compiler}: {exc}); install g++ or set CXX") from exc
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{version}|{sys.version_info[:2]}".encode())
    return digest.hexdigest()[:16]


def build(verbose: bool = False) -> Path:
    """Compile kernels/cpu_quant.cpp (once; the cache keeps it) and return the .so's path."""
    from torch.utils.cpp_extension import include_paths

    compiler = _compiler()
    out = _cache_dir() / f"weir_quant_{_build_key(compiler)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = [
            compiler,
            "-O3",
            "-std=c++20",
            "-shared",
            "-fPIC",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()),
            f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE),
            f"-L{torch_lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}",
            "-o",
            str(target),
        ]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(target, out)  # atomic: another process building at once loads one or the other
    return out


@functools.cache
def extension_available() -> bool:
    """True once the AVX2 kernels are loaded (built first when needed); WEIR_QUANT_KERNELS=0: never."""
    global _error
    if os.environ.get("WEIR_QUANT_KERNELS", "1") == "0":
        _error = "WEIR_QUANT_KERNELS=0"
        return False
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        _error = f"this CPU lacks {', '.join(sorted(missing))}"
        return False
    try:
        torch.ops.load_library(str(build()))
    except (RuntimeError, OSError) as exc:
        _error = str(exc)
        return False
    return True


def extension_error() -> str | None:
    """Why the AVX2 kernels are not in use (None when they are, or were not asked for yet)."""
    extension_available()
    return _error


if __name__ == "__main__":
    quiet = "--quiet" in sys.argv
    if missing := {"avx2", "fma", "f16c"} - _cpu_flags():
        sys.exit(f"kernels/cpu_quant: this CPU lacks {', '.join(sorted(missing))}")
    try:
        path = build(verbose=not quiet)
    except RuntimeError as exc:
        sys.exit(f"kernels/cpu_quant: {exc}")
    if not quiet:
        print(path)
