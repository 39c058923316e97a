"""Rotary position embedding (RoPE), Hugging Face's rotate-half convention."""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """cos_sin cache of plain RoPE: [max_positions, head_dim] = [cos(half) | sin(half)] in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return cos_sin_rows(torch.arange(max_positions, device=device), inv_freq)


def cos_sin_rows(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rows of a cos_sin table: [n, 2 * half] = [cos | sin] float32 of positions[j] * inv_freq.

    positions: [n]; inv_freq: [half] (one set for all rows) or [n, half] (one per row, as dynamic
    NTK scaling gives). Scaled RoPE variants differ only in inv_freq (services/worker/engine/rope.py).
    """
    freqs = positions.float()[:, None] * inv_freq  # [n, half]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, dim], k: [tokens, kv_heads, dim], positions: [tokens] int64.

    Returns the rotated (q, k), same shapes and dtypes.
    """
    cos, sin = rotary_rows(positions, cos_sin)
    return rotate_half_rows(q, cos, sin), rotate_half_rows(k, cos, sin)


def rotary_rows(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [tokens, 1, dim / 2] float32: the rows of cos_sin that rotate each token
    (gathered once per step: every layer rotates by the same rows)."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]  # [tokens, dim]
    return cs[:, None, :half], cs[:, None, half:]


def rotate_half_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, dim] (any heads: q and k may go together); cos, sin from rotary_rows.
    Returns x rotated (a new contiguous tensor, x's dtype), computed in float32 as HF does."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: Triton on CUDA, the reference elsewhere."""
    if use_triton(q, k):
        from kernels.triton_rotary import apply_rotary_triton

        return apply_rotary_triton(q, k, positions, cos_sin)
    return apply_rotary_ref(q, k, positions, cos_sin)
