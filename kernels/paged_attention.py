"""Decode attention over a paged KV cache: one query token per sequence."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.dispatch import use_triton


class DecodePlan(NamedTuple):
    """What the reference derives from a decode group's block tables, the same in every layer:
    made once per step (decode_plan) instead of once per layer."""

    rows: torch.Tensor  # [seqs * max_blocks] int64: the blocks to gather, row-major
    mask: torch.Tensor  # [seqs, 1, 1, max_blocks * block_size] float32: 0 over the context, -inf past it


def decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodePlan:
    """The DecodePlan of one decode group (arguments as paged_attention_decode_ref's)."""
    max_ctx = block_tables.shape[1] * block_size
    positions = torch.arange(max_ctx, device=block_tables.device)
    mask = torch.zeros(block_tables.shape[0], 1, 1, max_ctx, device=block_tables.device)
    mask.masked_fill_((positions[None, :] >= context_lens[:, None].long())[:, None, None, :], float("-inf"))
    return DecodePlan(block_tables.reshape(-1).long(), mask)


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    q: [seqs, heads, dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, dim];
    block_tables: [seqs, max_blocks] int32 (padding entries may hold any valid block id);
    context_lens: [seqs] int32, tokens of context including the new one (already written).
    plan: decode_plan(block_tables, context_lens, block_size), when the caller made it already.
    Returns [seqs, heads, dim] in q's dtype.
    """
    num_seqs, num_heads, dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = block_tables.shape[1] * block_size
    # gather whole blocks as rows of the flat cache (index_select copies 4 KiB rows, ~3x faster
    # than advanced indexing): [seqs * max_blocks, block_size * kv_heads * dim]
    # -> [seqs, kv_heads, max_ctx, dim]
    if plan is None:
        plan = decode_plan(block_tables, context_lens, block_size)
    rows = plan.rows
    keys = k_cache.reshape(num_blocks, -1).index_select(0, rows)
    values = v_cache.reshape(num_blocks, -1).index_select(0, rows)
    keys = keys.view(num_seqs, max_ctx, num_kv_heads, dim).transpose(1, 2).float()
    values = values.view(num_seqs, max_ctx, num_kv_heads, dim).transpose(1, 2).float()
    # GQA as a query length: the `group` query heads of kv head h are rows of one SDPA query
    # [seqs, kv_heads, group, dim], so no K/V head is repeated (query head h reads kv head h // group).
    out = F.scaled_dot_product_attention(
        q.float().reshape(num_seqs, num_kv_heads, group, dim), keys, values, attn_mask=plan.mask, scale=scale
    )
    return out.reshape(num_seqs, num_heads, dim).to(q.dtype)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Dispatch: Triton on CUDA, the reference elsewhere. Same contract as the reference (the
    Triton kernel reads the block tables itself and ignores `plan`)."""
    if use_triton(q, k_cache):
        from kernels.triton_paged_attention import paged_attention_decode_triton

        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, plan)
