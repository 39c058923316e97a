"""Triton rotary position embedding, Hugging Face's rotate-half convention (contract of apply_rotary_ref)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    out_ptr, x_ptr, tok, heads, num_heads, x_s0, x_s1, o_s0, o_s1, cos, sin, offs, d_mask, HALF: tl.constexpr
):
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    x_row = x_ptr + tok * x_s0 + heads[:, None] * x_s1 + offs[None, :]
    o_row = out_ptr + tok * o_s0 + heads[:, None] * o_s1 + offs[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    pos_ptr,
    cs_ptr,
    num_q_heads,
    num_k_heads,
    q_s0,
    q_s1,
    k_s0,
    k_s1,
    qo_s0,
    qo_s1,
    ko_s0,
    ko_s1,
    cs_s0,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Grid: (tokens, head blocks). Each program rotates up to BLOCK_H heads of q and of k of one token.
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cs_ptr + pos * cs_s0 + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * cs_s0 + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_out_ptr, q_ptr, tok, heads, num_q_heads, q_s0, q_s1, qo_s0, qo_s1, cos, sin, offs, d_mask, HALF)
    _rotate_heads(k_out_ptr, k_ptr, tok, heads, num_k_heads, k_s0, k_s1, ko_s0, ko_s1, cos, sin, offs, d_mask, HALF)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, dim], k: [tokens, kv_heads, dim], positions: [tokens] (int64 or int32),
    cos_sin: [max_positions, dim] = [cos | sin]. Returns new rotated (q, k), same shapes and dtypes.

    q and k may be strided views (as split from a fused qkv projection); the last dim must be dense.
    """
    tokens, num_q_heads, dim = q.shape
    num_k_heads = k.shape[1]
    if dim % 2 or k.shape[0] != tokens or k.shape[2] != dim or cos_sin.shape[-1] != dim:
        raise ValueError(f"bad shapes: q {list(q.shape)}, k {list(k.shape)}, cos_sin {list(cos_sin.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    positions = positions.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(num_q_heads, num_k_heads)
    block_h = min(triton.next_power_of_2(max_heads), max(1, 2048 // block_half))
    grid = (tokens, triton.cdiv(max_heads, block_h))
    _rotary_kernel[grid](
        q_out,
        k_out,
        q,
        k,
        positions,
        cos_sin,
        num_q_heads,
        num_k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin.stride(0),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return q_out, k_out
