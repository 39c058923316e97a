"""Triton SiLU-and-multiply, the gate of a SwiGLU MLP (same contract as silu_and_mul_ref)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, out_stride, x_stride, d, BLOCK: tl.constexpr):
    # Grid: (rows, column blocks). silu(gate) is rounded to the output dtype before the product,
    # as the reference (and vLLM's kernel) does; both are computed in float32.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] holding [gate | up]; returns silu(gate) * up: [..., d]."""
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"last dimension must be even, got {two_d}")
    d = two_d // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0 or d == 0:
        return out
    o2 = out.view(-1, d)
    block = min(triton.next_power_of_2(d), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        o2, x2, o2.stride(0), x2.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1
    )
    return out
