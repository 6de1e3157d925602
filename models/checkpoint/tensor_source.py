"""Where a checkpoint tensor's bytes are, without reading them.

A multi-GB checkpoint is never loaded whole: the build reads each safetensors header (a JSON table of
name -> dtype, shape, byte range) and hands the compiler a TensorSource per tensor, a byte range of a
file. Bytes are read on demand, a row block at a time, when the artifact writer copies them (or when a
small model is materialised for tests and training).

    model.safetensors:  [8-byte header length][JSON header][tensor bytes ...]
                                                           ^ offset of a tensor = 8 + header length + data_offsets[0]

A TensorSource can also hold an array in memory (pickled checkpoints, models built in tests); every
consumer treats the two alike. numpy only (bfloat16 through ml_dtypes, imported when needed).
"""

from __future__ import annotations

import hashlib
import os
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from speedc.errors import CheckpointError
from speedc.models.checkpoint.files import read_safetensors_header

# safetensors dtype code -> numpy dtype name (bfloat16 is registered by ml_dtypes)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
READ_CHUNK_BYTES = 16 << 20  # row blocks of about this size are read, converted and written at a time


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True, eq=False)
class TensorSource:
    """One tensor: a byte range of FILE (row-major, little-endian), or an in-memory ARRAY."""
    dtype: str  # numpy dtype name: float32, float16, bfloat16, ...
    shape: tuple[int, ...]
    file: Path | None = None
    offset: int = 0
    length: int = 0
    array: np.ndarray | None = field(default=None, repr=False)
    # Stored row i of this tensor is row row_order[i] of the byte range (a permutation read on demand: a
    # family's layout change, e.g. Huginn's q/k rows from adjacent rotary pairs to half-split ones).
    row_order: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def from_array(cls, array: np.ndarray) -> "TensorSource":
        array = np.ascontiguousarray(array)
        return cls(array.dtype.name, tuple(array.shape), array=array, length=array.nbytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        return numpy_dtype(self.dtype).itemsize * math.prod(self.shape[1:])

    def read(self, first_row: int = 0, rows: int | None = None) -> np.ndarray:
        """Rows [first_row, first_row + rows) as an array in the stored dtype (a fresh copy for files)."""
        rows = (self.shape[0] if self.shape else 1) - first_row if rows is None else rows
        if self.row_order is not None:  # the span of the wanted rows, then picked (a permutation stays local)
            wanted = self.row_order[first_row:first_row + rows]
            low = int(wanted.min()) if rows else 0
            span = replace(self, row_order=None).read(low, int(wanted.max()) + 1 - low if rows else 0)
            return span[wanted - low]
        if self.array is not None:
            return self.array[first_row:first_row + rows] if self.shape else self.array
        dtype = numpy_dtype(self.dtype)
        shape = (rows, *self.shape[1:]) if self.shape else ()
        data = bytearray(math.prod(shape) * dtype.itemsize)
        with open(self.file, "rb") as handle:
            handle.seek(self.offset + first_row * self.row_bytes)
            if handle.readinto(data) != len(data):
                raise CheckpointError(f"{self.file}: truncated (a tensor's bytes end past the file)")
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def rows(self, first: int, count: int) -> "TensorSource":
        """Rows [first, first + count) as a tensor of their own (no bytes read: a narrower byte range)."""
        if self.row_order is not None or not 0 <= first <= first + count <= self.shape[0]:
            raise CheckpointError(f"internal: rows {first}..{first + count} of a {list(self.shape)} tensor")
        shape = (count, *self.shape[1:])
        if self.array is not None:
            return TensorSource.from_array(self.array[first:first + count])
        return TensorSource(self.dtype, shape, file=self.file, offset=self.offset + first * self.row_bytes,
                            length=count * self.row_bytes)

    def reshaped(self, shape: tuple[int, ...]) -> "TensorSource":
        """The same bytes as SHAPE (row-major: same element count)."""
        if math.prod(shape) != self.numel or self.row_order is not None:
            raise CheckpointError(f"internal: a {list(self.shape)} tensor read as {list(shape)}")
        if self.array is not None:
            return TensorSource.from_array(self.array.reshape(shape))
        return replace(self, shape=tuple(shape))

    def reordered(self, order: np.ndarray) -> "TensorSource":
        """Row i of the result is row ORDER[i] of this tensor (read on demand)."""
        order = np.asarray(order, dtype=np.int64)
        if self.row_order is not None or sorted(order.tolist()) != list(range(self.shape[0])):
            raise CheckpointError(f"internal: a row order that is not a permutation of {self.shape[0]} rows")
        if self.array is not None:
            return TensorSource.from_array(self.array[order])
        return replace(self, row_order=order)

    def row_blocks(self, chunk_bytes: int = READ_CHUNK_BYTES):
        """(first row, rows) blocks of about CHUNK_BYTES covering the tensor (one block for a scalar)."""
        if not self.shape:
            yield 0, None
            return
        step = max(1, chunk_bytes // max(1, self.row_bytes))
        for first in range(0, self.shape[0], step):
            yield first, min(step, self.shape[0] - first)

    def digest(self) -> str:
        """sha256 of dtype, shape and bytes (streamed): equal digests mean equal tensors. A file's byte range is
        hashed once per process (the build's analysis before the trace and the share pass both ask)."""
        key = None
        if self.file is not None and self.row_order is None:  # the file as it is now: a rewritten one hashes anew
            stat = os.stat(self.file)
            key = (str(self.file), stat.st_ino, stat.st_size, stat.st_mtime_ns, self.offset, self.dtype, tuple(self.shape))
        if key is not None and key in _DIGESTS:
            return _DIGESTS[key]
        sha = hashlib.sha256(f"{self.dtype}{list(self.shape)}".encode())
        for first, rows in self.row_blocks():
            sha.update(np.ascontiguousarray(self.read(first, rows)).tobytes())
        if key is not None:
            _DIGESTS[key] = sha.hexdigest()
        return sha.hexdigest()


_DIGESTS: dict[tuple, str] = {}  # (file and its stat, offset, dtype, shape) -> TensorSource.digest of those bytes


def safetensors_sources(path: Path) -> dict[str, TensorSource]:
    """Every tensor of one safetensors file, from its header alone (checked against the file's size)."""
    try:
        size = path.stat().st_size
        data_start, header = read_safetensors_header(path)
        sources = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{name}: unsupported dtype {entry['dtype']}")
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
            length = math.prod(shape) * np.dtype("uint16" if dtype == "bfloat16" else dtype).itemsize
            offset = data_start + start
            if end - start != length or start < 0 or offset + length > size:
                raise ValueError(f"{name}: byte range {start}..{end} does not hold {entry['dtype']} {list(shape)}")
            sources[name] = TensorSource(dtype, shape, file=path, offset=offset, length=length)
        return sources
    except (OSError, ValueError, KeyError, TypeError) as bad:
        raise CheckpointError(f"{path}: unreadable safetensors file ({bad})") from None


def same_values(a: TensorSource, b: TensorSource) -> bool:
    """Exact comparison, a row block at a time (none when both name the same bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a is b or (a.file is not None and a.file == b.file and a.offset == b.offset
                  and a.row_order is None and b.row_order is None):
        return True
    return all(np.ascontiguousarray(a.read(first, rows)).tobytes() == np.ascontiguousarray(b.read(first, rows)).tobytes()
               for first, rows in a.row_blocks())
