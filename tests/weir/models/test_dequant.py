"""Weir's dequantization against the gguf package's own (gguf.quants.dequantize): exactly equal,
on the real tensors of the SmolLM2 GGUF and on synthetic blocks of every other supported type."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference
from gguf.quants import quantize

from weir.models.dequant import GGML_TYPES, UnsupportedQuantization, dequantize, num_bytes
from weir.models.gguf_file import read_gguf

RNG = np.random.default_rng(15)


def test_every_q4_1_q8_0_and_f32_tensor_of_smollm2_dequantizes_as_gguf_does(smollm2_gguf) -> None:
    gguf = read_gguf(smollm2_gguf)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.17.ffn_gate.weight",
             "blk.29.ffn_down.weight", "blk.0.attn_norm.weight", "blk.29.ffn_norm.weight", "output_norm.weight"]
    seen = set()
    for name in names:
        tensor = gguf.tensors[name]
        want = reference(np.asarray(tensor.raw), Q(tensor.ggml_type)).reshape(tensor.shape)
        got = dequantize(tensor.raw, tensor.ggml_type, tensor.shape)
        assert got.dtype == np.float32 and got.shape == tensor.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        seen.add(Q(tensor.ggml_type).name)
    assert seen == {"Q8_0", "Q4_1", "F32"}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16])
def test_quantized_synthetic_rows_dequantize_as_gguf_does(qtype: Q) -> None:
    values = (RNG.standard_normal((6, 256)) * RNG.uniform(0.01, 3, (6, 1))).astype(np.float32)
    raw = quantize(values, qtype)
    got = dequantize(raw, int(qtype), (6, 256))
    np.testing.assert_array_equal(got, reference(raw, qtype))
    assert np.abs(got - values).max() < 0.5 * np.abs(values).max()  # and it is the values, roughly


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_blocks_dequantize_as_gguf_does(qtype: Q) -> None:
    # gguf cannot quantize to K types; random blocks with finite f16 scales cover every bit of the layout
    _, block, size = GGML_TYPES[int(qtype)]
    raw = RNG.integers(0, 256, (5, 3 * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    scales = RNG.uniform(-2, 2, (len(blocks), 2 if qtype != Q.Q6_K else 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[:, size - 2 :] = scales  # d is the last field of a Q6_K block
    else:
        blocks[:, :4] = scales  # d, dmin lead a Q4_K/Q5_K block
    got = dequantize(raw, int(qtype), (5, 3 * block))
    np.testing.assert_array_equal(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16])
def test_float_tensors_come_back_as_stored(qtype: Q) -> None:
    values = RNG.standard_normal((3, 40)).astype(np.float32)
    stored = values.astype(np.float32 if qtype == Q.F32 else np.float16)
    got = dequantize(stored.view(np.uint8), int(qtype), (3, 40))
    np.testing.assert_array_equal(got, stored.astype(np.float32))


def test_an_unsupported_type_and_a_short_tensor_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedQuantization, match=r"type 10 is not supported \(supported: F32, .*Q6_K\)"):
        dequantize(np.zeros(84, np.uint8), int(Q.Q2_K), (256,))
    with pytest.raises(ValueError, match=r"Q8_0 tensor of shape \(2, 32\) needs 68 bytes, got 34"):
        dequantize(np.zeros(34, np.uint8), int(Q.Q8_0), (2, 32))
    with pytest.raises(ValueError, match="not a whole number of 32-value blocks"):
        num_bytes(int(Q.Q4_0), 48)
