r"""Pass `exit_heads` (phase lowering): early-exit and final heads, with argmax in-graph.

    step graph:
      hidden.{S-1} [P,1,H] --Gather row P-1--> [1,H] -> final RMSNorm -> Gemm(lm_head) -> final_logits [1,V]
                                                                                     \\-> ArgMax -> final_token [1]
      hidden.{exit-1} [P,1,H] -> [P,H] -> exit RMSNorm -> Gemm(lm_head) -> ArgMax -> exit_tokens [P]
      (row 0 is the speculation for the next position; deeper rows feed the early-flush check)

    prefill graph:
      hidden.{N-1} [1,L,H] --last position--> [1,H] -> final RMSNorm -> Gemm -> logits [1,V], next_token [1]

The heads are emitted here from the stored weights (not the traced ones) so that the exit point the
share pass chose is honoured. Full logits are an output the runtime fetches only when sampling.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import tensor


def weight(graph: gs.Graph, state: CompileState, name: str) -> gs.Constant:
    """The graph's initializer `name`, or (when the pipeline cut removed its last use) a constant with
    the same name and values from the checkpoint, so both graphs still share one stored copy."""
    found = graph.tensors().get(name)
    if isinstance(found, gs.Constant):
        return found
    return gs.Constant(name, state.tensors[name].float().numpy())


def emit_rms_norm(graph: gs.Graph, x: gs.Tensor, weight: gs.Constant, eps: float, prefix: str) -> gs.Tensor:
    """x [R, H] -> weight * x / sqrt(mean(x^2) + eps)."""
    squared = graph.layer(op="Mul", inputs=[x, x], outputs=[f"{prefix}.sq"], name=f"{prefix}/Mul_sq")[0]
    mean = graph.layer(op="ReduceMean", inputs=[squared], outputs=[f"{prefix}.mean"], attrs={"axes": [-1], "keepdims": 1},
                       name=f"{prefix}/ReduceMean")[0]
    eps_c = gs.Constant(f"{prefix}.eps", np.array([eps], dtype=np.float32))
    shifted = graph.layer(op="Add", inputs=[mean, eps_c], outputs=[f"{prefix}.shifted"], name=f"{prefix}/Add_eps")[0]
    root = graph.layer(op="Sqrt", inputs=[shifted], outputs=[f"{prefix}.root"], name=f"{prefix}/Sqrt")[0]
    normed = graph.layer(op="Div", inputs=[x, root], outputs=[f"{prefix}.normed"], name=f"{prefix}/Div")[0]
    return graph.layer(op="Mul", inputs=[normed, weight], outputs=[f"{prefix}.out"], name=f"{prefix}/Mul_w")[0]


def emit_head(graph: gs.Graph, state: CompileState, rows: gs.Tensor, norm_weight: str, prefix: str,
              logits_name: str, token_name: str) -> tuple[gs.Tensor, gs.Tensor]:
    """rows [R, H] -> logits [R, V], argmax tokens [R] (int64)."""
    cfg = state.cfg
    lm_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    normed = emit_rms_norm(graph, rows, weight(graph, state, norm_weight), cfg.rms_norm_eps, prefix)
    logits = graph.layer(op="Gemm", inputs=[normed, weight(graph, state, lm_head)], outputs=[logits_name],
                         attrs={"transB": 1}, name=f"{prefix}/Gemm_lm_head")[0]
    token = graph.layer(op="ArgMax", inputs=[logits], outputs=[token_name], attrs={"axis": -1, "keepdims": 0},
                        name=f"{prefix}/ArgMax")[0]
    logits.dtype, token.dtype = np.float32, np.int64
    logits.name, token.name = logits_name, token_name  # graph.layer uniquifies names; outputs need exact ones
    return logits, token


def _rows(graph: gs.Graph, hidden: gs.Tensor, hidden_size: int, name: str) -> gs.Tensor:
    shape = gs.Constant(f"{name}.shape", np.array([-1, hidden_size], dtype=np.int64))
    return graph.layer(op="Reshape", inputs=[hidden, shape], outputs=[name], name=f"{name}/Reshape")[0]


def add_step_heads(graph: gs.Graph, state: CompileState) -> None:
    cfg, sched = state.cfg, state.schedule
    stage_out = tensor(graph, f"hidden.{sched.stage_layers - 1}")
    exit_tap = tensor(graph, f"hidden.{state.exit_layer - 1}")
    oldest_index = gs.Constant("oldest_slot", np.array([sched.slots - 1], dtype=np.int64))
    oldest = graph.layer(op="Gather", inputs=[stage_out, oldest_index], outputs=["oldest_hidden"], attrs={"axis": 0},
                         name="final_head/Gather_oldest")[0]
    final_logits, final_token = emit_head(graph, state, _rows(graph, oldest, cfg.hidden_size, "oldest_rows"),
                                          "model.norm.weight", "final_head", "final_logits", "final_token")
    exit_rows = _rows(graph, exit_tap, cfg.hidden_size, "exit_rows")
    _, exit_tokens = emit_head(graph, state, exit_rows, state.exit_norm, "exit_head", "exit_logits", "exit_tokens")
    stage_out.name = "hidden_out"
    final_token.shape, final_logits.shape, exit_tokens.shape = [1], [1, cfg.vocab_size], [sched.slots]
    stage_out.shape = [sched.slots, 1, cfg.hidden_size]
    presents = [t for t in graph.outputs if t.name.startswith("present.")]
    graph.outputs = [final_token, final_logits, exit_tokens, stage_out, *presents]


def add_prefill_head(graph: gs.Graph, state: CompileState) -> None:
    cfg = state.cfg
    last_hidden = tensor(graph, f"hidden.{cfg.num_hidden_layers - 1}")
    starts, ends, axes = (gs.Constant(f"last_position.{n}", np.array([v], dtype=np.int64))
                          for n, v in (("starts", -1), ("ends", np.iinfo(np.int64).max), ("axes", 1)))
    last = graph.layer(op="Slice", inputs=[last_hidden, starts, ends, axes], outputs=["last_hidden"],
                       name="final_head/Slice_last")[0]
    logits, token = emit_head(graph, state, _rows(graph, last, cfg.hidden_size, "last_rows"), "model.norm.weight",
                              "final_head", "logits", "next_token")
    token.shape, logits.shape = [1], [1, cfg.vocab_size]
    presents = [t for t in graph.outputs if t.name.startswith("present.")]
    graph.outputs = [token, logits, *presents]


@register_pass("exit_heads", phase="lowering")
def exit_heads(state: CompileState) -> CompileState:
    """Attach the early-exit and final heads (norm, LM head, argmax) to the step and prefill graphs."""
    for name, add in (("step", add_step_heads), ("prefill", add_prefill_head)):
        if name in state.graphs:
            graph = state.graphs[name]
            # The traced heads (logits / exit_logits at the traced exit point) are replaced.
            graph.outputs = [t for t in graph.outputs if t.name not in ("logits", "exit_logits")]
            for t in graph.tensors().values():
                if t.name in ("logits", "exit_logits") and not isinstance(t, gs.Constant):
                    t.name = f"traced_{t.name}"
            add(graph, state)
            state.graphs[name] = graph.cleanup(remove_unused_graph_inputs=True).toposort()
    return state
