r"""Pass `fuse_projections` (phase lowering): sibling Gemms reading one input -> one Gemm + Split.

    x ─┬─ Gemm(x, Wq) ─ q                                      ┌─ q
       ├─ Gemm(x, Wk) ─ k     =>   x ─ Gemm(x, [Wq;Wk;Wv]) ─ Split ─┼─ k
       └─ Gemm(x, Wv) ─ v                                      └─ v

    and where q, k, v feed only one Concat in that order (gqa_attention's packed q|k|v), the Concat
    and the Split go: its consumers read the stacked Gemm's output.

Why: in a decode step each projection is a skinny Gemm (P rows); one Gemm over the stacked weights
packs the activation once and makes one kernel launch instead of three (q/k/v) or two (gate/up).
What it measured on the memory-bound configuration and the zoo model is in the README.

Nothing is stored twice: weights are [N, K] (transB=1), so stacking along N puts each checkpoint
tensor's bytes back to back. The stacked constant is named after its parts ("a+b+c") and reused by
every graph and every layer that uses the same block, so weight sharing survives; `parts` records
(name, rows) for the artifact index, which keeps naming every checkpoint tensor as a byte range.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs

from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import replace_uses
from speedc.passes.source_weights import SourceWeight, source_weight

FUSED_NAME_SEPARATOR = "+"


def _plain_weight_gemm(node: gs.Node) -> bool:
    """Gemm(x, W) with W a constant [N, K] read transposed, no bias, no scaling."""
    return (node.op == "Gemm" and len(node.inputs) == 2 and isinstance(node.inputs[1], gs.Constant)
            and node.attrs.get("transB", 0) == 1 and node.attrs.get("transA", 0) == 0
            and node.attrs.get("alpha", 1.0) == 1.0 and node.attrs.get("beta", 1.0) == 1.0
            and len(node.inputs[1].shape) == 2)


def stack(weights: list[gs.Constant]) -> SourceWeight | np.ndarray:
    """The rows of WEIGHTS back to back: a SourceWeight over their checkpoint tensors (nothing read),
    or an array when a weight is a computed table."""
    sources = [source_weight(w) for w in weights]
    if all(s is not None for s in sources):
        return SourceWeight(tuple(p for s in sources for p in s.parts), sources[0].dtype)
    return np.concatenate([w.values for w in weights], axis=0)  # [sum N, K]


def fuse_sibling_gemms(graph: gs.Graph, stacked: dict[str, SourceWeight | np.ndarray], parts: dict[str, list]) -> int:
    """Fuse every group of >= 2 plain weight Gemms that read the same tensor; returns groups fused.

    STACKED (name -> stacked values) is shared across graphs so each stacked weight is made once (every
    graph gets its own Constant over the same values: graphsurgeon tensors track their consumers, so
    one tensor object must not span graphs); PARTS receives name -> [(part name, first row, row count)].
    """
    constants: dict[str, gs.Constant] = {}
    siblings: dict[str, list[gs.Node]] = defaultdict(list)
    for node in graph.nodes:
        if _plain_weight_gemm(node):
            siblings[node.inputs[0].name].append(node)
    fused = 0
    for group in siblings.values():
        weights = [node.inputs[1] for node in group]
        if len(group) < 2 or len({(w.dtype, w.shape[1]) for w in weights}) != 1:
            continue
        if len({w.name for w in weights}) != len(weights):
            continue  # the same weight twice on one input: nothing to stack
        name = FUSED_NAME_SEPARATOR.join(w.name for w in weights)
        if name not in stacked:
            stacked[name] = stack(weights)  # [sum N, K]
            rows, layout = 0, []
            for w in weights:
                layout.append((w.name, rows, int(w.shape[0])))
                rows += int(w.shape[0])
            parts[name] = layout
        constant = constants.setdefault(name, gs.Constant(name, stacked[name]))
        first, x = group[0], group[0].inputs[0]
        wide = gs.Variable(f"{first.name}.stacked_out", dtype=first.outputs[0].dtype)  # [rows, sum N]
        sizes = gs.Constant(f"{first.name}.split_sizes", np.array([w.shape[0] for w in weights], np.int64))
        outputs = [node.outputs[0] for node in group]
        for node in group:  # detached; cleanup() drops them
            node.outputs.clear()
            node.inputs.clear()
        graph.nodes.append(gs.Node("Gemm", f"{first.name}.stacked", attrs={"transB": 1}, inputs=[x, constant],
                                   outputs=[wide]))
        graph.nodes.append(gs.Node("Split", f"{first.name}.split", attrs={"axis": 1}, inputs=[wide, sizes],
                                   outputs=outputs))
        _fold_split_concat(outputs, wide)
        fused += 1
    graph.cleanup().toposort()
    return fused


def _fold_split_concat(parts: list[gs.Tensor], whole: gs.Tensor) -> None:
    """Where the Split's outputs feed only one Concat, all of them in order along the same axis (the
    packed q|k|v of gqa_attention), that Concat's consumers read the stacked output itself."""
    consumers = {id(node): node for part in parts for node in part.outputs}
    if len(consumers) != 1 or any(len(part.outputs) != 1 for part in parts):
        return
    concat = next(iter(consumers.values()))
    if concat.op != "Concat" or concat.attrs.get("axis") not in (1, -1) or list(concat.inputs) != parts:
        return
    replace_uses(concat.outputs[0], whole)  # the Concat and the Split are left without consumers: cleanup drops them


@register_pass("fuse_projections", phase="lowering", requires=("programs",), provides=("fused_projections",),
               consumes=("separate_projections",))
def fuse_projections(state: CompileState) -> CompileState:
    """Stack sibling projection weights (q/k/v, gate/up) into one Gemm + Split; no weight stored twice."""
    stacked: dict[str, SourceWeight | np.ndarray] = {}
    total = 0
    for graph in state.graphs.values():
        total += fuse_sibling_gemms(graph, stacked, state.weight_parts)
    state.notes.append(f"fused {len(stacked)} sibling projection groups ({total} uses across graphs)")
    return state
