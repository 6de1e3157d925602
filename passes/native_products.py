r"""Pass `native_products` (phase finalize, after merge_programs): each engine graph of a block-quantized
or 16-bit artifact gets a native twin whose weight products run speedc's own kernel (runtimes/kernels/).

    before (engine graph, int4):   x ── Concat(x, 0 [1, K]) ── MatMulNBits(W.q4, W.q4_scales) ── Slice(0..-1) ── y
           (int8):                 x ── MatMulNBits(W.q8, W.q8_scales) ── y
    after (its twin, both):        x ── ai.onnx.contrib SpeedcBlockProduct(artifact, codes=W.q4, scales=W.q4_scales,
                                                                          n, k, bits, block_size) ── y
    before (bf16 / fp16):          W (16-bit) ── Cast(float) ──┐
                                   x ────────────────────────── Gemm(transB=1) ── y
    after (its twin):              x ── ai.onnx.contrib SpeedcHalfProduct(artifact, weight=W, n, k, dtype) ── y

A 16-bit twin matters for memory as much as for speed: ONNX Runtime folds each Cast of a 16-bit weight
into a float32 copy at load (twice the bytes of the weights, beside them while it loads), while the
twin's operator reads the 16-bit weights where weights.bin is mapped. A weight that also feeds a Gather (the embedding of a tied head) is still loaded for it, as
16 bits.

The twin takes and returns exactly what its engine graph does (the manifest records it as the graph's
`native_file`); only its products differ (the pass native_attention then moves the fused twin's attention onto
the kernel and its caches out of the graph). Its operator reads the codes and scales from weights.bin by
their weight index names, so the twin holds no weight of a product: ONNX Runtime loads none of them,
and the engine graph (MatMulNBits) stays for runtimes without the kernel. The kernel sums a row the
same whatever the row count, so the twin needs no zero row (the engine graph's int4 products append
one: passes/quantize_weights.py). Embedding lookups (GatherBlockQuantized) stay as they are.

Products the kernel does not take (block sizes below 32) keep MatMulNBits in the twin too.
"""

from __future__ import annotations

import uuid

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.passes.base import CompileState, register_pass
from speedc.passes.cleanup import STORAGE_DTYPES
from speedc.passes.graph_utils import import_domain


def _subgraphs(graph: gs.Graph):
    """GRAPH and every graph nested in its nodes' attributes (an engine graph's If branches)."""
    yield graph
    for node in graph.nodes:
        for value in node.attrs.values():
            if isinstance(value, gs.Graph):
                yield from _subgraphs(value)


def _padding(product: gs.Node) -> tuple[gs.Node, gs.Node] | None:
    """(Concat, Slice) when PRODUCT runs on its input plus a zero row and drops that row's output."""
    x, y = product.inputs[0], product.outputs[0]
    concat = x.inputs[0] if len(x.inputs) == 1 else None
    if concat is None or concat.op != "Concat" or len(concat.inputs) != 2 or len(x.outputs) != 1:
        return None
    zero = concat.inputs[1]
    if not (isinstance(zero, gs.Constant) and tuple(zero.shape) == (1, int(product.attrs["K"]))
            and concat.attrs.get("axis", 0) == 0 and not np.any(zero.values)):
        return None
    if len(y.outputs) != 1 or y.outputs[0].op != "Slice":
        return None
    return concat, y.outputs[0]


STORAGE_OF = {np.dtype(dtype): name for name, dtype in STORAGE_DTYPES.items()}  # 16-bit numpy dtype -> "fp16" | "bf16"


