"""gqa_attention replaces everything between a layer's q/k/v projections and its o_proj (and the rotary
tables and masks feeding it) with one GroupQueryAttention node. Whatever it replaces must be what that
node computes: an op it does not reproduce (a q/k norm, a soft-cap on the scores, a scaled rope, a
sliding-window mask, another score scale) is refused in one line naming it, never silently dropped.

Each test takes the standard step graph the pipeline hands the pass, adds one such op, and runs the pass.
Model: hidden 64, 4 heads (head_dim 16, the kernel's multiple), 2 kv heads, 6 layers over 2 blocks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from conftest import random_config, randomize
from speedc.build import PASS_ORDER
from speedc.errors import BuildError
from speedc.models.checkpoint.torch_io import sources_from_state
from speedc.models.llama import SharedLlama
from speedc.passes.base import BuildOptions, CompileState, run_passes
from speedc.passes.gqa_attention import _layers, attention_path
from speedc.passes.graph_utils import replace_uses


@pytest.fixture(scope="module")
def before_gqa() -> CompileState:
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)), seed=12)
    state = CompileState(model.cfg, sources_from_state(model.state_dict()), BuildOptions())
    return run_passes(state, PASS_ORDER[:PASS_ORDER.index("gqa_attention")])[0]


def _fork(state: CompileState) -> CompileState:
    return dataclasses.replace(state, graphs={n: g.copy() for n, g in state.graphs.items()}, facts=set(state.facts),
                               consumed_by=dict(state.consumed_by), notes=list(state.notes))


def _ops(graph: gs.Graph) -> Counter:
    return Counter(node.op for node in graph.nodes)


def _insert_after(graph: gs.Graph, tensor: gs.Tensor, op: str, *extra: gs.Tensor, name: str, attrs=None) -> gs.Tensor:
    """Every reader of TENSOR reads op(TENSOR, *EXTRA) instead; returns the new tensor."""
    out = gs.Variable(f"{name}.out", np.float32)
    replace_uses(tensor, out)
    graph.nodes.append(gs.Node(op, name, attrs=attrs or {}, inputs=[tensor, *extra], outputs=[out]))
    return out


def _refusal(state: CompileState) -> str:
    with pytest.raises(BuildError) as refused:
        run_passes(state, ["gqa_attention"])
    message = str(refused.value)
    assert "\n" not in message and "GroupQueryAttention does not compute that" in message
    return message


def _step_layer(state: CompileState, layer: int = 0):
    graph = state.graphs["batch_step"]
    return graph, _layers(graph)[layer]


def _constant_node_value(tensor: gs.Tensor) -> np.ndarray:
    return tensor.inputs[0].attrs["value"].values


def _set_constant_node_value(tensor: gs.Tensor, values: np.ndarray) -> None:
    """A new value for the Constant node producing TENSOR (graph copies share the old value object)."""
    tensor.inputs[0].attrs["value"] = gs.Constant(f"{tensor.name}.edited", values)


def test_the_standard_graph_still_fuses(before_gqa):
    """Before: the standard step graph, its attention in plain ops; after: one GroupQueryAttention a layer."""
    after = run_passes(_fork(before_gqa), ["gqa_attention"])[0]
    standard, fused = _ops(after.graphs["batch_step"]), _ops(after.graphs["batch_step.gqa"])
    assert standard["Softmax"] == 2 and standard["GroupQueryAttention"] == 0 and standard["Cos"] == 1
    assert fused["GroupQueryAttention"] == 2 and fused["Softmax"] == 0 and fused["Neg"] == 0
    assert sum(fused.values()) < sum(standard.values()) / 2  # rotary, masks, split softmax: gone
    assert fused["Gemm"] == standard["Gemm"]  # the projections and heads stay


def test_a_q_norm_is_refused_by_name(before_gqa):
    """Q-norm (an RMSNorm on q before rotary): its ReduceMean is not an op the fused attention has."""
    state = _fork(before_gqa)
    graph, (q2d, *_) = _step_layer(state)
    square = _insert_after(graph, q2d, "Mul", q2d, name="q_norm/Pow")
    mean = _insert_after(graph, square, "ReduceMean", name="q_norm/ReduceMean", attrs={"axes": [-1], "keepdims": 1})
    _insert_after(graph, mean, "Sqrt", name="q_norm/Sqrt")  # (enough of the norm to show the refusal)
    graph.toposort()
    message = _refusal(state)
    assert "ReduceMean node 'q_norm/ReduceMean'" in message and "layer 0 (model.blocks.0.self_attn) of graph speedc_batch_step" in message


def test_a_q_norm_weight_alone_is_refused_by_count(before_gqa):
    """A Mul by a weight on k has only ops attention also uses: the path then has one Mul too many."""
    state = _fork(before_gqa)
    graph, (_, k2d, _, _) = _step_layer(state, layer=1)
    weight = gs.Constant("k_norm.weight", np.full(32, 1.5, np.float32))
    _insert_after(graph, k2d, "Mul", weight, name="k_norm/Mul")
    message = _refusal(state)
    assert "6 Mul nodes on the attention path of layer 1 (model.blocks.1.self_attn)" in message
    assert "has 5" in message


def test_a_tanh_soft_cap_on_the_scores_is_refused_by_name(before_gqa):
    state = _fork(before_gqa)
    graph, layer = _step_layer(state)
    scores = next(n for n in attention_path(*layer) if n.op == "MatMul")  # q·k over the past keys
    _insert_after(graph, scores.outputs[0], "Tanh", name="softcap/Tanh")
    assert "Tanh node 'softcap/Tanh' on the attention path of layer 0" in _refusal(state)


def test_another_score_scale_is_refused(before_gqa):
    """Gemma-style query_pre_attn_scalar: scores scaled by something other than 1/sqrt(head_dim)."""
    state = _fork(before_gqa)
    graph, layer = _step_layer(state)
    scale = next(n for n in attention_path(*layer) if n.op == "Mul" and n.inputs[1].inputs
                 and n.inputs[1].inputs[0].op == "Constant")
    assert np.isclose(float(_constant_node_value(scale.inputs[1])), 16 ** -0.5)
    _set_constant_node_value(scale.inputs[1], np.array(1 / 12, np.float32))
    assert "scales its scores by 0.0833333" in _refusal(state)


def test_a_scaled_rope_is_refused(before_gqa):
    """Linear rope scaling divides the frequencies: same ops, other values."""
    state = _fork(before_gqa)
    graph = state.graphs["batch_step"]
    freqs_mul = next(n for n in graph.nodes if n.op == "Cos")
    while freqs_mul.op != "Mul":  # Cos <- Unsqueeze <- Concat(freqs, freqs) <- Mul(positions, inv_freq)
        freqs_mul = freqs_mul.inputs[0].inputs[0]
    frequencies = _constant_node_value(freqs_mul.inputs[1])
    assert frequencies.shape == (8,)  # head_dim / 2
    _set_constant_node_value(freqs_mul.inputs[1], (frequencies / 8).astype(np.float32))
    assert "graph speedc_batch_step rotates by other frequencies than rope_theta's" in _refusal(state)


def test_a_sliding_window_mask_is_refused_by_name(before_gqa):
    """A window narrows the causal mask with one more comparison (here: an And into the mask's Where)."""
    state = _fork(before_gqa)
    graph = state.graphs["batch_step"]
    causal = next(n for n in graph.nodes if n.op == "LessOrEqual")
    _insert_after(graph, causal.outputs[0], "And", causal.outputs[0], name="window/And")
    graph.toposort()
    assert "And node 'window/And' feeds the attention of graph speedc_batch_step" in _refusal(state)
