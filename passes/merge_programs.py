r"""Pass `merge_programs` (phase finalize, last): each variant's programs become one engine graph, so a
process that runs them opens one ONNX Runtime session and holds one copy of the weights.

    before:  prefill      (its weights, its Casts to fp32)          after:  engine
             batch_step   (the same weights, their own Casts)

    run_step [] bool ───────────────────────────────────────────────┐
    input_ids, positions, chunk_lengths, hidden_in, ..., caches ────┤ outer scope: one input per name
    W (weights.bin, 16-bit) ── Cast (fp32) ─────────────────────────┤ outer scope: folded once at load
                                                                    If ── next_token, logits, final_token, ...
                                                  then: batch_step/*   (its nodes, names prefixed)
                                                  else: prefill/*

Why: ONNX Runtime folds a 16-bit weight's Cast into an fp32 initializer and prepacks each Gemm's
weight once per session, so an engine with a prefill session and a batch-step session held two fp32
copies (Ouro-1.4B's shapes, 4 of 24 layers: 2.55 GB resident after opening both, 1.37 GB with the
engine graph). Inside one session both branches read the outer scope's one folded copy, and ONNX
Runtime runs only the branch taken; the in-place KV writes of the fused graphs pass through the If
(its outputs are bound to the pool's buffers like a plain graph's).

Each branch produces every output of the engine graph (ONNX requires it): the other program's come
from empty constants. Inputs and outputs the programs share (input_ids, positions, new_key / new_value)
are one tensor; where their shapes differ the engine's dimension is dynamic (contract.merged_specs).
A plain engine (P = 1) has one program: its engine graph is the prefill program itself.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from speedc.format import contract
from speedc.format.artifact import is_weight_name
from speedc.errors import BuildError
from speedc.passes.base import CompileState, register_pass


def _shared_constant(constant: gs.Constant) -> bool:
    """A constant both branches read under its own name from the outer scope (a weight in weights.bin);
    computed tables keep a copy per branch, under the branch's prefix."""
    return is_weight_name(constant.name) or isinstance(constant._values, LazyValues)


def _merged_shape(name: str, known: gs.Variable, other: gs.Variable) -> list | None:
    if known.dtype != other.dtype or (known.shape is not None and other.shape is not None
                                      and len(known.shape) != len(other.shape)):
        raise BuildError(f"internal: merge_programs: {name} is {known.dtype} {known.shape} in one program and "
                         f"{other.dtype} {other.shape} in another")
    if known.shape is None or other.shape is None:
        return None
    return list(contract.merged_shape(known.shape, other.shape))


def _replace_input(tensor: gs.Tensor, replacement: gs.Tensor) -> None:
    """Every node reading TENSOR reads REPLACEMENT instead."""
    for consumer in list(tensor.outputs):
        for i, used in enumerate(consumer.inputs):
            if used is tensor:
                consumer.inputs[i] = replacement


class _Outer:
    """The engine graph's outer scope as the branches are moved in: one input per name, one hoisted
    Cast per (weight, dtype), the outputs by name."""

    def __init__(self) -> None:
        self.inputs: dict[str, gs.Variable] = {}
        self.casts: dict[tuple[str, int], gs.Variable] = {}
        self.nodes: list[gs.Node] = []
        self.outputs: dict[str, gs.Variable] = {}

    def take_inputs(self, graph: gs.Graph) -> None:
        for var in graph.inputs:
            outer = self.inputs.get(var.name)
            if outer is None:
                outer = self.inputs[var.name] = gs.Variable(var.name, var.dtype, var.shape)
            else:
                outer.shape = _merged_shape(var.name, outer, var)
            _replace_input(var, outer)
        graph.inputs = []

    def hoist_casts(self, graph: gs.Graph) -> None:
        """A Cast of a shared weight runs in the outer scope, once for both branches (ONNX Runtime
        folds it there into one fp32 initializer)."""
        kept = []
        for node in graph.nodes:
            source = node.inputs[0] if node.op == "Cast" else None
            if not (isinstance(source, gs.Constant) and _shared_constant(source)):
                kept.append(node)
                continue
            key = (source.name, int(node.attrs["to"]))
            cast = self.casts.get(key)
            if cast is None:
                out = node.outputs[0]
                cast = self.casts[key] = gs.Variable(f"{source.name}.cast{key[1]}", out.dtype, out.shape)
                self.nodes.append(gs.Node("Cast", f"{cast.name}/Cast", attrs={"to": key[1]}, inputs=[source], outputs=[cast]))
            _replace_input(node.outputs[0], cast)
            node.inputs.clear()
            node.outputs.clear()
        graph.nodes = kept

    def take_outputs(self, graph: gs.Graph) -> None:
        for var in graph.outputs:
            outer = self.outputs.get(var.name)
            if outer is None:
                self.outputs[var.name] = gs.Variable(var.name, var.dtype, var.shape)
            else:
                outer.shape = _merged_shape(var.name, outer, var)


