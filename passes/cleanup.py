"""Pass `cleanup` (phase finalize): constant folding, dead-node removal, toposort, 16-bit storage.

--weights fp16 / bf16 stores every floating-point weight as float16 / bfloat16 with a Cast back to
float32 in front of its users: the artifact's weights halve, and ONNX Runtime folds the Casts at
session load, so CPU steps still compute in fp32. A checkpoint stored in 16 bits keeps its precision
by default, so its artifact is as small as the checkpoint and computes exactly what it holds.

    before:  W (fp32) ---------------------> Gemm
    after:   W (fp16/bf16) -> Cast(float) -> Gemm
    a row lookup (Gather of a weight's rows) casts only the rows it gathers (_cast_after)
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs

from speedc.format.artifact import is_weight_name
from speedc.passes.base import CompileState, register_pass
from speedc.passes.source_weights import SourceWeight, source_weight

FP16_MIN_ELEMENTS = 1024  # norms, rope tables and masks stay fp32


def fold_and_clean(graph: gs.Graph) -> gs.Graph:
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # folding partial graphs makes ORT chatty about Unsqueezes
    graph.cleanup().toposort()
    # Weights are never folded into new tensors (that would duplicate them); only small constants.
    graph.fold_constants(size_threshold=1 << 14, error_ok=True)  # 16 KiB: rotary tables stay computed (folded at load)
    return graph.cleanup(remove_unused_graph_inputs=True).toposort()


STORAGE_DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _gathers_rows(node: gs.Node, table: gs.Constant) -> bool:
    """NODE reads rows of TABLE (an embedding lookup, the batch step's candidate head rows)."""
    return node.op == "Gather" and node.inputs[0] is table and node.attrs.get("axis", 0) == 0


def _cast_after(graph: gs.Graph, gather: gs.Node, stored: gs.Constant) -> None:
    """GATHER reads the 16-bit table STORED and its rows are cast to float32 after it, instead of the
    whole table before it: ONNX Runtime folds a Cast of a weight into a float32 copy of that weight in
    every session, so a lookup through one kept a float32 embedding table per session (the same values:
    a Cast is elementwise).

        before:  E16 -> Cast -> Gather(ids) -> [.., H] f32       after:  E16 -> Gather(ids) -> Cast -> [.., H] f32
    """
    out = gather.outputs[0]
    rows = gs.Variable(f"{out.name}.stored")  # [.., H] in the storage dtype
    gather.inputs[0] = stored
    gather.outputs[0] = rows
    graph.nodes.append(gs.Node("Cast", f"{out.name}/Cast_fp32", attrs={"to": 1}, inputs=[rows], outputs=[out]))


def store_weights_16bit(graphs: dict[str, gs.Graph], storage: str) -> int:
    """Convert large float32 weights (checkpoint and stacked weights) to STORAGE (fp16 | bf16) + Cast;
    the same weight gets the same 16-bit copy in every graph, so the artifact still stores it once.
    Tables computed at build time (rotary cos/sin) stay float32: rounding them would change outputs."""
    converted: dict[str, SourceWeight | np.ndarray] = {}
    for graph in graphs.values():
        for const in [t for t in graph.tensors().values() if isinstance(t, gs.Constant)]:
            if (const.dtype != np.float32 or math.prod(const.shape) < FP16_MIN_ELEMENTS
                    or not is_weight_name(const.name)):
                continue
            if const.name not in converted:
                weight = source_weight(const)  # a checkpoint weight: converted as the writer streams it
                converted[const.name] = (weight.with_dtype(STORAGE_DTYPES[storage]) if weight is not None
                                         else const.values.astype(STORAGE_DTYPES[storage]))
            users = list(const.outputs)
            stored = gs.Constant(const.name, converted[const.name])
            cast_out = gs.Variable(f"{const.name}.fp32", dtype=np.float32, shape=list(const.shape))
            graph.nodes.append(gs.Node("Cast", f"{const.name}/Cast_fp32", attrs={"to": 1}, inputs=[stored], outputs=[cast_out]))
            for node in users:
                if _gathers_rows(node, const):
                    _cast_after(graph, node, stored)
                else:
                    node.inputs = [cast_out if inp is const else inp for inp in node.inputs]
            const.name = f"{const.name}.unused_fp32"
        graph.cleanup().toposort()
    return len(converted)


@register_pass("cleanup", phase="finalize", requires=("programs",), provides=("clean",))
def cleanup(state: CompileState) -> CompileState:
    """Fold constants, drop dead nodes, toposort; with --weights fp16/bf16 store weights in 16 bits."""
    for name in list(state.graphs):
        state.graphs[name] = fold_and_clean(state.graphs[name])
    if state.options.dtype in STORAGE_DTYPES:
        count = store_weights_16bit(state.graphs, state.options.dtype)
        state.notes.append(f"cleanup: {count} weights stored as {state.options.dtype} (computed in fp32 on CPU)")
    return state
