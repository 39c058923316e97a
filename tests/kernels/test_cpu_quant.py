"""The CPU quantized linears (kernels/cpu_quant.py, cpu_quant.cpp) against their references.

The AVX2 kernels quantize the activations per row and 32-value block to int8 before the integer
dot products (as llama.cpp): the oracle does the same in PyTorch (quantize_activations_ref), so
kernel and oracle may differ only by float summation order (relative 1e-5 of the output's scale).
The layouts must also slice by output rows and by input columns at multiples of 32 (tensor
parallelism, issue 34), and requantizing values that already lie on a Q8_0 / Q4_1 grid (a GGUF
import's) must give those blocks back exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_quant as cq
from weir.models.dequant import dequantize

SHAPES = [(1, 576, 960), (1, 64, 37), (3, 576, 130), (5, 1536, 64), (32, 576, 258), (33, 96, 7)]


def quantize_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """x with each row's 32-value blocks rounded to int8 steps of max|block| / 127, as the kernels do."""
    b, k = x.shape
    blocks = x.reshape(b, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(b, k)


def kernels_or_skip() -> None:
    if not cq.extension_available():
        pytest.skip(f"AVX2 kernels not built here: {cq.extension_error()}")


@pytest.mark.parametrize("b,k,n", SHAPES)
def test_int8_kernel_matches_the_reference(b, k, n) -> None:
    kernels_or_skip()
    gen = torch.Generator().manual_seed(b * 1000 + n)
    x, w, bias = (
        torch.randn(b, k, generator=gen),
        torch.randn(n, k, generator=gen) * 0.05,
        torch.randn(n, generator=gen),
    )
    q, d = cq.quantize_int8(w)
    out = torch.ops.weir_quant.q8_linear(x, q, d, bias)
    expected = F.linear(quantize_activations_ref(x).double(), cq.dequantize_int8(q, d).double(), bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("b,k,n", SHAPES)
def test_int4_kernel_matches_the_reference(b, k, n) -> None:
    kernels_or_skip()
    gen = torch.Generator().manual_seed(b * 1000 + n + 7)
    x, w = torch.randn(b, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    q, d, m = cq.quantize_int4(w)
    out = torch.ops.weir_quant.q4_linear(x, q, d, m, None)
    expected = F.linear(quantize_activations_ref(x).double(), cq.dequantize_int4(q, d, m).double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_kernels_are_close_to_float32_and_the_fallback_is_exact() -> None:
    x, w = torch.randn(4, 576), torch.randn(300, 576) * 0.05
    exact = F.linear(x, w)
    q, d = cq.quantize_int8(w)
    q4, d4, m4 = cq.quantize_int4(w)
    # the reference (no extension, CUDA) dequantizes: exact on the dequantized weights
    torch.testing.assert_close(cq.q8_linear_ref(x, q, d), F.linear(x, cq.dequantize_int8(q, d)))
    scale = exact.abs().max().item()
    assert (cq.q8_linear(x, q, d) - exact).abs().max().item() < 0.02 * scale
    assert (cq.q4_linear(x, q4, d4, m4) - exact).abs().max().item() < 0.1 * scale


def test_zero_blocks_and_zero_rows_give_zeros() -> None:
    kernels_or_skip()
    w = torch.zeros(8, 64)
    w[3, 40] = 1.0
    x = torch.zeros(2, 64)
    x[1, 40] = 2.0
    q, d = cq.quantize_int8(w)
    q4, d4, m4 = cq.quantize_int4(w)
    for out in (torch.ops.weir_quant.q8_linear(x, q, d, None), torch.ops.weir_quant.q4_linear(x, q4, d4, m4, None)):
        expected = torch.zeros(2, 8)
        expected[1, 3] = 2.0
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


def test_bad_shapes_are_refused_with_a_message() -> None:
    kernels_or_skip()
    q, d = cq.quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.weir_quant.q8_linear(torch.randn(2, 96), q, d, None)
    with pytest.raises(ValueError, match="multiple of 32"):
        cq.quantize_int8(torch.randn(8, 40))


def test_the_layouts_slice_by_output_rows_and_input_columns() -> None:
    """Issue 34 splits these: row and 32-aligned column slices of the buffers are the slices' weights."""
    w = torch.randn(96, 128) * 0.05
    q, d = cq.quantize_int8(w)
    q4, d4, m4 = cq.quantize_int4(w)
    full8, full4 = cq.dequantize_int8(q, d), cq.dequantize_int4(q4, d4, m4)
    torch.testing.assert_close(cq.dequantize_int8(q[32:64].contiguous(), d[32:64].contiguous()), full8[32:64])
    torch.testing.assert_close(cq.dequantize_int8(q[:, 64:].contiguous(), d[:, 2:].contiguous()), full8[:, 64:])
    torch.testing.assert_close(
        cq.dequantize_int4(q4[:, 32:].contiguous(), d4[:, 2:].contiguous(), m4[:, 2:].contiguous()), full4[:, 64:]
    )
    if cq.extension_available():  # two column halves add up to the whole (tensor-parallel row split of K)
        x = torch.randn(3, 128)
        halves = sum(
            torch.ops.weir_quant.q4_linear(
                x[:, i * 64 : (i + 1) * 64].contiguous(),
                q4[:, i * 32 : (i + 1) * 32].contiguous(),
                d4[:, i * 2 : (i + 1) * 2].contiguous(),
                m4[:, i * 2 : (i + 1) * 2].contiguous(),
                None,
            )
            for i in range(2)
        )
        torch.testing.assert_close(halves, torch.ops.weir_quant.q4_linear(x, q4, d4, m4, None), rtol=1e-5, atol=1e-5)


def _random_blocks(ggml_type: int, size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(0.001, 0.05, size=count).astype(np.float16).view(np.uint8).reshape(count, 2)  # d
    if ggml_type == 3:
        raw[:, 2:4] = (-rng.uniform(0.01, 0.5, size=count)).astype(np.float16).view(np.uint8).reshape(count, 2)  # m
        raw[:, 4] = 0x0F | (0xF0 & raw[:, 4])  # q = 15 and 0 present: ggml's Q4_1 quantizer puts min and max there
        raw[:, 5] = 0xF0 | (0x00 & raw[:, 5])
    return raw


def test_requantizing_gguf_values_gives_their_blocks_back() -> None:
    """A GGUF import's float32 values of Q8_0 / Q4_1 blocks come back exactly (the loader quantizes them)."""
    rng = np.random.default_rng(0)
    q8 = _random_blocks(8, 34, 64 * 6, rng)
    q8[:, 2:][q8[:, 2:] == 0x80] = 0x81  # ggml's Q8_0 has no -128: q = round(x / (max|x| / 127))
    q8[:, 2] = 127  # and max|x| at +-127
    values = torch.from_numpy(dequantize(q8, 8, (64, 192)))
    q, d = cq.quantize_int8(values)
    assert torch.equal(cq.dequantize_int8(q, d), values)
    q41 = _random_blocks(3, 20, 64 * 6, rng)
    values = torch.from_numpy(dequantize(q41, 3, (64, 192)))
    q4, d4, m4 = cq.quantize_int4(values)
    assert torch.equal(cq.dequantize_int4(q4, d4, m4), values)