def _prefix_branch(graph: gs.Graph, prefix: str, outer: _Outer) -> dict[str, gs.Variable]:
    """Give every tensor and node the branch owns a name of its own (ONNX Runtime wants one name per
    value across a model's subgraphs). Returns its outputs by their contract names."""
    outputs = {var.name: var for var in graph.outputs}
    scope = set(map(id, outer.inputs.values())) | set(map(id, outer.casts.values()))
    for tensor in graph.tensors().values():
        if id(tensor) in scope or (isinstance(tensor, gs.Constant) and _shared_constant(tensor)):
            continue
        tensor.name = prefix + tensor.name
    for node in graph.nodes:
        node.name = prefix + (node.name or node.op)
    return outputs


def _branch_outputs(graph: gs.Graph, prefix: str, own: dict[str, gs.Variable], outer: _Outer) -> None:
    """The branch's outputs in the engine's order; an output of the other program is an empty tensor."""
    outputs = []
    for name, var in outer.outputs.items():
        if name in own:
            outputs.append(own[name])
            continue
        rank = len(var.shape) if var.shape is not None else 1
        empty = gs.Variable(f"{prefix}{name}.none", var.dtype, [0] * rank)
        graph.nodes.append(gs.Node("Constant", f"{prefix}{name}.none/Constant",
                                   attrs={"value": gs.Constant(f"{prefix}{name}.none.value", np.zeros([0] * rank, var.dtype))},
                                   outputs=[empty]))
        outputs.append(empty)
    graph.outputs = outputs


def merge_variant(programs: list[tuple[str, gs.Graph]], name: str) -> gs.Graph:
    """The engine graph NAME of PROGRAMS [(prefill, graph), (batch step, graph)] (one: that graph)."""
    if len(programs) == 1:
        graph = programs[0][1]
        graph.name = name
        return graph
    outer = _Outer()
    for program, graph in programs:
        outer.take_inputs(graph)
        outer.hoist_casts(graph)
        outer.take_outputs(graph)
    for program, graph in programs:
        prefix = program.removesuffix(contract.FUSED_SUFFIX) + "/"
        own = _prefix_branch(graph, prefix, outer)
        _branch_outputs(graph, prefix, own, outer)
        graph.name = prefix.rstrip("/")
    (_, prefill_graph), (_, step_graph) = programs
    run_step = gs.Variable(contract.RUN_STEP, np.bool_, [])
    branch = gs.Node("If", "engine/If", attrs={"then_branch": step_graph, "else_branch": prefill_graph},
                     inputs=[run_step], outputs=list(outer.outputs.values()))
    return gs.Graph(nodes=[*outer.nodes, branch], inputs=[run_step, *outer.inputs.values()],
                    outputs=list(outer.outputs.values()), name=name, opset=prefill_graph.opset,
                    import_domains=prefill_graph.import_domains)


@register_pass("merge_programs", phase="finalize", requires=("programs", "schedule", "clean"),
               provides=("engine_graph",),
               consumes=("programs",))
def merge_programs(state: CompileState) -> CompileState:
    """Each variant's prefill and batch step become one engine graph (one session, one copy of the weights)."""
    merged = {}
    for engine in contract.GRAPHS:
        names = [program + contract.variant(engine) for program in contract.PROGRAMS]
        programs = [(name, state.graphs[name]) for name in names if name in state.graphs]
        if not programs:
            continue
        if [p for p, _ in programs] != list(contract.engine_programs(engine, state.schedule.slots)):
            raise BuildError(f"internal: merge_programs: variant {engine} has {[p for p, _ in programs]}, not every program "
                             f"a P = {state.schedule.slots} engine runs")
        merged[engine] = merge_variant(programs, engine)
    unknown = sorted(set(state.graphs) - {p + contract.variant(e) for e in merged for p in contract.PROGRAMS})
    if unknown:
        raise BuildError(f"internal: merge_programs found graph {unknown[0]!r}, which no engine graph holds")
    state.graphs = merged
    return state
