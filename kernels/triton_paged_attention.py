"""Triton decode attention over a paged KV cache (same contract as paged_attention_decode_ref).

One program per (sequence, kv head): it loads the query heads that share the kv head (GQA) as one
tile, walks the sequence's block table BLOCK_N tokens at a time and keeps an online softmax
(running max, running sum, rescaled accumulator) in float32. Tokens at or past context_len are
masked, so padding entries of the block table are never read.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    ctx_ptr,
    scale_log2,
    q_s0,
    q_s1,
    o_s0,
    o_s1,
    k_s0,
    k_s1,
    k_s2,
    v_s0,
    v_s1,
    v_s2,
    bt_s0,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    qo_mask = g_mask[:, None] & d_mask[None, :]

    q = tl.load(q_ptr + seq * q_s0 + heads[:, None] * q_s1 + offs_d[None, :], mask=qo_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq * bt_s0
    for start in range(0, ctx, BLOCK_N):
        tok = start + offs_n
        n_mask = tok < ctx
        block = tl.load(bt_row + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = (tok % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_off = block * k_s0 + slot * k_s1 + kv_head * k_s2
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))  # [BLOCK_G, BLOCK_N], log2 units

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_off = block * v_s0 + slot * v_s1 + kv_head * v_s2
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + seq * o_s0 + heads[:, None] * o_s1 + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=qo_mask,
    )


def _interpreted(kernel: object) -> bool:
    """True when TRITON_INTERPRET=1 was set as the kernel was decorated (it then runs on numpy)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    q: [seqs, heads, dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, dim];
    block_tables: [seqs, max_blocks] int32; context_lens: [seqs] int32 (>= 1; 0 gives NaN rows,
    as the reference does). Returns [seqs, heads, dim] in q's dtype. block_n: tokens per
    iteration (a power of two >= 16; default 64).
    """
    num_seqs, num_heads, dim = q.shape
    _, page, num_kv_heads, kdim = k_cache.shape
    if num_heads % num_kv_heads or kdim != dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: q {list(q.shape)}, k_cache {list(k_cache.shape)}, v_cache {list(v_cache.shape)}")
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    block_n = block_n or 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    # Dots run in the cache's 16-bit dtype (fp32 accumulation) on the GPU; in float32 ("ieee", not
    # tf32) for a float32 cache, mixed dtypes, and under the interpreter, whose tl.dot multiplies
    # bfloat16 operands as their raw uint16 bits (triton 3.9).
    dot_fp32 = (
        k_cache.dtype == torch.float32 or k_cache.dtype != v_cache.dtype or _interpreted(_paged_attention_decode_kernel)
    )
    _paged_attention_decode_kernel[(num_seqs, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=dim,
        PAGE=page,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n,
        DOT_FP32=dot_fp32,
        num_warps=4,
    )
    return out
