"""Graph constants as the artifact writer sees them: the format's side of the values a graph's weights hold.

    non_finite_count(array)      nan / inf values of a float array (16-bit formats read by their bits)
    constant_nbytes(constant)    a graph constant's bytes, without loading its values
    WrittenWeight(proto, ...)    a weight streamed into weights.bin: its external-data reference

The compiler's lazy values (passes/source_weights.py: checkpoint tensors not yet read) build on these;
the writer (format/artifact.py write_graphs) needs only these, so the format never imports the compiler.
Imports onnx-graphsurgeon: only writing graphs imports this module.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

# Exponent bits of the 16-bit float formats: all ones is inf or nan.
EXPONENT_MASK = {"float16": 0x7C00, "bfloat16": 0x7F80}


def non_finite_count(chunk: np.ndarray) -> int:
    """How many values of a float array are nan or inf (16-bit formats by their bits: ml_dtypes' isfinite
    on bfloat16 is ~20x slower than this)."""
    mask = EXPONENT_MASK.get(chunk.dtype.name)
    if mask is not None:
        return int(np.count_nonzero((chunk.view(np.uint16) & mask) == mask))
    return int(chunk.size - np.count_nonzero(np.isfinite(chunk)))


def constant_nbytes(constant: gs.Constant) -> int:
    """Bytes of a constant's values, without loading them."""
    return math.prod(constant.shape) * np.dtype(constant.dtype).itemsize


class WrittenWeight(LazyValues):
    """A weight the artifact writer has streamed into weights.bin: PROTO is its external-data reference
    (location, offset, length), which graphsurgeon's exporter puts in the graph as it is."""

    def __init__(self, proto, shape, dtype) -> None:  # no super().__init__: it cannot name bfloat16
        self.tensor = proto
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        raise RuntimeError("internal: a written weight's values are in weights.bin, not in the graph")
