"""Triton RMSNorm fused with the residual add that precedes it (same contract as rms_norm_ref)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    sum_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    out_stride,
    sum_stride,
    x_stride,
    res_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row. The sum is rounded to its dtype before the statistics, and the normed
    # value to the sum's dtype before the weight, as the reference does.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rmsnorm(x + residual) * weight, x + residual); without a residual the second is x."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {list(weight.shape)}")
    x2 = _rows(x, hidden)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {list(residual.shape)} must match x {list(x.shape)}")
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        s2, r2 = summed.view(-1, hidden), _rows(residual, hidden)
    else:
        summed, s2, r2 = x, x2, x2
    out = torch.empty(x.shape, dtype=torch.promote_types(summed.dtype, weight.dtype), device=x.device)
    o2 = out.view(-1, hidden)
    rows = x2.shape[0]
    if rows == 0 or hidden == 0:
        if residual is not None:
            summed.copy_(x + residual)
        return out, summed
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 256, 1), 16)
    _rms_norm_kernel[(rows,)](
        o2,
        s2,
        x2,
        r2,
        weight.contiguous(),
        o2.stride(0),
        s2.stride(0),
        x2.stride(0),
        r2.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out, summed
