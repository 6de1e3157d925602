r"""Pass `exit_heads` (phase lowering): the prefill graph's final head, with argmax in-graph (the batch
step graph emits its own heads: passes/batch_step_graph.py).

    prefill graph:
      hidden.{N-1} [B*L,H] --each row's last real token (chunk_lengths)--> final RMSNorm -> Gemm -> logits [B,V]
                                                                                           -> next_token [B]

A looped model's loop-boundary norm has already normalized the state a head reads (Ouro's exit after
loop 1, its final after the last loop): there the RMSNorm is left out (config final_norm, exit norm None).
The heads are emitted here from the stored weights (not the traced ones) so that the exit point the
share pass chose is honoured. Full logits are an output the runtime fetches only when sampling.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import add_layer, reshape, tensor
from speedc.passes.source_weights import weight_constant
from speedc.passes.trace import TRACED_HEADS


def weight(graph: gs.Graph, state: CompileState, name: str) -> gs.Constant:
    """The graph's initializer `name`, or (when the pipeline cut removed its last use) a constant with
    the same name and values from the checkpoint, so both graphs still share one stored copy."""
    found = graph.tensors().get(name)
    if isinstance(found, gs.Constant):
        return found
    return weight_constant(name, state.weights[name])


def emit_rms_norm(graph: gs.Graph, x: gs.Tensor, weight: gs.Constant, eps: float, prefix: str) -> gs.Tensor:
    """x [R, H] -> weight * x / sqrt(mean(x^2) + eps). Written as Pow(x, 2) -> ReduceMean -> Add -> Sqrt
    -> Div -> Mul, the pattern ONNX Runtime fuses into one SimplifiedLayerNormalization (x * x is not).
    The exponent is a [1] tensor, not the traced layers' scalar: where a head reads the same token rows
    as the next layer's norm (an exit tap inside a stage), equal constants would let ONNX Runtime's
    common-subexpression pass merge the two Pow/ReduceMean, then fuse neither norm, so two step graphs
    running different head rows computed that layer differently (measured: last-bit differences in
    hidden_out, which SPEED's losslessness forbids)."""
    two = gs.Constant(f"{prefix}.two", np.array([2.0], dtype=np.float32))  # [1], not a scalar: see below
    squared = add_layer(graph, op="Pow", inputs=[x, two], outputs=[f"{prefix}.sq"], name=f"{prefix}/Pow_sq")[0]
    mean = add_layer(graph, op="ReduceMean", inputs=[squared], outputs=[f"{prefix}.mean"], attrs={"axes": [-1], "keepdims": 1},
                            name=f"{prefix}/ReduceMean")[0]
    eps_c = gs.Constant(f"{prefix}.eps", np.array([eps], dtype=np.float32))
    shifted = add_layer(graph, op="Add", inputs=[mean, eps_c], outputs=[f"{prefix}.shifted"], name=f"{prefix}/Add_eps")[0]
    root = add_layer(graph, op="Sqrt", inputs=[shifted], outputs=[f"{prefix}.root"], name=f"{prefix}/Sqrt")[0]
    normed = add_layer(graph, op="Div", inputs=[x, root], outputs=[f"{prefix}.normed"], name=f"{prefix}/Div")[0]
    return add_layer(graph, op="Mul", inputs=[normed, weight], outputs=[f"{prefix}.out"], name=f"{prefix}/Mul_w")[0]


def _lm_head(graph: gs.Graph, state: CompileState) -> gs.Constant:
    name = "model.embed_tokens.weight" if state.cfg.tie_word_embeddings else "lm_head.weight"
    return weight(graph, state, name)


def maybe_norm(graph: gs.Graph, state: CompileState, rows: gs.Tensor, norm_weight: str | None, prefix: str) -> gs.Tensor:
    """rows [R, H] through the RMSNorm NORM_WEIGHT, or as they are (None: a loop-normed state)."""
    if norm_weight is None:
        return rows
    return emit_rms_norm(graph, rows, weight(graph, state, norm_weight), state.cfg.rms_norm_eps, prefix)


def final_norm_weight(state: CompileState) -> str | None:
    """The final readout's norm, as the depth plan says (None: the last repeat's norm already applied)."""
    return "model.norm.weight" if (state.depth_plan or state.cfg.depth_plan).final_norm else None


def emit_head(graph: gs.Graph, state: CompileState, rows: gs.Tensor, norm_weight: str | None, prefix: str,
              logits_name: str, token_name: str) -> tuple[gs.Tensor, gs.Tensor]:
    """rows [R, H] -> logits [R, V], argmax tokens [R] (int64)."""
    normed = maybe_norm(graph, state, rows, norm_weight, prefix)
    return _logits_and_tokens(graph, state, normed, prefix, logits_name, token_name)


def _logits_and_tokens(graph: gs.Graph, state: CompileState, normed: gs.Tensor, prefix: str, logits_name: str,
                       token_name: str) -> tuple[gs.Tensor, gs.Tensor]:
    """normed rows [R, H] -> logits [R, V] (one LM-head Gemm), argmax tokens [R] (int64)."""
    logits = add_layer(graph, op="Gemm", inputs=[normed, _lm_head(graph, state)], outputs=[logits_name],
                              attrs={"transB": 1}, name=f"{prefix}/Gemm_lm_head")[0]
    token = add_layer(graph, op="ArgMax", inputs=[logits], outputs=[token_name], attrs={"axis": -1, "keepdims": 0},
                             name=f"{prefix}/ArgMax")[0]
    logits.dtype, token.dtype = np.float32, np.int64
    return logits, token


def hidden_output(graph: gs.Graph, rows: gs.Tensor, shape: list) -> gs.Tensor:
    """The token rows [R, H] a stage ends with as the contract's hidden_out [R, 1, H]."""
    out = reshape(graph, rows, [-1, 1, shape[-1]], contract.HIDDEN_OUT)
    out.dtype, out.shape = np.float32, shape
    return out


def add_prefill_head(graph: gs.Graph, state: CompileState) -> None:
    """hidden.{N-1}: token rows [B*L, H], row b's L tokens contiguous; the head reads each row's last real
    token (row b holds chunk_lengths[b] tokens, then right padding: prompts of different lengths in one run).

        b = Range(B)  [B]
        [B*L, H] -- Gather(b*L + chunk_lengths - 1) -- [B, H] -- head
    """
    cfg = state.cfg
    last_hidden = tensor(graph, f"hidden.{cfg.num_hidden_layers - 1}")
    lengths = gs.Variable(contract.CHUNK_LENGTHS, np.int64, ["batch"])
    graph.inputs.append(lengths)
    ids_shape = add_layer(graph, op="Shape", inputs=[tensor(graph, contract.INPUT_IDS)], outputs=["final_head.ids_shape"],
                          name="final_head/Shape_ids")[0]  # [2] = (B, L)
    consts = {k: gs.Constant(f"final_head.{k}", np.array(v, np.int64)) for k, v in
              (("zero", 0), ("one", 1), ("second", [1]), ("third", [2]))}
    batch = add_layer(graph, op="Gather", inputs=[ids_shape, consts["zero"]], outputs=["final_head.B"], attrs={"axis": 0},
                      name="final_head/Gather_B")[0]  # scalar B
    chunk = add_layer(graph, op="Slice", inputs=[ids_shape, consts["second"], consts["third"]], outputs=["final_head.L"],
                      name="final_head/Slice_L")[0]  # [1] L
    rows = add_layer(graph, op="Range", inputs=[consts["zero"], batch, consts["one"]], outputs=["final_head.rows"],
                     name="final_head/Range_rows")[0]  # [B]
    starts = add_layer(graph, op="Mul", inputs=[rows, chunk], outputs=["final_head.row_starts"], name="final_head/Mul_L")[0]  # [B] b*L
    ends = add_layer(graph, op="Add", inputs=[starts, lengths], outputs=["final_head.row_ends"], name="final_head/Add_lengths")[0]
    index = add_layer(graph, op="Sub", inputs=[ends, gs.Constant("final_head.one_1d", np.array([1], np.int64))],
                      outputs=["final_head.last_index"], name="final_head/Sub_one")[0]  # [B] b*L + len_b - 1
    last = add_layer(graph, op="Gather", inputs=[last_hidden, index], outputs=["last_hidden"], attrs={"axis": 0},
                     name="final_head/Gather_last")[0]  # [B, H]
    logits, token = emit_head(graph, state, last, final_norm_weight(state),
                              "final_head", contract.LOGITS, contract.NEXT_TOKEN)
    token.shape, logits.shape = ["batch"], ["batch", cfg.vocab_size]  # one row per sequence (batched plain decoding)
    presents = [t for t in graph.outputs if t.name.startswith("present.")]
    graph.outputs = [token, logits, *presents]


@register_pass("exit_heads", phase="lowering", requires=("programs", "layer_presents"), provides=("heads",))
def exit_heads(state: CompileState) -> CompileState:
    """Attach the final head (norm, LM head, argmax) to the prefill graph."""
    graph = state.graphs[contract.PREFILL]
    # The traced heads (logits / exit_logits at the traced exit point) are replaced.
    graph.outputs = [t for t in graph.outputs if t.name not in TRACED_HEADS]
    for t in graph.tensors().values():
        if t.name in TRACED_HEADS and not isinstance(t, gs.Constant):
            t.name = f"traced_{t.name}"
    add_prefill_head(graph, state)
    state.graphs[contract.PREFILL] = graph.cleanup(remove_unused_graph_inputs=True).toposort()
    return state