def _half_weight(product: gs.Node) -> tuple[gs.Constant, str] | None:
    """(W, "bf16" | "fp16") when PRODUCT is Gemm(x, Cast(W)^T) over a 16-bit constant W [N, K], nothing else."""
    if product.op != "Gemm" or len(product.inputs) != 2 or product.attrs.get("transB", 0) != 1 or product.attrs.get("transA", 0):
        return None
    if product.attrs.get("alpha", 1.0) != 1.0:
        return None
    cast_out = product.inputs[1]
    cast = cast_out.inputs[0] if len(cast_out.inputs) == 1 else None
    if cast is None or cast.op != "Cast" or cast.attrs.get("to") != 1:
        return None
    weight = cast.inputs[0]
    dtype = STORAGE_OF.get(np.dtype(weight.dtype)) if isinstance(weight, gs.Constant) else None
    if dtype is None or len(weight.shape) != 2:
        return None
    return weight, dtype


def native_twin(graph: gs.Graph, artifact_id: str) -> tuple[gs.Graph, int, int]:
    """A copy of GRAPH with every MatMulNBits the kernel takes run as SpeedcBlockProduct.
    Returns (the twin, products replaced, products left on MatMulNBits)."""
    twin = graph.copy()
    replaced = kept = 0
    for g in _subgraphs(twin):
        for node in [n for n in g.nodes if n.op == "Gemm"]:
            found = _half_weight(node)
            if found is None:
                continue
            (weight, dtype), x, y = found, node.inputs[0], node.outputs[0]
            node.inputs.clear()
            node.outputs.clear()
            g.nodes.append(gs.Node(contract.NATIVE_HALF_PRODUCT, f"{node.name}/native", domain=contract.NATIVE_DOMAIN,
                                   inputs=[x], outputs=[y], attrs={"artifact": artifact_id, "weight": weight.name,
                                                                   "n": int(weight.shape[0]), "k": int(weight.shape[1]),
                                                                   "dtype": dtype}))
            replaced += 1
        for node in [n for n in g.nodes if n.op == "MatMulNBits" and n.domain == "com.microsoft"]:
            attrs = node.attrs
            if not contract.native_product_takes(int(attrs["bits"]), int(attrs["block_size"])) or len(node.inputs) != 3:
                kept += 1
                continue
            x, codes, scales = node.inputs
            y = node.outputs[0]
            padded = _padding(node)
            if padded is not None:  # x is [M + 1, K] with the zero row: read the rows before it
                concat, slice_ = padded
                x, y = concat.inputs[0], slice_.outputs[0]
                for dropped in (concat, slice_):
                    dropped.inputs.clear()
                    dropped.outputs.clear()
            node.inputs.clear()
            node.outputs.clear()
            g.nodes.append(gs.Node(contract.NATIVE_PRODUCT, f"{node.name}/native", domain=contract.NATIVE_DOMAIN,
                                   inputs=[x], outputs=[y], attrs={
                "artifact": artifact_id, "codes": codes.name, "scales": scales.name, "n": int(attrs["N"]),
                "k": int(attrs["K"]), "bits": int(attrs["bits"]), "block_size": int(attrs["block_size"])}))
            replaced += 1
        g.cleanup(remove_unused_graph_inputs=False).toposort()
    if replaced:
        twin.cleanup(remove_unused_graph_inputs=False).toposort()  # the Casts no product reads any more
        import_domain(twin, contract.NATIVE_DOMAIN)
    return twin, replaced, kept


@register_pass("native_products", phase="finalize", requires=("engine_graph", "quantized_weights"),
               provides=("native_graphs",))
def native_products(state: CompileState) -> CompileState:
    """Each engine graph of an int8/int4 or 16-bit artifact gets a twin whose products run speedc's own kernel."""
    artifact_id = uuid.uuid4().hex  # names this artifact's weights.bin at run time (runtimes/kernels/ort_op.py)
    for name, graph in state.graphs.items():
        if not any(n.op == "MatMulNBits" or _half_weight(n) for g in _subgraphs(graph) for n in g.nodes):
            continue  # fp32 weights: no twin, and no copy of the graph to find that out
        twin, replaced, kept = native_twin(graph, artifact_id)
        if replaced:
            state.native_graphs[name] = twin
            state.native_artifact_id = artifact_id
        if kept:
            state.notes.append(f"native_products: {kept} products of {name} keep MatMulNBits (block size below 32)")
    return state
