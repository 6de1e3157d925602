r"""Weights that stay where they are while the passes rewrite the graphs.

Every weight constant in the compiler's graphs holds a SourceWeight, not an array: the checkpoint
tensors it stands for (one, or several stacked along rows by fuse_projections) and the dtype the
graph sees. Passes read its shape and dtype, merge it, stack it, change its storage dtype; none of
that reads a byte. The artifact writer alone streams the bytes into weights.bin, a row block at a
time, converting to the storage dtype on the way. So a build of a multi-GB checkpoint never holds the
model in memory, and no pass can copy a weight by accident.

    checkpoint files                 graphs (decode, step, prefill, ...)            artifact
    model-00001.safetensors  <----   Constant "model.blocks.3.mlp.up.weight"   ---> weights.bin
      [bytes of the tensor]          SourceWeight(parts=(src,), dtype=float32)      (written once,
                                     Constant "q+k+v"                                 as bf16/fp16/fp32)
                                     SourceWeight(parts=(q, k, v), dtype=bf16)

A SourceWeight is an onnx-graphsurgeon LazyValues, so graphsurgeon carries it through copy, cleanup
and export without loading it. Exporting a graph that still holds one (a --dump-after dump, a test
running an intermediate graph) inlines its values: `.tensor` reads them then.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from speedc.errors import CheckpointError
from speedc.format.graph_values import non_finite_count
from speedc.models.checkpoint.tensor_source import TensorSource

class SourceWeight(LazyValues):
    """PARTS (checkpoint tensors, stacked along axis 0) seen by the graph as DTYPE."""

    def __init__(self, parts: tuple[TensorSource, ...], dtype) -> None:  # no super().__init__: no proto to parse
        first = parts[0]
        if any(p.shape[1:] != first.shape[1:] for p in parts):
            raise ValueError("stacked parts must agree in every dimension but the first")
        self.parts = tuple(parts)
        self.dtype = np.dtype(dtype)
        self.shape = (sum(p.shape[0] for p in parts), *first.shape[1:]) if len(parts) > 1 else tuple(first.shape)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, source: TensorSource, dtype=np.float32) -> "SourceWeight":
        return cls((source,), dtype)

    def with_dtype(self, dtype) -> "SourceWeight":
        return SourceWeight(self.parts, dtype)

    def identity(self) -> tuple:
        """Equal identities mean equal values (same bytes read the same way)."""
        return tuple(id(p) for p in self.parts), self.dtype.str

    def load(self) -> np.ndarray:
        return np.concatenate(list(self.chunks()), axis=0).reshape(self.shape)

    def chunks(self):
        """The values in row blocks, converted to DTYPE: what the writer streams into weights.bin.
        CheckpointError where a value is nan or inf, in the checkpoint or once converted (a float32
        value beyond float16's range): such a model generates garbage, or one id forever."""
        for index, part in enumerate(self.parts):
            for first, rows in part.row_blocks():
                stored = part.read(first, rows)
                with np.errstate(over="ignore"):  # overflow is reported below, as an error
                    chunk = np.ascontiguousarray(stored, dtype=self.dtype)
                if non_finite_count(chunk):
                    raise CheckpointError(self._non_finite_message(index))
                yield chunk

    def _non_finite_message(self, index: int) -> str:
        """What is wrong with part INDEX, counted over the whole part (only on the way to an error)."""
        part = self.parts[index]
        in_checkpoint = converted = 0
        largest = 0.0
        for first, rows in part.row_blocks():
            stored = part.read(first, rows)
            in_checkpoint += non_finite_count(stored)
            with np.errstate(over="ignore"):
                converted += non_finite_count(np.asarray(stored, dtype=self.dtype))
            finite = stored.astype(np.float32)
            finite = finite[np.isfinite(finite)]
            largest = max(largest, float(np.max(np.abs(finite), initial=0.0)))
        where = f" (part {index + 1} of {len(self.parts)} stacked)" if len(self.parts) > 1 else ""
        if in_checkpoint:
            return f"{in_checkpoint} nan/inf values in the checkpoint{where} (a diverged or damaged training run?)"
        instead = "--weights bf16 or fp32" if self.dtype.name == "float16" else "--weights fp32"
        return (f"{converted} values beyond {self.dtype.name}'s range once converted{where} (largest magnitude "
                f"{largest:.4g}); build with {instead}")

    @property
    def tensor(self):
        """graphsurgeon's exporter reads this: the values inline (dumps and tests of small graphs)."""
        return numpy_helper.from_array(self.load())

    def __str__(self) -> str:
        return f"SourceWeight(shape={self.shape}, dtype={self.dtype}, parts={len(self.parts)})"


class SameBytes(LazyValues):
    """The values of the stored weight VIEW_OF under another name: the writer references its bytes in
    weights.bin instead of writing them again (see passes/untie_head.py)."""

    def __init__(self, constant: gs.Constant) -> None:  # no super().__init__: nothing to parse
        self.of, self.view_of = constant._values, constant.name
        self.shape, self.dtype = tuple(constant.shape), np.dtype(constant.dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def identity(self) -> tuple:
        return "same bytes as", self.view_of

    def load(self) -> np.ndarray:
        return self.of.load() if hasattr(self.of, "load") else np.asarray(self.of)

    def chunks(self):
        return self.of.chunks() if hasattr(self.of, "chunks") else iter([np.ascontiguousarray(self.of)])

    @property
    def tensor(self):
        return numpy_helper.from_array(self.load())


def source_weight(constant: gs.Constant) -> SourceWeight | None:
    values = constant._values  # graphsurgeon's own storage; .values would load it
    return values if isinstance(values, SourceWeight) else None


def weight_constant(name: str, source: TensorSource) -> gs.Constant:
    """A graph constant NAME standing for a checkpoint tensor, computed in float32."""
    return gs.Constant(name, SourceWeight.of(source))
