"""RoPE variants of Hugging Face configs: which frequencies each position rotates by.

config.json names its RoPE in `rope_scaling` (transformers 4.x; the type under `rope_type` or the
older `type`) or `rope_parameters` (transformers 5). The inverse frequencies follow
transformers.modeling_rope_utils operation for operation, in float32, so logits match theirs:

    default   inv_freq = 1 / theta^(2i / dim)
    linear    default / factor                          (position interpolation)
    llama3    low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1/3.2)
    dynamic   NTK-aware: theta grows with the sequence's length once it passes
              max_position_embeddings; below that it is the default

Dynamic NTK depends on the sequence length, as in transformers, whose rotary embedding takes the
length of the forward call (its highest position + 1). Weir gives each token the length
transformers' generate() would use for that request alone: a prompt token the prompt's length, a
generated token its own position + 1. That is independent of chunked prefill, batching and
preemption (a recomputed sequence gets the same rotations). Keys in the KV cache keep the rotation
they were written with, as in transformers. Prefix caching is off for such a model: a cached
block's keys were rotated for another prompt's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.rotary import cos_sin_rows

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_KEYS = {  # the keys each type reads; any other key would be ignored, so it is refused
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


class RopeConfigError(ValueError):
    """config.json asks for a RoPE that Weir does not compute; the message names the key."""


@dataclass(frozen=True)
class RopeScaling:
    """The RoPE of one model, read from its config.json."""

    rope_type: str
    theta: float
    max_position_embeddings: int  # config.json's; dynamic NTK scales past it
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # llama3: the pretraining context
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @staticmethod
    def from_hf_config(config: dict) -> RopeScaling:
        """Read `rope_scaling` (it wins, as in transformers) or `rope_parameters`; raises RopeConfigError."""
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise RopeConfigError(f"rope_scaling must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise RopeConfigError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        unknown = set(params) - _COMMON_KEYS - _KEYS[rope_type]
        if unknown:
            raise RopeConfigError(f"rope_scaling keys {sorted(unknown)} are not used by rope type {rope_type!r}")
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise RopeConfigError(f"partial_rotary_factor={partial} is not supported (only full rotary, 1.0)")
        max_pos = int(config.get("max_position_embeddings", 2048))
        rope = RopeScaling(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=max_pos,
            factor=float(params.get("factor", 1.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_pos)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )
        rope._validate(params)
        return rope

    def _validate(self, params: dict) -> None:
        missing = sorted(_KEYS[self.rope_type] - {"original_max_position_embeddings"} - set(params))
        if missing:
            raise RopeConfigError(f"rope type {self.rope_type!r} needs {missing} in rope_scaling")
        if self.factor < 1.0:
            raise RopeConfigError(f"rope_scaling factor={self.factor} must be >= 1")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise RopeConfigError(f"llama3 rope: {self.high_freq_factor=} must be > {self.low_freq_factor=}")

    @property
    def max_context_len(self) -> int:
        """Longest context served. Linear and dynamic stretch max_position_embeddings by `factor`
        (as vLLM does); a llama3 config's max_position_embeddings is already the extended length."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        return self.max_position_embeddings

    @property
    def is_length_dependent(self) -> bool:
        """True when a token's rotation depends on its sequence's length (dynamic NTK)."""
        return self.rope_type == "dynamic"


def _exponents(head_dim: int, device: torch.device | str) -> torch.Tensor:
    # [head_dim / 2] float32: 2i / dim, computed as transformers does (int64 arange, then float)
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def static_inv_freq(rope: RopeScaling, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, the same for every sequence length.

    For dynamic NTK these are the frequencies of sequences within max_position_embeddings.
    """
    inv_freq = 1.0 / (rope.theta ** _exponents(head_dim, device))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq)
    return inv_freq


def _llama3(rope: RopeScaling, inv_freq: torch.Tensor) -> torch.Tensor:
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_inv_freq(rope: RopeScaling, head_dim: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """seq_lens: [n] int64. Returns [n, head_dim / 2] float32: dynamic NTK frequencies per length."""
    max_pos = rope.max_position_embeddings
    lens = torch.clamp(seq_lens, min=max_pos).float()
    base = rope.theta * ((rope.factor * lens / max_pos) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base[:, None] ** _exponents(head_dim, seq_lens.device)[None, :])


class RotaryEmbedding:
    """The cos/sin table of a model's positions, and per-step rows where they depend on length."""

    def __init__(self, rope: RopeScaling, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.rope = rope
        self.head_dim = head_dim
        positions = torch.arange(rope.max_context_len, device=device)
        # cos_sin: [max_context_len, head_dim] float32 = [cos | sin], as kernels.apply_rotary takes
        self.cos_sin = cos_sin_rows(positions, static_inv_freq(rope, head_dim, device))

    def needs_seq_lens(self, max_seq_len: int) -> bool:
        """Whether a step whose longest sequence is `max_seq_len` needs per-token sequence lengths."""
        return self.rope.is_length_dependent and max_seq_len > self.rope.max_position_embeddings

    def select(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, table) for kernels.apply_rotary: row indices[t] of table rotates token t.

        positions: [tokens] int64. seq_lens: [tokens] int64, the sequence length each token's
        rotation is for (dynamic NTK), or None: then the indices are the positions themselves.
        """
        if seq_lens is None:
            return positions, self.cos_sin
        rows = self.cos_sin[positions]  # [tokens, head_dim], a copy
        is_long = seq_lens > self.rope.max_position_embeddings
        inv_freq = dynamic_inv_freq(self.rope, self.head_dim, seq_lens[is_long])
        rows[is_long] = cos_sin_rows(positions[is_long], inv_freq)
        return torch.arange(positions.shape[0], device=positions.device), rows
