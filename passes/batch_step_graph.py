r"""Pass `batch_step_graph` (phase lowering): the decode program -> the batch step graph, where n
sequences, each with its own P-slot SPEED pipeline, run one step together (R = P*n rows).

    rows are slot-major: row r = s*n + b is slot s of sequence b, so the rows of one slot are contiguous
    and "slot s's output feeds slot s+1" is "the first (P-1)n rows of hidden_out are the next hidden_in"

    input_ids [n,1] -> embed [n,H] ------------------\
                                                      Concat -> [R,H] -> stage layers 0..S-1 (one Gemm per
    hidden_in [(P-1)n,1,H] (slots 1..P-1) -- Reshape -/                   weight over all R rows)
                                                                              |
    cache.key.{j}.{s} [n,kvh,T,hd] (s < P) -- Concat (slot-major) --> past of stage layer j
                                                                              |
    hidden.{S-1} [R,H] -- Gather(final_rows) -> final norm --\
                                                              Concat -> Gemm(lm_head) [F+E,V]
    hidden.{exit-1} [R,H] -- Gather(exit_rows) -> exit norm --/    rows :F -> final_logits [F,V] -> ArgMax -> final_token [F]
                                                                     rows F: -> TopK -> exit_candidates [E,K] -> [:, 0] -> exit_tokens [E]
    hidden.{exit-1} [R,H] -- Gather(check_rows) -> exit norm -- scored over check_candidates [C,K] only
                                                                     -> check_tokens [C] (add_check_head)

The cache is a pool [S, P, B, kvh, T, hd] (stage layer, slot, sequence, ...): slot s of stage layer j
over the first n sequences is one contiguous slab pool[j, s, :n], bound without a copy. The same pool
serves plain decoding (the prefill graph with n rows reads pool[j, s, :n] as logical layer s*S + j),
so a batch can switch between SPEED and plain decoding step by step. Row counts (n, F, E, C) are dynamic:
a sequence joins or leaves between steps. The standard graph concatenates the P slabs of a stage layer
(a copy of the rows it reads); the fused variant (gqa_attention) reads each stage layer's whole pool as
one buffer, runs one GroupQueryAttention a layer over it, written in place, and computes only the rows
that hold a token (gqa_attention.BatchPool).

A depth plan with a prelude or coda (speedc/format/depth_plan.py) gets its batch step from
passes/phase_step_program.py instead (slot 0 runs the prelude, each readout its coda with its own
K/V); the heads below read its readouts. Standard graph only: the fused variant runs cycles. A cycle with
cross-repeat attention (IQuest-Coder-V1-Loop) gets its step there too: its later slots attend otherwise than slot 0.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.format.cache_layout import CORE
from speedc.passes.base import CompileState, register_pass
from speedc.passes.exit_heads import final_norm_weight, hidden_output, maybe_norm, weight
from speedc.passes.graph_utils import add_layer, linear_to_gemm, replace_uses, reshape, tensor, weight_constants


def enter_slots(graph: gs.Graph, entering: str | int, behind: str | int, rows: str | int, hidden_size: int) -> gs.Tensor:
    """The entry of the step graph: the embedded tokens entering slot 0 (ENTERING rows) and the contract's
    hidden_in [BEHIND, 1, H] (slots 1..P-1) concatenated into the ROWS token rows the stage layers run.
    Returns hidden_in (a graph input)."""
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
    B*L; the step graph's do not (its embeddings are the entering tokens, its layers run every slot). The
    traced shapes of the tensors in between are dropped (ONNX Runtime infers them) and the two row counts
    labelled apart, or shape inference would equate them and refuse the graph."""
    inputs = {id(t) for t in graph.inputs}
    for t in graph.tensors().values():
        if not isinstance(t, gs.Constant) and id(t) not in inputs and not t.name.startswith("present."):
            t.shape = layer_rows if t.name.startswith("hidden.") else None
    embeddings.shape = embedded


def _gather_rows(graph: gs.Graph, hidden: gs.Tensor, rows: gs.Tensor, name: str) -> gs.Tensor:
    """hidden [R, H] -> [len(rows), H]."""
    return add_layer(graph, op="Gather", inputs=[hidden, rows], outputs=[name], attrs={"axis": 0}, name=f"{name}/Gather")[0]


def _slice0(graph: gs.Graph, x: gs.Tensor, start: gs.Tensor, end: gs.Tensor, name: str, dtype, shape) -> gs.Tensor:
    """x[start:end] along axis 0 (start, end: [1] int64), a tensor named NAME (the heads' outputs)."""
    out = add_layer(graph, op="Slice", inputs=[x, start, end, gs.Constant(f"{name}.axes", np.array([0], np.int64))],
                           outputs=[name], name=f"{name}/Slice")[0]
    out.dtype, out.shape = dtype, shape
    return out


