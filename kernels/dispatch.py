"""When to use a Triton kernel instead of its PyTorch reference."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when Triton imports and may launch kernels (WEIR_DISABLE_TRITON=1 turns it off)."""
    if os.environ.get("WEIR_DISABLE_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors; on the CPU the reference is the path (and the oracle).

    TRITON_INTERPRET=1 lets tests run the Triton kernels on CPU tensors through its interpreter;
    the serving path never does that, it is far slower than the reference.
    """
    if not triton_available():
        return False
    return all(t.is_cuda for t in tensors)
