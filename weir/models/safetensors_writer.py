"""A safetensors file written one tensor at a time, so an import holds one tensor in memory.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}} padded with spaces to a multiple of 8,
then the tensors' bytes back to back in header order. Shapes and dtypes are known before any
tensor is computed, so the header is written first and each tensor appended as it is made.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

# dtype name -> (safetensors dtype, bytes per value)
DTYPES: dict[str, tuple[str, int]] = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


def to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in `dtype` (bfloat16 as uint16 bit patterns, rounded to nearest even)."""
    if dtype == "float32":
        return values.astype(np.float32, copy=False)
    if dtype == "float16":
        return values.astype(np.float16)
    bits = values.astype(np.float32, copy=False).view(np.uint32)
    rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


class SafetensorsWriter:
    """Writes the tensors a plan names, in order: open with the plan, then `write` each one."""

    def __init__(self, path: Path, plan: list[tuple[str, tuple[int, ...]]], dtype: str) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"{dtype=} is not one of {sorted(DTYPES)}")
        code, itemsize = DTYPES[dtype]
        self.dtype = dtype
        self._expected: list[tuple[str, tuple[int, ...]]] = list(plan)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in plan:
            size = int(np.prod(shape)) * itemsize
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._file: BinaryIO = path.open("wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, values: np.ndarray) -> None:
        """Append the next tensor of the plan; ValueError when it is not the one the plan expects."""
        if not self._expected:
            raise ValueError(f"tensor {name!r} is not in the plan")
        want_name, want_shape = self._expected.pop(0)
        if (name, tuple(values.shape)) != (want_name, want_shape):
            raise ValueError(f"expected tensor {want_name!r} {want_shape}, got {name!r} {tuple(values.shape)}")
        self._file.write(np.ascontiguousarray(to_dtype(values, self.dtype)).tobytes())

    def close(self) -> None:
        """Close the file; ValueError when tensors of the plan were not written."""
        self._file.close()
        if self._expected:
            raise ValueError(f"{len(self._expected)} tensors of the plan were not written, first {self._expected[0][0]!r}")
