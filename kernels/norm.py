"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rmsnorm(x + residual) * weight, x + residual). x, residual: [tokens, hidden].

    Without a residual the second value is x itself. Statistics are computed in float32.
    """
    if residual is not None:
        x = x + residual
    summed = x
    xf = x.float()
    inv = xf.pow(2).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()  # in place: the same values, fewer tensors
    product = xf * inv
    out = product.to(x.dtype)
    if out is product:  # float32: no cast made a copy, so the weight multiplies the fresh product in place
        return out.mul_(weight), summed
    return out * weight, summed


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: Triton on CUDA, the reference elsewhere. Same contract as rms_norm_ref."""
    if use_triton(x):
        from kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
