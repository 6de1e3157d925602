r"""Pass `untie_head` (phase finalize): a tied LM head reads its own initializer over the same bytes.

ONNX Runtime prepacks a Gemm's constant weight into its kernel's layout once, at session load, but
not a weight that another node reads too. With tied embeddings the embedding's Gather and the head's
Gemm share one initializer, so the head Gemm repacks the whole [V, H] weight on every run (measured
on a 16 MB head, 2 threads: 1.19 vs 1.02 ms at 1 row, 1.33 vs 1.17 ms at 4 rows).

    before:  E --------------------> Gather            after:  E -----------------> Gather
              \--------------------> Gemm(head)                E' (E's bytes) ----> Gemm(head)

With 16-bit storage nothing is left to untie: a lookup reads the stored table and casts the rows it
gathers (passes/cleanup.py), so the head's Cast (folded at load) feeds the Gemm alone.

E' is a SameBytes view: weights.bin holds the bytes once and both initializers reference them.
Block-quantized heads (MatMulNBits) and untied heads are left as they are.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from speedc.passes.base import CompileState, register_pass
from speedc.passes.source_weights import SameBytes

HEAD_VIEW_PREFIX = "tied_head."  # not a checkpoint name prefix: readers of the checkpoint tensors skip it


def _weight_and_cast(gemm: gs.Node) -> tuple[gs.Constant, gs.Node | None] | None:
    """(the Gemm's constant weight, the Cast between them or None); None for a computed weight."""
    weight = gemm.inputs[1]
    if isinstance(weight, gs.Constant):
        return weight, None
    producer = weight.inputs[0] if weight.inputs else None
    if producer is not None and producer.op == "Cast" and isinstance(producer.inputs[0], gs.Constant):
        return producer.inputs[0], producer
    return None


def untie_graph(graph: gs.Graph) -> int:
    """Gemms whose weight a non-Gemm node also reads get their own initializer (a view of the same
    bytes; Gemms sharing a weight among themselves, as the plain graph's loops do, are prepacked
    already). Returns how many weights were untied."""
    untied: dict[str, gs.Tensor] = {}  # shared constant -> what its Gemms read now
    for gemm in [node for node in graph.nodes if node.op == "Gemm"]:
        found = _weight_and_cast(gemm)
        if found is None:
            continue
        constant, cast = found
        read = gemm.inputs[1]
        if all(user.op == "Gemm" for user in read.outputs):
            continue
        if constant.name not in untied:
            view = gs.Constant(HEAD_VIEW_PREFIX + constant.name, SameBytes(constant))
            if cast is not None:  # 16-bit storage: the view gets its own Cast (folded at load like the first)
                out = gs.Variable(f"{view.name}.fp32", dtype=read.dtype, shape=read.shape)
                graph.nodes.append(gs.Node("Cast", f"{view.name}/Cast", attrs=dict(cast.attrs), inputs=[view], outputs=[out]))
                view = out
            untied[constant.name] = view
        gemm.inputs[1] = untied[constant.name]
    graph.toposort()
    return len(untied)


@register_pass("untie_head", phase="finalize", requires=("clean",))
def untie_head(state: CompileState) -> CompileState:
    """A Gemm whose weight another node also reads (a tied LM head) gets its own view of those bytes."""
    untied = {name: untie_graph(graph) for name, graph in state.graphs.items()}
    if any(untied.values()):
        state.notes.append("untie_head: the tied LM head reads its own initializer over the embedding's bytes "
                           "(ONNX Runtime prepacks it)")
    return state
