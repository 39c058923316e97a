"""Reading a GGUF file (llama.cpp's format) with the `gguf` package, refusing a bad one clearly.

    gguf = read_gguf(path)          # GGUFError naming the file and the problem, or:
    gguf.meta["llama.block_count"]  # metadata as Python values (str, int, float, bool, list)
    gguf.tensors["blk.0.attn_q.weight"].raw  # the tensor's bytes (a view of the memory-mapped file)

A file whose magic is wrong, whose header stops early, or whose tensor data runs past its end is
refused before any tensor is read, with the byte offsets that show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be imported; the message names the file and the problem."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, still in its stored type."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: GGUF's dims reversed (rows, columns)
    raw: np.ndarray  # its bytes as the reader maps them


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensors."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when the file does not have it."""
        return self.meta.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value the import cannot do without; GGUFError naming the key otherwise."""
        if key not in self.meta:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.meta[key]


class _ShortRead(Exception):
    def __init__(self, what: str, end: int) -> None:
        super().__init__(what)
        self.what, self.end = what, end


class _CheckedReader(GGUFReader):
    """GGUFReader that reports a read past the end of the file instead of a numpy shape error.

    A third slower than GGUFReader, so it only reads a file GGUFReader refused, to say why.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
        if end > len(self.data):
            raise _ShortRead("the header", end)
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * size // block
            if end > len(self.data):
                raise _ShortRead(f"the data of tensor {bytes(name).decode(errors='replace')!r}", end)
        super()._build_tensors(start_offs, fields)


def read_gguf(path: str | Path) -> GGUFFile:
    """Open and check a GGUF file (memory-mapped: tensor bytes are read when used)."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
        size = path.stat().st_size
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path)
    except _READ_ERRORS as exc:
        raise _diagnose(path, size, exc) from exc
    meta = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {
        t.name: GGUFTensor(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
        for t in reader.tensors
    }
    return GGUFFile(path, meta, tensors)


_READ_ERRORS = (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError)


def _diagnose(path: Path, size: int, exc: Exception) -> GGUFError:
    """The GGUFError for a file GGUFReader refused: where it is cut short, else what the reader said."""
    try:
        _CheckedReader(path)
    except _ShortRead as short:
        return GGUFError(f"{path}: truncated: {short.what} ends at byte {short.end}, the file has {size} bytes")
    except _READ_ERRORS:
        pass
    return GGUFError(f"{path}: corrupt GGUF file ({exc})")


def _value(field: Any) -> Any:
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value