def add_batch_heads(graph: gs.Graph, state: CompileState, final_rows: gs.Tensor, exit_rows: gs.Tensor,
                    check_rows: gs.Tensor, check_candidates: gs.Tensor, taps: tuple[str, str] | None = None) -> list[gs.Tensor]:
    """Final head on FINAL_ROWS of the stage output, exit head on EXIT_ROWS of the exit tap: one LM-head
    Gemm; the exit rows' top-K ids; the early-flush checks on CHECK_ROWS over their CHECK_CANDIDATES.
    TAPS: (final, exit) readout tensors [R, H] to read instead (a depth plan's codas, phase_step_program)."""
    cfg, sched = state.cfg, state.schedule
    stage_out = tensor(graph, f"hidden.{sched.stage_layers - 1}")
    final_tap, exit_tap = ((stage_out, tensor(graph, f"hidden.{state.exit_layer - 1}")) if taps is None
                           else (tensor(graph, taps[0]), tensor(graph, taps[1])))
    final_in = maybe_norm(graph, state, _gather_rows(graph, final_tap, final_rows, "batch_final_rows"),
                          final_norm_weight(state), "batch_final_head")  # [F, H]
    exit_in = maybe_norm(graph, state, _gather_rows(graph, exit_tap, exit_rows, "batch_exit_rows"),
                         state.exit_norm, "batch_exit_head")  # [E, H]
    both = add_layer(graph, op="Concat", inputs=[final_in, exit_in], outputs=["batch_head_rows"], attrs={"axis": 0},
                            name="batch_heads/Concat_rows")[0]  # [F+E, H]
    lm_head = weight(graph, state, "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    logits = add_layer(graph, op="Gemm", inputs=[both, lm_head], outputs=["batch_head_logits"], attrs={"transB": 1},
                              name="batch_heads/Gemm_lm_head")[0]  # [F+E, V]
    f = add_layer(graph, op="Shape", inputs=[final_rows], outputs=["batch_final_count"], name="batch_heads/Shape_F")[0]  # [1]
    zero = gs.Constant("batch_heads.zero", np.array([0], np.int64))
    final_logits = _slice0(graph, logits, zero, f, contract.FINAL_LOGITS, np.float32, ["final_rows", cfg.vocab_size])  # [F, V]
    final_token = add_layer(graph, op="ArgMax", inputs=[final_logits], outputs=[contract.FINAL_TOKEN],
                            attrs={"axis": -1, "keepdims": 0}, name="batch_heads/ArgMax_final")[0]  # [F]
    final_token.dtype, final_token.shape = np.int64, ["final_rows"]
    every_row = gs.Constant("batch_heads.end", np.array([np.iinfo(np.int64).max], np.int64))
    exit_logits = _slice0(graph, logits, f, every_row, "batch_exit_logits", np.float32, ["exit_rows", cfg.vocab_size])  # [E, V]
    # The exit rows' argmax is their top candidate (TopK breaks ties toward the lower id, as ArgMax does):
    # one pass over their logits, not two.
    candidates = contract.candidate_count(cfg.vocab_size)
    exit_candidates = add_layer(graph, op="TopK", inputs=[exit_logits, gs.Constant("batch_heads.k", np.array([candidates], np.int64))],
                                outputs=["batch_exit_top_values", contract.EXIT_CANDIDATES], attrs={"axis": -1},
                                name="batch_heads/TopK")[1]  # [E, K]
    exit_candidates.dtype, exit_candidates.shape = np.int64, ["exit_rows", candidates]
    exit_tokens = add_layer(graph, op="Gather", inputs=[exit_candidates, gs.Constant("batch_heads.first", np.array(0, np.int64))],
                            outputs=[contract.EXIT_TOKENS], attrs={"axis": 1}, name="batch_heads/Gather_top")[0]  # [E]
    exit_tokens.dtype, exit_tokens.shape = np.int64, ["exit_rows"]
    hidden_out = hidden_output(graph, stage_out, ["rows", 1, cfg.state_width])
    return [final_token, final_logits, exit_tokens, exit_candidates,
            add_check_head(graph, state, exit_tap, lm_head, check_rows, check_candidates), hidden_out]


