r"""Pass `step_graph` (phase lowering): the decode program -> SPEED's P-slot step graph.

    decode program (B rows, N layers)            step graph (P slots, one stage of S = N/P layers)

    input_ids [B,L] -> embed                     input_ids [1,1] -> embed [1,H] ----------------\\
                         |                                                                     Concat -> [P,H]
                      layer 0 .. N-1             hidden_in [P-1,1,H] (slots 1..P-1) -- Reshape --/        |
                                                                                  layers 0 .. S-1 (batched)
                                                                                           |
                                                                                hidden.{S-1} [P,H]

Row s of the batch is slot s: it carries the token at position positions[s] and reads the cache
inputs of stage layer j, whose row s holds logical layer s*S + j. Because the stage's block sequence
is the same for every slot (the schedule pass guarantees it), each unique weight feeds ONE Gemm over
all P rows per step. Layers S..N-1 fall away as dead code. The plain N-layer program stays as the
`prefill` graph (prompt chunks, and one token at a time in autoregressive mode).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc import contract
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import replace_uses, reshape, tensor


def enter_slots(graph: gs.Graph, entering: str | int, behind: str | int, rows: str | int, hidden_size: int) -> gs.Tensor:
    """The entry of a step graph (single-sequence or batch): the embedded tokens entering slot 0 (ENTERING
    rows) and the contract's hidden_in [BEHIND, 1, H] (slots 1..P-1) concatenated into the ROWS token
    rows the stage layers run. Returns hidden_in (a graph input)."""
    embeddings = tensor(graph, "embeddings")
    _relabel_rows(graph, embeddings, [entering, hidden_size], [rows, hidden_size])
    hidden_in = gs.Variable(contract.HIDDEN_IN, dtype=np.float32, shape=[behind, 1, hidden_size])
    slot_inputs = gs.Variable("slot_inputs", dtype=np.float32, shape=[rows, hidden_size])
    replace_uses(embeddings, slot_inputs)
    graph.nodes.append(gs.Node("Concat", "slot_inputs_concat", attrs={"axis": 0},
                               inputs=[embeddings, reshape(graph, hidden_in, [-1, hidden_size], "hidden_in.rows")],
                               outputs=[slot_inputs]))
    return hidden_in


def _relabel_rows(graph: gs.Graph, embeddings: gs.Tensor, embedded: list, layer_rows: list) -> None:
    """The traced program's token rows (embeddings, every layer's tensors) share one row count, "rows" =
    B*L; a step graph's do not (its embeddings are the entering tokens, its layers run every slot). The
    traced shapes of the tensors in between are dropped (ONNX Runtime infers them) and the two row counts
    labelled apart, or shape inference would equate them and refuse the graph."""
    inputs = {id(t) for t in graph.inputs}
    for t in graph.tensors().values():
        if not isinstance(t, gs.Constant) and id(t) not in inputs and not t.name.startswith("present."):
            t.shape = layer_rows if t.name.startswith("hidden.") else None
    embeddings.shape = embedded


def build_step_graph(decode: gs.Graph, slots: int, stage_layers: int, exit_layer: int, hidden_size: int) -> gs.Graph:
    graph = decode.copy()
    graph.name = "speedc_step"
    hidden_in = enter_slots(graph, 1, slots - 1, slots, hidden_size)
    input_ids, positions = tensor(graph, contract.INPUT_IDS), tensor(graph, contract.POSITIONS)
    input_ids.shape, positions.shape = [1, 1], [slots]
    past = []
    for layer in range(stage_layers):
        for kind in ("key", "value"):
            t = tensor(graph, f"past.{kind}.{layer}")
            t.shape = [slots, t.shape[1], "context", t.shape[3]]
            past.append(t)
    graph.inputs = [input_ids, positions, hidden_in, *past]
    outputs = [tensor(graph, f"hidden.{stage_layers - 1}"), tensor(graph, f"hidden.{exit_layer - 1}")]
    outputs += [tensor(graph, f"present.{kind}.{layer}") for layer in range(stage_layers) for kind in ("key", "value")]
    graph.outputs = list({t.name: t for t in outputs}.values())  # exit tap may be the stage output itself
    return graph.cleanup(remove_unused_graph_inputs=True).toposort()


@register_pass("step_graph", phase="lowering", requires=("decode_program", "schedule"),
               provides=("programs", "layer_presents"), consumes=("decode_program",))
def step_graph(state: CompileState) -> CompileState:
    """Rewrite the decode program into the P-slot step graph with one weight load per block per step."""
    decode = state.graphs.pop("decode")
    sched = state.schedule
    if sched.speculative and sched.depth_plan.get("prelude") == sched.depth_plan.get("coda") == []:  # a cycle only
        state.graphs[contract.STEP] = build_step_graph(decode, sched.slots, sched.stage_layers, state.exit_layer,
                                                state.cfg.hidden_size)
        state.notes.append(f"step_graph: step graph with {sched.slots} slots x {sched.stage_layers} layers")
    state.graphs[contract.PREFILL] = decode
    return state
