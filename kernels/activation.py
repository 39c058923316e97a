"""SiLU-and-multiply, the gate of a SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * d] holding [gate | up]; returns silu(gate) * up: [tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])  # silu's output is fresh: multiplied in place


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatch: Triton on CUDA, the reference elsewhere."""
    if use_triton(x):
        from kernels.triton_activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
