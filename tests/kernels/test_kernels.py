"""Each Triton kernel against its PyTorch reference, over odd sizes and each dtype.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set
below before the kernel modules are imported: triton 3.9 reads it when @triton.jit decorates a
kernel). With CUDA and no TRITON_INTERPRET they run compiled on the GPU.

Under the interpreter two things differ from the GPU, and the tests allow for them:
- float32 -> bfloat16 casts truncate instead of rounding to nearest even (up to 1 ulp more error
  than on the GPU), hence the bfloat16 tolerances;
- tl.dot multiplies bfloat16 operands as their raw uint16 bits, so the attention kernel upcasts
  its dot operands to float32 when interpreted (see triton_paged_attention.py). The 16-bit dot
  path runs only on the GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

triton = pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels.activation import silu_and_mul_ref  # noqa: E402
from kernels.norm import rms_norm_ref  # noqa: E402
from kernels.paged_attention import paged_attention_decode_ref  # noqa: E402
from kernels.rotary import apply_rotary_ref, rope_cos_sin  # noqa: E402
from kernels.triton_activation import _silu_and_mul_kernel, silu_and_mul_triton  # noqa: E402
from kernels.triton_norm import _rms_norm_kernel, rms_norm_triton  # noqa: E402
from kernels.triton_paged_attention import (  # noqa: E402
    _paged_attention_decode_kernel,
    paged_attention_decode_triton,
)
from kernels.triton_rotary import _rotary_kernel, apply_rotary_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOKENS = [1, 7, 33]

# (atol, rtol) per dtype; attention has its own (softmax weights and 16-bit dots on the GPU).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}


def close(actual: torch.Tensor, expected: torch.Tensor, tol: dict = TOL) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    atol, rtol = tol[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def test_kernels_built_for_this_mode():
    """Interpreted on the CPU, compiled on CUDA: a kernel module imported before TRITON_INTERPRET
    was set (or with it set on a CUDA run) would silently test the wrong thing."""
    for kernel in (_rms_norm_kernel, _silu_and_mul_kernel, _rotary_kernel, _paged_attention_decode_kernel):
        assert isinstance(kernel, triton.runtime.JITFunction) != INTERPRET, kernel


# --- RMSNorm (+ residual) ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [96, 4096])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(dtype, tokens, hidden, with_residual):
    g = gen(tokens * 10_000 + hidden)
    x = randn(tokens, hidden, dtype=dtype, g=g)
    weight = (1.0 + 0.1 * randn(hidden, dtype=torch.float32, g=g)).to(dtype)
    residual = randn(tokens, hidden, dtype=dtype, g=g) if with_residual else None
    out, summed = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_summed = rms_norm_ref(x, weight, 1e-6, residual)
    close(out, ref_out)
    if with_residual:
        close(summed, ref_summed)
    else:
        assert summed is x


def test_rms_norm_float32_weight_on_16bit_input():
    """A float32 weight (an unconverted nn.Parameter) promotes the output as in the reference."""
    g = gen(1)
    x = randn(5, 96, dtype=torch.float16, g=g)
    residual = randn(5, 96, dtype=torch.float16, g=g)
    weight = randn(96, dtype=torch.float32, g=g)
    out, summed = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_summed = rms_norm_ref(x, weight, 1e-5, residual)
    assert out.dtype == torch.float32 and summed.dtype == torch.float16
    close(out, ref_out)
    close(summed, ref_summed)


# --- SiLU and mul -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("d", [48, 1376])  # 1376 > 1024: two column blocks, the second partial
def test_silu_and_mul(dtype, tokens, d):
    x = 3 * randn(tokens, 2 * d, dtype=dtype, g=gen(tokens + d))
    close(silu_and_mul_triton(x), silu_and_mul_ref(x))


def test_silu_and_mul_leading_dims():
    x = randn(2, 3, 2 * 40, dtype=torch.float32, g=gen(2))
    close(silu_and_mul_triton(x), silu_and_mul_ref(x))


# --- Rotary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 3, 96)])
def test_rotary(dtype, tokens, heads, kv_heads, head_dim):
    g = gen(tokens * 100 + heads)
    max_pos = 300
    cos_sin = rope_cos_sin(head_dim, max_pos, 10_000.0, device=DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(DEVICE)
    # Strided views, as the worker's model splits them out of a fused qkv projection.
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, g=g)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    before = qkv.clone()
    q_out, k_out = apply_rotary_triton(q, k, positions, cos_sin)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cos_sin)
    close(q_out, q_ref)
    close(k_out, k_ref)
    assert torch.equal(qkv, before), "inputs must not be modified"


def test_rotary_int32_positions():
    g = gen(3)
    cos_sin = rope_cos_sin(64, 50, 10_000.0, device=DEVICE)
    q = randn(5, 2, 64, dtype=torch.float32, g=g)
    k = randn(5, 1, 64, dtype=torch.float32, g=g)
    positions = torch.tensor([0, 4, 9, 49, 3], dtype=torch.int32, device=DEVICE)
    q_out, k_out = apply_rotary_triton(q, k, positions, cos_sin)
    q_ref, k_ref = apply_rotary_ref(q, k, positions.long(), cos_sin)
    close(q_out, q_ref)
    close(k_out, k_ref)


SCALINGS = {
    "linear": {"type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("rope_type", sorted(SCALINGS))
def test_rotary_scaled_tables(rope_type):
    """The tables of scaled RoPE (per-token rows for dynamic NTK) take the same kernel path."""
    from services.worker.engine.rope import RopeScaling, RotaryEmbedding

    max_pos = 128 if rope_type == "llama3" else 64  # linear and dynamic serve 2 x 64 positions
    config = {"max_position_embeddings": max_pos, "rope_theta": 500_000.0, "rope_scaling": SCALINGS[rope_type]}
    rotary = RotaryEmbedding(RopeScaling.from_hf_config(config), 128, DEVICE)
    g = gen(11)
    positions = torch.tensor([0, 5, 63, 64, 90, 127, 3], device=DEVICE)
    seq_lens = torch.tensor([100, 100, 100, 100, 91, 128, 40], device=DEVICE) if rope_type == "dynamic" else None
    rows, table = rotary.select(positions, seq_lens)
    q = randn(7, 4, 128, dtype=torch.float32, g=g)
    k = randn(7, 2, 128, dtype=torch.float32, g=g)
    q_out, k_out = apply_rotary_triton(q, k, rows, table)
    q_ref, k_ref = apply_rotary_ref(q, k, rows, table)
    close(q_out, q_ref)
    close(k_out, k_ref)


# --- Paged attention decode -----------------------------------------------------------------------


def make_paged(seed, dtype, context_lens, heads, kv_heads, head_dim, block_size):
    """A shuffled block pool with padding entries in each block table pointing at real blocks."""
    g = gen(seed)
    max_blocks = max(-(-c // block_size) for c in context_lens) + 1
    num_seqs = len(context_lens)
    num_blocks = num_seqs * max_blocks + 3
    q = randn(num_seqs, heads, head_dim, dtype=dtype, g=g)
    k_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, g=g)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, g=g)
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks]
    block_tables = perm.view(num_seqs, max_blocks).to(torch.int32).to(DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, block_tables, lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2, 4], ids=lambda r: f"gqa{r}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "context_lens,block_n",
    [([1, 17, 50], 16), ([5, 33, 64, 100, 7], 64)],
    ids=["3seqs-tile16", "5seqs-tile64"],
)
def test_paged_attention_decode(dtype, group, head_dim, context_lens, block_n):
    kv_heads = 2
    heads = kv_heads * group
    args = make_paged(group * 1000 + head_dim + len(context_lens), dtype, context_lens, heads, kv_heads, head_dim, 16)
    scale = head_dim**-0.5
    out = paged_attention_decode_triton(*args, scale, block_n=block_n)
    close(out, paged_attention_decode_ref(*args, scale), ATTN_TOL)


@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_attention_other_block_sizes(block_size):
    args = make_paged(block_size, torch.float32, [3, 40, 77], 4, 1, 64, block_size)
    out = paged_attention_decode_triton(*args, 0.125, block_n=16)
    close(out, paged_attention_decode_ref(*args, 0.125), ATTN_TOL)


def test_paged_attention_strided_query():
    """The worker passes q[d0:] of the batch's (rotated) queries: a view at an offset."""
    q_all, k_cache, v_cache, block_tables, lens = make_paged(9, torch.float16, [9, 30, 4, 16], 8, 2, 64, 16)
    q = q_all[1:]
    args = (q, k_cache, v_cache, block_tables[1:], lens[1:])
    close(paged_attention_decode_triton(*args, 0.125), paged_attention_decode_ref(*args, 0.125), ATTN_TOL)


