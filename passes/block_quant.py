r"""Block quantization of weights, in ONNX Runtime's MatMulNBits layout, computed while the writer streams.

A weight W [N, K] (a Gemm's B read transposed: one row per output feature) is cut along K into blocks
of BLOCK_SIZE values; each block gets one float scale and BITS-bit codes (symmetric: no zero-point
tensor, so the operators' default zero point 2^(bits-1) applies):

    scale = m / -2^(bits-1)        m: the block's value of largest magnitude (it maps to code 0 exactly)
    code  = clip(round(w / scale) + 2^(bits-1), 0, 2^bits - 1)       w ~= (code - 2^(bits-1)) * scale

    W [N, K] fp32  ->  B      [N, n_blocks, block_size * bits / 8] uint8   (4 bits: two codes a byte,
                                                                        the lower K index in the low nibble)
                       scales [N, n_blocks] float32                     (K padded with zeros to n_blocks blocks)

This is what ONNX Runtime's own quantizer (quantize_matmul_4bits / _8bits, symmetric) writes, byte for
byte (tests/numeric/test_quantize_weights.py checks it). The same B and scales feed com.microsoft MatMulNBits
(y = x @ dequant(B)^T) and, with scales seen as [N, n_blocks, 1], GatherBlockQuantized (rows of
dequant(B) as [n_blocks, block_size]): a tied embedding / LM head is stored once.

Nothing is quantized when the pass runs: QuantizedWeight wraps the SourceWeight (where the checkpoint
keeps the bytes) and the writer asks it for row blocks, so a multi-GB checkpoint still streams. The
scales of the row blocks just packed are kept until the scales tensor is written (it is written right
after its codes), else recomputed from the checkpoint.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

BITS = {"int8": 8, "int4": 4}
BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits: a power of two, at least 16
DEFAULT_BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # MatMulNBits on CPU: activations quantized to int8 per block, int8 dot products


def quantize_rows(rows: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """rows [r, K] float -> (B [r, n_blocks, block_size * bits // 8] uint8, scales [r, n_blocks] float32)."""
    r, k = rows.shape
    n_blocks = -(-k // block_size)
    blocks = np.zeros((r, n_blocks * block_size), np.float32)
    blocks[:, :k] = rows
    blocks = blocks.reshape(r, n_blocks, block_size)  # [r, nb, bs]
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]  # [r, nb], signed
    half = 1 << (bits - 1)
    scales = (largest / -half).astype(np.float32)  # [r, nb]
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)
    codes = np.clip(np.rint(blocks * inverse[..., None]) + half, 0, (1 << bits) - 1).astype(np.uint8)  # [r, nb, bs]
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [r, nb, bs/2]: even K index in the low nibble
    return np.ascontiguousarray(codes), scales


class _RowQuantizer:
    """One weight's quantization, shared by its codes and scales tensors (and every graph using them)."""

    def __init__(self, source, bits: int, block_size: int) -> None:
        self.source, self.bits, self.block_size = source, bits, block_size  # source: SourceWeight [N, K] or array
        self.rows, self.k = int(source.shape[0]), int(source.shape[1])
        self.n_blocks = -(-self.k // block_size)
        self._kept_scales: list[np.ndarray] | None = None

    def _row_blocks(self):
        if hasattr(self.source, "chunks"):
            yield from self.source.chunks()  # [r, K] row blocks as the checkpoint stores them, as float32
        else:
            yield np.asarray(self.source, np.float32)

    def codes(self):
        kept = []
        for rows in self._row_blocks():
            packed, scales = quantize_rows(np.asarray(rows, np.float32), self.bits, self.block_size)
            kept.append(scales)
            yield packed
        self._kept_scales = kept

    def scales(self):
        kept, self._kept_scales = self._kept_scales, None
        if kept is None:  # the codes were not streamed just before: quantize again (reads the rows again)
            kept = [quantize_rows(np.asarray(rows, np.float32), self.bits, self.block_size)[1] for rows in self._row_blocks()]
        yield from kept

    def identity(self) -> tuple:
        source = self.source.identity() if hasattr(self.source, "identity") else id(self.source)
        return source, self.bits, self.block_size


class QuantizedWeight(LazyValues):
    """A graph constant's values: the codes (ROLE "codes") or scales (ROLE "scales") of a block-quantized
    weight, in SHAPE. VIEW_OF names a stored tensor with the same bytes (the writer references those
    instead of writing them twice: the [N, n_blocks, 1] scales GatherBlockQuantized reads)."""

    def __init__(self, quantizer: _RowQuantizer, role: str, shape: tuple[int, ...], of: str,
                 view_of: str | None = None) -> None:  # no super().__init__: nothing to parse
        self.quantizer, self.role, self.shape, self.of, self.view_of = quantizer, role, tuple(shape), of, view_of
        self.dtype = np.dtype(np.uint8 if role == "codes" else np.float32)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def chunks(self):
        """What the writer streams into weights.bin, a row block at a time."""
        stream = self.quantizer.codes() if self.role == "codes" else self.quantizer.scales()
        for chunk in stream:
            yield chunk.reshape(chunk.shape[0], *self.shape[1:])

    def identity(self) -> tuple:
        return self.quantizer.identity(), self.role, self.shape

    def index_info(self) -> dict:
        """What the weight index records beside the byte range."""
        q = self.quantizer
        return {"of": self.of, "role": self.role, "bits": q.bits, "block_size": q.block_size,
                "shape": [q.rows, q.k], "zero_point": 1 << (q.bits - 1)}

    def load(self) -> np.ndarray:
        return np.concatenate(list(self.chunks()), axis=0)

    @property
    def tensor(self):
        """graphsurgeon's exporter reads this: the values inline (dumps and tests of small graphs)."""
        return numpy_helper.from_array(self.load())

    def __str__(self) -> str:
        return f"QuantizedWeight({self.of} {self.role}, shape={self.shape}, bits={self.quantizer.bits})"


def quantized_pair(source, name: str, bits: int, block_size: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    """(codes [N, n_blocks, blob], scales [N, n_blocks]) of weight NAME (SOURCE: SourceWeight or array [N, K])."""
    q = _RowQuantizer(source, bits, block_size)
    blob = block_size * bits // 8
    return (QuantizedWeight(q, "codes", (q.rows, q.n_blocks, blob), name),
            QuantizedWeight(q, "scales", (q.rows, q.n_blocks), name))


def scales_as_rows(scales: QuantizedWeight, stored_name: str) -> QuantizedWeight:
    """The same scales as [N, n_blocks, 1] (GatherBlockQuantized wants the data's rank): a view of STORED_NAME."""
    return QuantizedWeight(scales.quantizer, "scales", (*scales.shape, 1), scales.of, view_of=stored_name)


def quantized_bytes_per_element(bits: int, block_size: int) -> float:
    """Artifact bytes per weight element: the codes plus one float32 scale per block."""
    return bits / 8 + 4 / block_size
