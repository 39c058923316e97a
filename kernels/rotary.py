"""Rotary position embedding (RoPE), Hugging Face's rotate-half convention."""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """cos_sin cache: [max_positions, head_dim] = [cos(half) | sin(half)] in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # [positions, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, dim], k: [tokens, kv_heads, dim], positions: [tokens] int64.

    Returns the rotated (q, k), same shapes and dtypes.
    """
    half = q.shape[-1] // 2
    cs = cos_sin[positions]  # [tokens, dim]
    cos = cs[:, :half].unsqueeze(1)
    sin = cs[:, half:].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: Triton on CUDA, the reference elsewhere."""
    if use_triton(q, k):
        from kernels.triton_rotary import apply_rotary_triton

        return apply_rotary_triton(q, k, positions, cos_sin)
    return apply_rotary_ref(q, k, positions, cos_sin)
