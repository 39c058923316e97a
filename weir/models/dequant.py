"""Dequantization of GGML tensor data to float32, in numpy: Weir's own reading of ggml's formats.

Each quantized type stores a row as blocks of `block_size` values in `type_size` bytes; the
layouts below are ggml's (ggml-common.h), little-endian, f16 scales:

    type   values  bytes  block layout                                      value
    Q8_0     32     34    d f16, q int8[32]                                 d * q
    Q4_0     32     18    d f16, q 4-bit[32]                                d * (q - 8)
    Q4_1     32     20    d f16, m f16, q 4-bit[32]                         d * q + m
    Q5_0     32     22    d f16, qh u32, q 4-bit[32] (+ bit 4 from qh)      d * (q - 16)
    Q5_1     32     24    d f16, m f16, qh u32, q 4-bit[32]                 d * q + m
    Q4_K    256    144    d, dmin f16, 8 x (6-bit scale, 6-bit min), q 4-bit   d*sc * q - dmin*mn
    Q5_K    256    176    as Q4_K, plus qh[32]: bit 4 of each value            d*sc * q - dmin*mn
    Q6_K    256    210    ql 4-bit[256], qh 2-bit[256], scales int8[16], d   d * sc * (q - 32)

The 4-bit types put value j of a 32-value group in the low nibble of byte j and value j + 16 (or
j + 32 in the K types' 64-value chunks) in the high nibble. `gguf.quants.dequantize` is the test
oracle (tests/weir/models/test_dequant.py); this module does not call it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# ggml type id -> (name, values per block, bytes per block); ids are ggml's GGMLQuantizationType.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}


class UnsupportedQuantization(ValueError):
    """A tensor type this module cannot dequantize; the message names it and the supported ones."""


def type_name(ggml_type: int) -> str:
    """ggml's name of a type id (e.g. 3 -> "Q4_1"), or "type <id>" for one this module lacks."""
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type {ggml_type}"


def num_bytes(ggml_type: int, num_values: int) -> int:
    """Bytes that `num_values` values of `ggml_type` take; raises for an unsupported type or a
    count that is not a whole number of blocks."""
    name, block, size = _layout(ggml_type)
    if num_values % block:
        raise ValueError(f"{num_values} values of {name} are not a whole number of {block}-value blocks")
    return num_values // block * size


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of `shape` (numpy order: rows last-dim contiguous) from the tensor's raw bytes."""
    name, block, size = _layout(ggml_type)
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    count = int(np.prod(shape))
    if data.size != num_bytes(ggml_type, count):
        raise ValueError(f"{name} tensor of shape {shape} needs {num_bytes(ggml_type, count)} bytes, got {data.size}")
    if block == 1:
        return _FLOATS[name](data).reshape(shape)
    blocks = data.reshape(-1, size)
    return _BLOCKS[name](blocks).reshape(shape)


def _layout(ggml_type: int) -> tuple[str, int, int]:
    if ggml_type not in GGML_TYPES:
        known = ", ".join(name for name, _, _ in GGML_TYPES.values())
        raise UnsupportedQuantization(f"tensor type {ggml_type} is not supported (supported: {known})")
    return GGML_TYPES[ggml_type]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, n] bytes -> [blocks, 2n] values: the n low nibbles, then the n high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bf16(data: np.ndarray) -> np.ndarray:
    # bf16 is the top half of a float32
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b, 0)


def _q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(b, 0) * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian u32 -> [blocks, 32] values of 0 or 16 (bit j -> value j)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits << np.uint8(4)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])).astype(np.int8) - np.int8(16)
    return _f16(b, 0) * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a K-quant super-block ([blocks, 12] bytes -> two [blocks, 8]).

    Sub-blocks 0-3 keep their scale and min in the low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7
    in the nibbles of bytes 8-11, with their top 2 bits in the top bits of bytes 0-3 and 4-7.
    """
    lo_sc, lo_mn, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    hi_sc = (packed & 0x0F) | ((lo_sc >> 6) << 4)
    hi_mn = (packed >> 4) | ((lo_mn >> 6) << 4)
    return np.concatenate([lo_sc & 63, hi_sc], axis=-1), np.concatenate([lo_mn & 63, hi_mn], axis=-1)


def _k_apply(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """d * scale * q - dmin * min over 8 sub-blocks of 32; q: [blocks, 8, 32]."""
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.astype(np.float32))[:, :, None]
    dm = (_f16(b, 2) * mn.astype(np.float32))[:, :, None]
    return (d * q.astype(np.float32) - dm).reshape(len(b), 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    # 4 chunks of 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j + 1
    chunks = b[:, 16:144].reshape(len(b), 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(len(b), 8, 32)
    return _k_apply(b, q)


def _q5_k(b: np.ndarray) -> np.ndarray:
    chunks = b[:, 48:176].reshape(len(b), 4, 32)
    low = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(len(b), 8, 32)
    qh = b[:, 16:48]  # bit i of byte l is bit 4 of value l of sub-block i
    high = np.stack([(qh >> i) & 1 for i in range(8)], axis=1)  # [blocks, 8, 32]
    return _k_apply(b, low | (high << 4))


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(n, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 16, 1)
    parts = [ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4]
    q = np.stack([p | (((qh >> (2 * k)) & 3) << 4) for k, p in enumerate(parts)], axis=2)  # [n, 2, 4, 32]
    q = (q.astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    return ((_f16(b, 208)[:, :, None] * scales) * q).reshape(n, 256)


_FLOATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": lambda d: d.view(np.float32).copy(),
    "F16": lambda d: d.view(np.float16).astype(np.float32),
    "BF16": _bf16,
}
_BLOCKS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