# --- Dispatchers ----------------------------------------------------------------------------------


def test_dispatchers_use_reference_on_cpu(monkeypatch):
    """On CPU tensors the dispatchers never reach Triton, even with TRITON_INTERPRET=1."""
    import kernels.triton_activation as ta
    import kernels.triton_norm as tn
    import kernels.triton_paged_attention as tp
    import kernels.triton_rotary as tr

    def boom(*a, **k):
        raise AssertionError("Triton kernel called on CPU tensors")

    monkeypatch.setattr(tn, "rms_norm_triton", boom)
    monkeypatch.setattr(ta, "silu_and_mul_triton", boom)
    monkeypatch.setattr(tr, "apply_rotary_triton", boom)
    monkeypatch.setattr(tp, "paged_attention_decode_triton", boom)
    g = torch.Generator().manual_seed(4)
    x, r, w = (torch.randn(3, 32, generator=g) for _ in range(3))
    for a, b in zip(kernels.rms_norm(x, w[0], 1e-6, r), rms_norm_ref(x, w[0], 1e-6, r), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_ref(x))
    cos_sin = rope_cos_sin(16, 8, 10_000.0)
    q, k, pos = torch.randn(3, 2, 16, generator=g), torch.randn(3, 1, 16, generator=g), torch.tensor([0, 5, 7])
    for a, b in zip(kernels.apply_rotary(q, k, pos, cos_sin), apply_rotary_ref(q, k, pos, cos_sin), strict=True):
        assert torch.equal(a, b)
    kc, vc = torch.randn(4, 16, 1, 16, generator=g), torch.randn(4, 16, 1, 16, generator=g)
    bt, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([3, 20], dtype=torch.int32)
    q2 = torch.randn(2, 2, 16, generator=g)
    out = kernels.paged_attention_decode(q2, kc, vc, bt, lens, 0.25)
    assert torch.equal(out, paged_attention_decode_ref(q2, kc, vc, bt, lens, 0.25))


@pytest.mark.skipif(DEVICE != "cuda", reason="the dispatchers pick Triton only on CUDA tensors")
def test_dispatchers_use_triton_on_cuda(monkeypatch):
    import kernels.triton_norm as tn

    calls = []
    real = tn.rms_norm_triton
    monkeypatch.setattr(tn, "rms_norm_triton", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 64, device="cuda")
    w = torch.ones(64, device="cuda")
    close(kernels.rms_norm(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0])
    assert calls == [1]
