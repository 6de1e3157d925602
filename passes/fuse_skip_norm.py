r"""Pass `fuse_skip_norm` (phase finalize): in the ONNX Runtime graphs (`*.gqa`), every decoder layer's
RMSNorm (input_layernorm, post_attention_layernorm) runs as one com.microsoft
SkipSimplifiedLayerNormalization; where a residual Add feeds it, the Add goes inside (the kernel returns
the sum too, for every other reader of the residual stream).

    before:  a ─┐                                                     ┌─ (every other reader of s)
                Add ── s ─┬─ Pow(s, 2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─┤
             b ─┘         └─────────────────────────────────── Div(s, ·) ─ Mul(w) ── normed
    after:   a ─┐
                SkipSimplifiedLayerNormalization(w, epsilon) ─┬─ normed    (output 0)
             b ─┘                                            └─ s         (output 3: a + b)
    no Add before it (a step's first stage layer, prefill's layer 0):
             x ─┬──────────────────────────────── SkipSimplifiedLayerNormalization(w, epsilon) ── normed
                └─ Shape ─ ConstantOfShape(0) ── skip ─┘

Why: ONNX Runtime fuses the norm pattern into SimplifiedLayerNormalization itself, but takes the Add in
only over 3-D tensors of known equal shapes; the residual stream here is 2-D token rows (models/
row_layer.py), so every layer kept two Adds and two norms as separate kernels (zoo:small: 12% of a token).

Why every layer norm, even without an Add: a logical layer's norm must run the same kernel in every
graph. Logical layer s*S of plain decoding follows an Add in the prefill graph, but in a step it is slot
s's first stage layer, reading hidden_in: fusing only where an Add precedes gave SPEED and plain decoding
last-bit different logits (measured, tests/numeric/test_quantized_artifacts.py). With a zero skip the kernel
adds 0 (exact) to the same sum, so both compute the same bits; the kernel is row-invariant (its test).
Head norms (final, exit, a looped model's loop norm) are left to ONNX Runtime's own fusion, in every graph.

The standard graphs (TensorRT, the numpy-fed backend) keep plain ONNX ops.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import import_microsoft_domain


LAYER_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight")


def _constant_value(t: gs.Tensor) -> np.ndarray | None:
    return np.asarray(t.values) if isinstance(t, gs.Constant) else None


def _producer(t: gs.Tensor, op: str) -> gs.Node | None:
    """T's producer if it is an OP node and T has no other reader."""
    return t.inputs[0] if len(t.inputs) == 1 and t.inputs[0].op == op and len(t.outputs) == 1 else None


def _layer_norm(mul: gs.Node) -> tuple[list[gs.Node], gs.Tensor, float, gs.Constant] | None:
    """MUL ends a layer RMSNorm written as Pow -> ReduceMean -> Add(eps) -> Sqrt -> Div -> Mul(w): (its six
    nodes, the normed input x, eps, w), else None."""
    w = mul.inputs[1]
    if not (isinstance(w, gs.Constant) and w.name.endswith(LAYER_NORMS)):
        return None
    div = _producer(mul.inputs[0], "Div")
    sqrt = None if div is None else _producer(div.inputs[1], "Sqrt")
    add = None if sqrt is None else _producer(sqrt.inputs[0], "Add")
    mean = None if add is None else _producer(add.inputs[0], "ReduceMean")
    pow_node = None if mean is None else _producer(mean.inputs[0], "Pow")
    if pow_node is None or pow_node.inputs[0] is not div.inputs[0]:
        return None
    exponent, eps = _constant_value(pow_node.inputs[1]), _constant_value(add.inputs[1])
    if exponent is None or exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0 or eps is None or eps.size != 1:
        return None
    if mean.attrs.get("keepdims", 1) != 1 or list(mean.attrs.get("axes", [])) not in ([-1], [1]):
        return None
    return [pow_node, mean, add, sqrt, div, mul], div.inputs[0], float(eps.reshape(-1)[0]), w


def _residual_add(x: gs.Tensor) -> gs.Node | None:
    """The Add of two computed tensors that produces X (a residual add), if any."""
    if len(x.inputs) != 1 or x.inputs[0].op != "Add":
        return None
    add = x.inputs[0]
    return add if len(add.inputs) == 2 and not any(isinstance(t, gs.Constant) for t in add.inputs) else None


def fuse_graph(graph: gs.Graph) -> tuple[int, int]:
    """Rewrite every layer RMSNorm of GRAPH; returns (with the residual Add inside, with a zero skip)."""
    with_add = zero_skip = 0
    for mul in [n for n in graph.nodes if n.op == "Mul"]:
        found = _layer_norm(mul)
        if found is None:
            continue
        nodes, x, eps, w = found
        normed = mul.outputs[0]
        add = _residual_add(x)
        for node in nodes:  # detached; cleanup() drops them
            node.inputs.clear()
            node.outputs.clear()
        if add is not None:
            inputs, outputs = list(add.inputs), [normed, gs.Variable.empty(), gs.Variable.empty(), x]
            add.inputs.clear()
            add.outputs.clear()
            with_add += 1
        else:
            shape = gs.Variable(f"{normed.name}.shape", np.int64)
            zeros = gs.Variable(f"{normed.name}.zero_skip", np.float32)
            graph.nodes.append(gs.Node("Shape", f"{normed.name}/Shape", inputs=[x], outputs=[shape]))
            graph.nodes.append(gs.Node("ConstantOfShape", f"{normed.name}/zero_skip", inputs=[shape], outputs=[zeros]))  # float 0
            inputs, outputs = [x, zeros], [normed]
            zero_skip += 1
        graph.nodes.append(gs.Node("SkipSimplifiedLayerNormalization", f"{normed.name}/SkipSimplifiedLayerNorm",
                                   domain="com.microsoft", attrs={"epsilon": eps}, inputs=[*inputs, w], outputs=outputs))
    if with_add or zero_skip:
        import_microsoft_domain(graph)
        graph.cleanup().toposort()
    return with_add, zero_skip


@register_pass("fuse_skip_norm", phase="finalize", requires=("clean",))
def fuse_skip_norm(state: CompileState) -> CompileState:
    """Layer RMSNorms (with their residual Add) -> SkipSimplifiedLayerNormalization in the *.gqa graphs."""
    counts = [fuse_graph(graph) for name, graph in state.graphs.items() if name.endswith(contract.FUSED_SUFFIX)]
    if counts:
        state.notes.append(f"fuse_skip_norm: {sum(c[0] for c in counts)} layer norms with their residual Add and "
                           f"{sum(c[1] for c in counts)} with a zero skip -> SkipSimplifiedLayerNormalization across "
                           f"{len(counts)} ONNX Runtime graphs")
    return state