def add_check_head(graph: gs.Graph, state: CompileState, exit_tap: gs.Tensor, lm_head: gs.Tensor, check_rows: gs.Tensor,
                   check_candidates: gs.Tensor) -> gs.Tensor:
    r"""Early-flush checks: the exit head on CHECK_ROWS scored over each row's K candidate ids only.
    A check asks whether a deeper exit still picks the speculated successor; the candidates are the top
    K of the token's first exit, where the deeper argmax lies (CHECK_CANDIDATE_COUNT), so a check costs
    K dot products instead of a vocabulary-wide head row (the batch step is compute-bound at 8 sequences).
    Its answer only steers speculation: verification at the last layer keeps every path lossless.

        exit tap [R, H] -- Gather(check_rows) -- exit norm -- Unsqueeze -- [C, 1, H] --\
        check_candidates [C, K] -- Gather(lm_head rows) -- [C, K, H] ----------------- Mul -- ReduceSum(H) -- [C, K]
        [C, K] -- ArgMax -- [C, 1] -- GatherElements(check_candidates) -- Reshape -- check_tokens [C]
    """
    rows = maybe_norm(graph, state, _gather_rows(graph, exit_tap, check_rows, "batch_check_rows"),
                      state.exit_norm, "batch_check_head")  # [C, H]
    rows_3d = add_layer(graph, op="Unsqueeze", inputs=[rows, gs.Constant("batch_check.axis1", np.array([1], np.int64))],
                        outputs=["batch_check_rows.3d"], name="batch_check/Unsqueeze")[0]  # [C, 1, H]
    head_rows = add_layer(graph, op="Gather", inputs=[lm_head, check_candidates], outputs=["batch_check_head_rows"],
                          attrs={"axis": 0}, name="batch_check/Gather_head_rows")[0]  # [C, K, H]
    products = add_layer(graph, op="Mul", inputs=[head_rows, rows_3d], outputs=["batch_check_products"],
                         name="batch_check/Mul")[0]  # [C, K, H]
    scores = add_layer(graph, op="ReduceSum", inputs=[products, gs.Constant("batch_check.axis2", np.array([2], np.int64))],
                       outputs=["batch_check_scores"], attrs={"keepdims": 0}, name="batch_check/ReduceSum")[0]  # [C, K]
    best = add_layer(graph, op="ArgMax", inputs=[scores], outputs=["batch_check_best"], attrs={"axis": 1, "keepdims": 1},
                     name="batch_check/ArgMax")[0]  # [C, 1]
    picked = add_layer(graph, op="GatherElements", inputs=[check_candidates, best], outputs=["batch_check_picked"],
                       attrs={"axis": 1}, name="batch_check/GatherElements")[0]  # [C, 1]
    out = reshape(graph, picked, [-1], contract.CHECK_TOKENS)  # [C]
    out.dtype, out.shape = np.int64, ["check_rows"]
    return out


def head_inputs(cfg) -> list[gs.Variable]:
    """final_rows, exit_rows, check_rows, check_candidates: the rows whose heads a step runs."""
    return [gs.Variable(contract.FINAL_ROWS, np.int64, ["final_rows"]), gs.Variable(contract.EXIT_ROWS, np.int64, ["exit_rows"]),
            gs.Variable(contract.CHECK_ROWS, np.int64, ["check_rows"]),
            gs.Variable(contract.CHECK_CANDIDATES, np.int64, ["check_rows", contract.candidate_count(cfg.vocab_size)])]


def bind_as_decoded(graph: gs.Graph, decode: gs.Graph, state: CompileState, program_inputs: list[str]) -> None:
    """GRAPH's parameter inputs -> constants over the same checkpoint tensors, under the same names, as
    the (shared) DECODE graph's: where the share pass merged equal weights (say every norm all ones) or
    renamed a block, the traced step reads the one stored copy the decode graph kept."""
    from speedc.passes.source_weights import source_weight, weight_constant
    from speedc.passes.trace import bind_weights

    decoded = {}
    for constant in weight_constants(decode.nodes):
        source = source_weight(constant)
        if source is not None and len(source.parts) == 1:
            decoded[constant.name] = source.parts[0]
    made: dict[str, gs.Constant] = {}
    for inp in [i for i in graph.inputs if i.name not in set(program_inputs)]:
        name = state.weight_aliases.get(inp.name, inp.name)
        if name in decoded:
            if name not in made:
                made[name] = weight_constant(name, decoded[name])
            replace_uses(inp, made[name])
            graph.inputs.remove(inp)
    bind_weights(graph, state, program_inputs)  # the rest (none where the decode graph reads every weight)


