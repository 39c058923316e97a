"""GPU kernels of Weir's worker, each with the PyTorch reference that is its CPU path and test oracle.

One module per op. Each exposes `<op>_ref` (PyTorch) and `<op>` (dispatcher: the Triton kernel on
CUDA tensors when Triton is usable, the reference otherwise).
"""

from kernels.activation import silu_and_mul
from kernels.norm import rms_norm
from kernels.paged_attention import paged_attention_decode
from kernels.rotary import apply_rotary

__all__ = ["apply_rotary", "paged_attention_decode", "rms_norm", "silu_and_mul"]
