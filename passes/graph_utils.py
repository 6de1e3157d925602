"""Small onnx-graphsurgeon helpers shared by the passes."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import onnx
import onnx_graphsurgeon as gs


def tensor(graph: gs.Graph, name: str) -> gs.Tensor:
    tensors = graph.tensors()
    if name not in tensors:
        raise KeyError(f"graph has no tensor {name!r}")
    return tensors[name]


def add_layer(graph: gs.Graph, *, op: str, inputs: list, outputs: list[str], attrs: dict | None = None,
              name: str | None = None) -> list[gs.Variable]:
    """Append one node whose outputs are new tensors named OUTPUTS; returns them (like graph.layer).

    graphsurgeon's Graph.layer scans every tensor of the graph on each call to keep names unique: on a
    96-layer graph (20,000 nodes) a pass adding nodes per layer spent minutes there. The passes name
    their tensors uniquely themselves, so nothing is scanned here."""
    node = gs.Node(op=op, name=name or f"{outputs[0]}/{op}", attrs=attrs or {}, inputs=list(inputs),
                   outputs=[gs.Variable(o) for o in outputs])
    graph.nodes.append(node)
    return node.outputs


def reshape(graph: gs.Graph, x: gs.Tensor, shape: list[int], name: str) -> gs.Tensor:
    """Reshape X to the constant SHAPE (ONNX rules: -1 inferred, 0 copied); the result is named NAME."""
    return add_layer(graph, op="Reshape", inputs=[x, gs.Constant(f"{name}.to", np.array(shape, np.int64))], outputs=[name],
                     name=f"{name}/Reshape")[0]


def replace_uses(old: gs.Tensor, new: gs.Tensor) -> None:
    """Make every consumer of `old` read `new` instead (graph outputs are left alone)."""
    for node in list(old.outputs):
        for i, inp in enumerate(node.inputs):
            if inp is old:
                node.inputs[i] = new


def ancestors(outputs: list[gs.Tensor]) -> set[int]:
    """ids of every node any of `outputs` depends on (gs nodes are not hashable)."""
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        t = stack.pop()
        for producer in t.inputs:
            if id(producer) not in seen:
                seen.add(id(producer))
                stack.extend(producer.inputs)
    return seen


def descendants(tensors: list[gs.Tensor], stop: gs.Node | None = None) -> dict[int, gs.Node]:
    """Every node reading any of TENSORS directly or through other nodes, by id, nearest first (breadth
    first); STOP is included but not walked past."""
    reached: dict[int, gs.Node] = {}
    frontier = deque(tensors)
    while frontier:
        tensor = frontier.popleft()
        for consumer in tensor.outputs:
            if id(consumer) not in reached:
                reached[id(consumer)] = consumer
                if consumer is not stop:
                    frontier.extend(consumer.outputs)
    return reached


def weight_constants(nodes) -> list[gs.Constant]:
    """Distinct non-scalar constants feeding `nodes` (weights), in first-use order."""
    out, seen = [], set()
    for node in nodes:
        for inp in node.inputs:
            if isinstance(inp, gs.Constant) and len(inp.shape) >= 1 and math.prod(inp.shape) > 1 and inp.name not in seen:
                if np.issubdtype(inp.dtype, np.floating):
                    seen.add(inp.name)
                    out.append(inp)
    return out


def linear_to_gemm(graph: gs.Graph) -> int:
    """MatMul(x2d, Transpose(W)) -> Gemm(x2d, W, transB=1).

    PyTorch exports F.linear as a Transpose of the weight feeding a MatMul; ONNX Runtime would fold
    that transpose into a second copy of the weight at load time (once per use). Gemm reads the
    stored [out, in] weight directly, so every weight exists once, in the layout the checkpoint has.
    """
    count = 0
    for node in list(graph.nodes):
        if node.op != "MatMul" or len(node.inputs) != 2:
            continue
        producer = node.inputs[1].inputs[0] if node.inputs[1].inputs else None
        if producer is None or producer.op != "Transpose" or list(producer.attrs.get("perm", [])) != [1, 0]:
            continue
        weight = producer.inputs[0]
        if not isinstance(weight, gs.Constant):
            continue
        node.op = "Gemm"
        node.attrs = {"transB": 1}
        node.inputs = [node.inputs[0], weight]
        count += 1
    graph.cleanup()
    return count


def import_microsoft_domain(graph: gs.Graph) -> None:
    """Let GRAPH use ONNX Runtime's com.microsoft contrib ops (MatMulNBits, GroupQueryAttention, ...)."""
    import_domain(graph, "com.microsoft")


def import_domain(graph: gs.Graph, domain: str, version: int = 1) -> None:
    """Let GRAPH use the operators of DOMAIN (com.microsoft; ai.onnx.contrib for speedc's native product)."""
    if domain not in {d.domain for d in graph.import_domains or []}:
        graph.import_domains = [*(graph.import_domains or [onnx.helper.make_opsetid("", graph.opset)]),
                                onnx.helper.make_opsetid(domain, version)]
