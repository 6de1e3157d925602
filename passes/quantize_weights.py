r"""Pass `quantize_weights` (phase finalize): --weights int8 | int4 stores weights block-quantized.

Every weight Gemm becomes ONNX Runtime's com.microsoft MatMulNBits over the weight's codes and scales
(passes/block_quant.py: symmetric, block 32 by default, accuracy level 4 = int8 dot products on CPU);
the embedding Gather becomes GatherBlockQuantized over the same codes, so a tied embedding / LM head
is one quantized tensor, not a quantized head plus a float embedding.

    before:  x [M, K] ── Gemm(transB=1) ── [M, N]            ids [B, L] ── Gather(E [V, H]) ── [B, L, H]
                           W [N, K] fp32                                    E: the same tensor as the head's W
    after (int8):
             x [M, K] ── MatMulNBits ── [M, N]               ids ── GatherBlockQuantized ── [B, L, nb, bs]
                          W.q8 [N, nb, bs] uint8                     E.q8 (the same codes)     │
                          W.q8_scales [N, nb] f32                    E.q8_scales.rows [V, nb, 1]  Reshape [B, L, nb*bs]
                                                                     (a view of E.q8_scales)     (Slice to H if padded)
    after (int4): the same, with two codes a byte (W.q4 [N, nb, bs/2]), and one more row:
             x ── Concat(x, 0 [1, K]) ── MatMulNBits ── Slice(rows 0..-1) ── [M, N]

Why the extra row for int4: SPEED's losslessness rests on each row of a step being computed exactly
as plain decoding computes it alone. ONNX Runtime's MatMulNBits is row-invariant for every row count
M >= 2, and at int8 also for M = 1, but 4-bit weights with M = 1 take a separate kernel whose sums
differ in the last bits (measured on onnxruntime 1.32, every accuracy level). Plain decoding runs one
row (M = 1), a speed step several; one zero row appended to every 4-bit product puts both on the
M >= 2 kernel. It costs plain decoding the faster single-row kernel (zoo:small: 3.0 -> 5.0 ms/token on a
loaded host, measured when every graph was padded; README, Quantized weights); without it SPEED's ids differed from plain
decoding's in 3 of 12 runs there.

Every graph is padded: prefill runs chunks of any length (plain decoding one row), and the batch step's
layers run as few rows as hold a token and its heads as few as one.

Weights used any other way (none in the traced programs) stay float; the notes count them.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format.artifact import is_weight_name
from speedc.errors import BuildError
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import import_microsoft_domain
from speedc.passes.block_quant import ACCURACY_LEVEL, BITS, QuantizedWeight, quantized_pair, scales_as_rows
from speedc.passes.source_weights import source_weight

ROW_PAD_BITS = (4,)  # bit widths whose MatMulNBits needs M >= 2 to be row-invariant (see above)
HEAD_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")  # --head-weights applies to these


def _weight_gemm(node: gs.Node) -> bool:
    """Gemm(x, W) with W a weight constant [N, K] read transposed, no bias, no scaling."""
    return (node.op == "Gemm" and len(node.inputs) == 2 and isinstance(node.inputs[1], gs.Constant)
            and is_weight_name(node.inputs[1].name) and len(node.inputs[1].shape) == 2
            and node.attrs.get("transB", 0) == 1 and node.attrs.get("transA", 0) == 0
            and node.attrs.get("alpha", 1.0) == 1.0 and node.attrs.get("beta", 1.0) == 1.0)


def _weight_gather(node: gs.Node) -> bool:
    """Gather(E, ids) along rows of a weight constant E [V, H], with ids of known rank."""
    return (node.op == "Gather" and isinstance(node.inputs[0], gs.Constant) and is_weight_name(node.inputs[0].name)
            and len(node.inputs[0].shape) == 2 and node.attrs.get("axis", 0) == 0
            and node.inputs[1].shape is not None)


MIN_BLOCK = 16  # MatMulNBits' smallest block; rows shorter than it are padded whatever the block


def _largest_block(k: int) -> int:
    """The largest power of two that fits in K (>= MIN_BLOCK): the largest block a row of K values takes unpadded."""
    return 1 << (k.bit_length() - 1)


class Quantizer:
    """One quantized copy of each weight, shared by every graph (each graph gets its own Constants over
    the same values: graphsurgeon tensors track their consumers, so one tensor must not span graphs)."""

    def __init__(self, state: CompileState) -> None:
        self.bits = BITS[state.options.dtype]
        self.head_bits = BITS[state.options.head_dtype or state.options.dtype]
        self.block_size = state.options.block_size
        self.state = state
        self.pairs: dict[str, tuple[QuantizedWeight, QuantizedWeight]] = {}

    def pair(self, weight: gs.Constant) -> tuple[QuantizedWeight, QuantizedWeight]:
        if weight.name not in self.pairs:
            values = source_weight(weight)
            values = values if values is not None else np.asarray(weight.values, np.float32)
            if np.dtype(weight.dtype) != np.float32:
                raise BuildError(f"internal: weight {weight.name} is {weight.dtype}, quantization expects float32")
            k = weight.shape[-1]
            if self.block_size > k >= MIN_BLOCK:  # every row padded to one block: a larger artifact than the default's
                raise BuildError(f"--block-size {self.block_size} is longer than the rows of {weight.name} ({k} values); "
                                 f"each would be padded to {self.block_size}: use --block-size {_largest_block(k)} or less")
            self.pairs[weight.name] = quantized_pair(values, weight.name, self.bits_of(weight.name), self.block_size)
            parts = self.state.weight_parts.get(weight.name)
            if parts:  # a stacked weight: its parts are row ranges of the codes and of the scales alike
                suffix = self.suffix(weight.name)
                self.state.weight_parts[self.codes_name(weight.name)] = [(p + suffix, f, n) for p, f, n in parts]
                self.state.weight_parts[self.scales_name(weight.name)] = [(p + suffix + "_scales", f, n) for p, f, n in parts]
        return self.pairs[weight.name]

    def bits_of(self, name: str) -> int:
        return self.head_bits if name in HEAD_WEIGHTS else self.bits

    def suffix(self, name: str) -> str:
        return f".q{self.bits_of(name)}"

    def codes_name(self, name: str) -> str:
        return name + self.suffix(name)

    def scales_name(self, name: str) -> str:
        return name + self.suffix(name) + "_scales"


def quantize_gemm(graph: gs.Graph, node: gs.Node, quantizer: Quantizer, constants: dict, pad: bool) -> None:
    x, weight = node.inputs
    n, k = (int(d) for d in weight.shape)
    codes, scales = quantizer.pair(weight)
    b = constants.setdefault(quantizer.codes_name(weight.name), gs.Constant(quantizer.codes_name(weight.name), codes))
    s = constants.setdefault(quantizer.scales_name(weight.name), gs.Constant(quantizer.scales_name(weight.name), scales))
    y = node.outputs[0]
    node.inputs.clear()
    node.outputs.clear()  # detached; cleanup() drops it
    bits = quantizer.bits_of(weight.name)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": quantizer.block_size, "accuracy_level": ACCURACY_LEVEL}
    if not pad or bits not in ROW_PAD_BITS:
        graph.nodes.append(gs.Node("MatMulNBits", f"{node.name}/MatMulNBits", attrs=attrs, inputs=[x, b, s],
                                   outputs=[y], domain="com.microsoft"))
        return
    zero_row = constants.setdefault(f"quantize_weights.zero_row.{k}", gs.Constant(f"quantize_weights.zero_row.{k}",
                                                                                   np.zeros((1, k), np.float32)))
    padded = gs.Variable(f"{node.name}/padded", dtype=np.float32)  # [M + 1, K]
    wide = gs.Variable(f"{node.name}/padded_out", dtype=np.float32)  # [M + 1, N]
    graph.nodes.append(gs.Node("Concat", f"{node.name}/pad_row", attrs={"axis": 0}, inputs=[x, zero_row], outputs=[padded]))
    graph.nodes.append(gs.Node("MatMulNBits", f"{node.name}/MatMulNBits", attrs=attrs, inputs=[padded, b, s],
                               outputs=[wide], domain="com.microsoft"))
    bounds = [constants.setdefault(f"quantize_weights.{what}", gs.Constant(f"quantize_weights.{what}", np.array([v], np.int64)))
              for what, v in (("zero", 0), ("minus_one", -1))]
    graph.nodes.append(gs.Node("Slice", f"{node.name}/unpad_row", inputs=[wide, *bounds, bounds[0]], outputs=[y]))


def quantize_gather(graph: gs.Graph, node: gs.Node, quantizer: Quantizer, constants: dict) -> None:
    weight, ids = node.inputs
    v, h = (int(d) for d in weight.shape)
    codes, scales = quantizer.pair(weight)
    b = constants.setdefault(quantizer.codes_name(weight.name), gs.Constant(quantizer.codes_name(weight.name), codes))
    rows_name = quantizer.scales_name(weight.name) + ".rows"
    s = constants.setdefault(rows_name, gs.Constant(rows_name, scales_as_rows(scales, quantizer.scales_name(weight.name))))
    n_blocks = codes.shape[1]
    y = node.outputs[0]
    node.inputs.clear()
    node.outputs.clear()
    blocks = gs.Variable(f"{node.name}/blocks", dtype=np.float32)  # [*ids, nb, bs]
    graph.nodes.append(gs.Node("GatherBlockQuantized", f"{node.name}/GatherBlockQuantized", domain="com.microsoft",
                               attrs={"gather_axis": 0, "quantize_axis": 2, "block_size": quantizer.block_size,
                                      "bits": quantizer.bits_of(weight.name)}, inputs=[b, ids, s], outputs=[blocks]))
    rank = len(ids.shape)
    shape = constants.setdefault(f"quantize_weights.rows_shape.{rank}.{n_blocks * quantizer.block_size}", gs.Constant(
        f"quantize_weights.rows_shape.{rank}.{n_blocks * quantizer.block_size}",
        np.array([0] * rank + [n_blocks * quantizer.block_size], np.int64)))
    if n_blocks * quantizer.block_size == h:
        graph.nodes.append(gs.Node("Reshape", f"{node.name}/rows", inputs=[blocks, shape], outputs=[y]))  # [*ids, H]
        return
    padded = gs.Variable(f"{node.name}/padded_rows", dtype=np.float32)  # [*ids, nb * bs]
    graph.nodes.append(gs.Node("Reshape", f"{node.name}/rows", inputs=[blocks, shape], outputs=[padded]))
    bounds = [constants.setdefault(f"quantize_weights.{what}", gs.Constant(f"quantize_weights.{what}", np.array([v], np.int64)))
              for what, v in (("zero", 0), (f"hidden.{h}", h), ("minus_one", -1))]
    graph.nodes.append(gs.Node("Slice", f"{node.name}/unpad", inputs=[padded, *bounds], outputs=[y]))  # [*ids, H]


def quantize_graph(graph: gs.Graph, quantizer: Quantizer, *, pad: bool = True) -> tuple[int, int]:
    """Rewrite GRAPH's weight Gemms and Gathers; returns (products, gathers) rewritten. PAD: append the
    zero row to 4-bit products (graphs whose products may run a single row)."""
    constants: dict[str, gs.Constant] = {}
    gemms = [node for node in graph.nodes if _weight_gemm(node)]
    gathers = [node for node in graph.nodes if _weight_gather(node)]
    for node in gemms:
        quantize_gemm(graph, node, quantizer, constants, pad)
    for node in gathers:
        quantize_gather(graph, node, quantizer, constants)
    if gemms or gathers:
        import_microsoft_domain(graph)
    graph.cleanup().toposort()
    return len(gemms), len(gathers)


def float_weights_left(graphs: dict[str, gs.Graph]) -> list[str]:
    """Large weights still stored as floats after quantization (used by some other op)."""
    left = set()
    for graph in graphs.values():
        for t in graph.tensors().values():
            if isinstance(t, gs.Constant) and is_weight_name(t.name) and len(t.shape) == 2 \
                    and not isinstance(t._values, QuantizedWeight):
                left.add(t.name)
    return sorted(left)


@register_pass("quantize_weights", phase="finalize", requires=("programs",), provides=("quantized_weights",))
def quantize_weights(state: CompileState) -> CompileState:
    """--weights int8/int4: weight Gemms -> MatMulNBits, embedding Gathers -> GatherBlockQuantized."""
    if state.options.dtype not in BITS:
        return state
    quantizer = Quantizer(state)
    products = gathers = 0
    for name, graph in state.graphs.items():
        p, g = quantize_graph(graph, quantizer)
        products, gathers = products + p, gathers + g
    left = float_weights_left(state.graphs)
    state.notes.append(
        f"quantize_weights: {len(quantizer.pairs)} weights stored as {state.options.dtype} (block {quantizer.block_size}, "
        f"accuracy level {ACCURACY_LEVEL}): {products} MatMulNBits, {gathers} GatherBlockQuantized across graphs"
        + (f"; embedding / LM head as {state.options.head_dtype}" if quantizer.head_bits != quantizer.bits else "")
        + ("; 4-bit products get one zero row (row-invariant kernel)" if {quantizer.bits, quantizer.head_bits} & set(ROW_PAD_BITS) else "")
        + (f"; {len(left)} 2-D weights left in float ({left[0]}...)" if left else ""))
    return state
