"""Decode attention over a paged KV cache: one query token per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import use_triton


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context.

    q: [seqs, heads, dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, dim];
    block_tables: [seqs, max_blocks] int32 (padding entries may hold any valid block id);
    context_lens: [seqs] int32, tokens of context including the new one (already written).
    Returns [seqs, heads, dim] in q's dtype.
    """
    num_seqs, num_heads, dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = block_tables.shape[1] * block_size
    # gather whole blocks as rows of the flat cache (index_select copies 4 KiB rows, ~3x faster
    # than advanced indexing): [seqs * max_blocks, block_size * kv_heads * dim]
    # -> [seqs, kv_heads, max_ctx, dim]
    rows = block_tables.reshape(-1).long()
    keys = k_cache.reshape(num_blocks, -1).index_select(0, rows)
    values = v_cache.reshape(num_blocks, -1).index_select(0, rows)
    keys = keys.view(num_seqs, max_ctx, num_kv_heads, dim).transpose(1, 2).float()
    values = values.view(num_seqs, max_ctx, num_kv_heads, dim).transpose(1, 2).float()
    positions = torch.arange(max_ctx, device=q.device)
    # additive mask [seqs, 1, 1, max_ctx]: 0 over the context, -inf over padding
    mask = torch.zeros(num_seqs, 1, 1, max_ctx, device=q.device)
    mask.masked_fill_((positions[None, :] >= context_lens[:, None].long())[:, None, None, :], float("-inf"))
    # GQA as a query length: the `group` query heads of kv head h are rows of one SDPA query
    # [seqs, kv_heads, group, dim], so no K/V head is repeated (query head h reads kv head h // group).
    out = F.scaled_dot_product_attention(q.float().reshape(num_seqs, num_kv_heads, group, dim), keys, values,
                                         attn_mask=mask, scale=scale)  # fmt: skip
    return out.reshape(num_seqs, num_heads, dim).to(q.dtype)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dispatch: Triton on CUDA, the reference elsewhere. Same contract as the reference."""
    if use_triton(q, k_cache):
        from kernels.triton_paged_attention import paged_attention_decode_triton

        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