def build_phase_batch_step_graph(state: CompileState, decode: gs.Graph) -> gs.Graph:
    """The batch step of a depth plan with a prelude / coda: traced from phase_step_program (its diagram),
    the heads reading its readouts."""
    from speedc.passes.phase_step_program import READOUT_DRAFT, READOUT_FINAL, import_phase_step, slab_names
    from speedc.passes.trace import random_state

    cfg, sched = state.cfg, state.schedule
    # The family's plan: its block numbers are the checkpoint's (the decode program was traced with them).
    graph, layout = import_phase_step(cfg, cfg.depth_plan.pipeline(sched.slots, state.exit_layer))
    slabs = slab_names(layout)
    per_sequence = [contract.INITIAL_STATE] if random_state(cfg) else []
    per_sequence += [contract.READOUT_REPEATS] if cfg.depth_plan.recurrent else []
    bind_as_decoded(graph, decode, state, [contract.INPUT_IDS, contract.POSITIONS, contract.HIDDEN_IN, *per_sequence, *slabs])
    linear_to_gemm(graph)
    graph.name = "speedc_batch_step"
    heads = head_inputs(cfg)
    known = graph.tensors()
    graph.inputs = [known[contract.INPUT_IDS], known[contract.POSITIONS], known[contract.HIDDEN_IN], *heads,
                    *(known[name] for name in per_sequence), *(known[name] for name in slabs)]
    # a cycle's step (cross-repeat attention) returns no prelude / coda rows
    phase_rows = [t for t in graph.outputs if t.name.startswith("new_")] if layout.pipelined_phases else []
    presents = [t for t in graph.outputs if t.name.startswith("present.")]
    outputs = add_batch_heads(graph, state, *heads, taps=(READOUT_FINAL, READOUT_DRAFT))
    graph.outputs = outputs + presents + phase_rows
    return graph.cleanup(remove_unused_graph_inputs=False).toposort()


def build_batch_step_graph(decode: gs.Graph, state: CompileState) -> gs.Graph:
    cfg, sched = state.cfg, state.schedule
    layout = sched.cache_layout
    if layout.pipelined_phases or cfg.depth_plan.cross_window:
        return build_phase_batch_step_graph(state, decode)
    slots, stage_layers, hidden_size = layout.slots, layout.stage_layers, cfg.hidden_size
    graph = decode.copy()
    graph.name = "speedc_batch_step"
    hidden_in = enter_slots(graph, "sequences", "rows_behind", "rows", hidden_size)  # embeddings [n, H]
    input_ids, positions = tensor(graph, contract.INPUT_IDS), tensor(graph, contract.POSITIONS)
    input_ids.shape, positions.shape = ["sequences", 1], ["rows"]
    slabs = []
    known = graph.tensors()  # looked up once: graph.tensors() scans the whole graph
    for layer in range(stage_layers):
        for kind in contract.KV_KINDS:
            past = known[f"past.{kind}.{layer}"]  # becomes the slot-major concatenation of P slabs
            depths = range(layout.pool_layers(CORE)[1])  # the slots: core pool depths
            parts = [gs.Variable(contract.batch_cache_input(kind, layer, s), np.float32,
                                 ["sequences", cfg.num_key_value_heads, "context", cfg.head_dim]) for s in depths]
            graph.nodes.append(gs.Node("Concat", f"batch_cache/Concat_{kind}_{layer}", attrs={"axis": 0},
                                       inputs=parts, outputs=[past]))
            slabs += parts
    final_rows, exit_rows, check_rows, check_candidates = head_inputs(cfg)
    graph.inputs = [input_ids, positions, hidden_in, final_rows, exit_rows, check_rows, check_candidates, *slabs]
    heads = add_batch_heads(graph, state, final_rows, exit_rows, check_rows, check_candidates)
    presents = [known[f"present.{kind}.{layer}"] for layer in range(stage_layers) for kind in contract.KV_KINDS]
    graph.outputs = heads + presents
    return graph.cleanup(remove_unused_graph_inputs=False).toposort()


@register_pass("batch_step_graph", phase="lowering", requires=("decode_program", "schedule"),
               provides=("programs", "layer_presents"), consumes=("decode_program",))
def batch_step_graph(state: CompileState) -> CompileState:
    """The decode program becomes the prefill graph; beside it (P > 1) the batch step graph, one weight
    read per block per step for every row of every sequence."""
    decode = state.graphs.pop("decode")
    sched = state.schedule
    if sched.speculative:  # a plain engine batches through the prefill graph alone
        state.graphs[contract.BATCH_STEP] = build_batch_step_graph(decode, state)
        state.notes.append(f"batch_step_graph: {sched.slots} slots x {sched.stage_layers} layers per sequence, "
                           "dynamic sequence count")
    state.graphs[contract.PREFILL] = decode
    return state
