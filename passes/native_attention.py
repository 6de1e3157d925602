r"""Pass `native_attention` (phase finalize, after native_products): the fused engine graph's native twin runs
each layer's attention on speedc's kernel (runtimes/kernels/attention.h) over a float16 KV pool the runtime
holds, instead of GroupQueryAttention over fp32 cache buffers bound into ONNX Runtime.

    before (prefill):     qkv [B, L, w] ──┬─ GroupQueryAttention(cache.key.l, cache.value.l, seqlens_k, total,
                                          │                      cos, sin) ── [B, L, h*hd]
                                          └─ cache.key.l.out, cache.value.l.out (the same buffers, in place)
    after:                qkv [B, L, w], positions [B], chunk_lengths [B], Range(B) ──
                              SpeedcAttention(artifact, key=cache.key.l, value=cache.value.l, slots=1) ── [B, L, h*hd]

    before (batch step):  qkv [R, w] ── ScatterND into [P*W, w] ── Reshape ── GroupQueryAttention(pool.key.j, ...)
                              ── Gather(the computed rows' pool rows) ── [R, 1, h*hd]
    after:                qkv [R, w], positions [P*n], ones [P*n], computed_rows [R] ──
                              SpeedcAttention(artifact, key=pool.key.j, value=pool.value.j, slots=P) ── [R, 1, h*hd]

Why: a SPEED step reads as much cache as a whole plain token (each slot attends over its own loop's cache)
while it reads the weights once; at 512 positions attention over the fp32 cache was the largest part of
what a P = 4 step adds at Ouro-1.4B's shape (docs/benchmarks.md). A float16 cache halves those bytes, and
each row reads only its own positions, not the pool's length. ONNX Runtime's CPU GroupQueryAttention is no
faster on an fp16 cache, and a Python operator gets copies of its inputs, so the pool lives outside ONNX
Runtime: the twin takes and returns the fused graph's tensors less its caches (contract.without_caches),
the manifest records the pool's dtype (contract.NATIVE_CACHE), and the runtime binds its pool to the
operator under the cache names for each run. The rotary tables, sequence lengths and the step's
scatter / gather into pool rows fall away with GroupQueryAttention.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.errors import BuildError
from speedc.format import contract
from speedc.passes.base import CompileState, register_pass
from speedc.passes.native_products import _subgraphs

NATIVE_CACHE_DTYPE = "float16"  # the pool the twin's attention reads and writes


def _step_rows(node: gs.Node) -> tuple[gs.Tensor, gs.Node]:
    """(the packed rows [R, w] a step's GroupQueryAttention scatters into the pool, the Gather back to them)."""
    reshape = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
    scatter = reshape.inputs[0].inputs[0] if reshape is not None and reshape.inputs[0].inputs else None
    gathers = node.outputs[0].outputs
    if scatter is None or scatter.op != "ScatterND" or len(gathers) != 1 or gathers[0].op != "Gather":
        raise BuildError(f"internal: native_attention: {node.name} is not the fused step's scatter / attention / gather")
    return scatter.inputs[2], gathers[0]


class _BranchInputs:
    """The operator's index inputs, made once per branch: the prefill's rows Range(B), the step's lengths of 1."""

    def __init__(self, graph: gs.Graph, positions: gs.Tensor) -> None:
        self.graph, self.positions = graph, positions
        self._rows = self._ones = None
        self._prefix = graph.name + "/native_attention"

    def _count(self) -> gs.Tensor:  # [1] entries of positions
        out = gs.Variable(f"{self._prefix}.count", np.int64, [1])
        self.graph.nodes.append(gs.Node("Shape", f"{self._prefix}/Shape", inputs=[self.positions], outputs=[out]))
        return out

    def rows(self) -> gs.Tensor:  # [B] 0 .. B-1
        if self._rows is None:
            limit = gs.Variable(f"{self._prefix}.limit", np.int64, [])
            self.graph.nodes.append(gs.Node("Squeeze", f"{self._prefix}/Squeeze", inputs=[self._count()], outputs=[limit]))
            self._rows = gs.Variable(f"{self._prefix}.rows", np.int64, ["rows"])
            self.graph.nodes.append(gs.Node("Range", f"{self._prefix}/Range", outputs=[self._rows], inputs=[
                gs.Constant(f"{self._prefix}.zero", np.array(0, np.int64)), limit,
                gs.Constant(f"{self._prefix}.one", np.array(1, np.int64))]))
        return self._rows

    def ones(self) -> gs.Tensor:  # [P*n] 1 (a step's rows hold one token each)
        if self._ones is None:
            self._ones = gs.Variable(f"{self._prefix}.ones", np.int64, ["entries"])
            self.graph.nodes.append(gs.Node("ConstantOfShape", f"{self._prefix}/ConstantOfShape", inputs=[self._count()],
                                            outputs=[self._ones], attrs={"value": gs.Constant(
                                                f"{self._prefix}.one_value", np.array([1], np.int64))}))
        return self._ones


def attention_twin(twin: gs.Graph, artifact_id: str, *, slots: int, heads: int, kv_heads: int, head_dim: int,
                   theta: float) -> int:
    """TWIN (the fused engine graph's native twin) with every GroupQueryAttention run as SpeedcAttention and
    its caches gone from its inputs and outputs, changed in place. -> the attentions replaced."""
    outer = {t.name: t for t in twin.inputs}
    positions, computed = outer[contract.POSITIONS], outer.get(contract.COMPUTED_ROWS)
    replaced = 0
    for graph in list(_subgraphs(twin)):
        made = _BranchInputs(graph, positions)
        for node in [n for n in graph.nodes if n.op == "GroupQueryAttention"]:
            key, value = node.inputs[3], node.inputs[4]
            step = key.name.startswith("pool.")
            if step:
                qkv, gather = _step_rows(node)
                out, lengths, rows, width = gather.outputs[0], made.ones(), computed, slots
                gather.outputs.clear()
            else:
                qkv, out, lengths, rows, width = node.inputs[0], node.outputs[0], outer[contract.CHUNK_LENGTHS], made.rows(), 1
            node.inputs.clear()
            node.outputs.clear()
            graph.nodes.append(gs.Node(contract.NATIVE_ATTENTION, f"{node.name}/native", domain=contract.NATIVE_DOMAIN,
                                       inputs=[qkv, positions, lengths, rows], outputs=[out], attrs={
                "artifact": artifact_id, "key": key.name, "value": value.name, "slots": width, "heads": heads,
                "kv_heads": kv_heads, "head_dim": head_dim, "theta": repr(float(theta))}))
            replaced += 1
    if not replaced:
        return 0
    # the in-place cache outputs leave the graph, the If and both branches (their outputs line up by index)
    dropped = [i for i, t in enumerate(twin.outputs) if contract.is_cache_input(t.name)]
    for node in [n for n in twin.nodes if n.op == "If"]:
        for branch in (node.attrs["then_branch"], node.attrs["else_branch"]):
            branch.outputs = [t for i, t in enumerate(branch.outputs) if i not in dropped]
        node.outputs = [t for i, t in enumerate(node.outputs) if i not in dropped]
    twin.outputs = [t for i, t in enumerate(twin.outputs) if i not in dropped]
    twin.inputs = [t for t in twin.inputs if not contract.is_cache_input(t.name)]
    for graph in _subgraphs(twin):
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    if any(n.op == "GroupQueryAttention" for g in _subgraphs(twin) for n in g.nodes):
        raise BuildError("internal: native_attention left a GroupQueryAttention in the twin")
    return replaced


@register_pass("native_attention", phase="finalize", requires=("native_graphs",), provides=("native_attention",))
def native_attention(state: CompileState) -> CompileState:
    """The fused engine graph's native twin attends on speedc's kernel over the runtime's float16 KV pool."""
    name = contract.fused(contract.ENGINE)
    twin = state.native_graphs.get(name)
    if twin is None:  # no fused graph (--target trt, a plan gqa_attention skips) or no native twin (fp32 weights)
        return state
    cfg = state.cfg
    replaced = attention_twin(twin, state.native_artifact_id, slots=state.schedule.slots, heads=cfg.num_attention_heads,
                              kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, theta=cfg.rope_theta)
    if replaced:
        state.native_cache[name] = NATIVE_CACHE_DTYPE
        state.notes.append(f"native_attention: {replaced} attentions of {name}'s twin on speedc's kernel "
                           f"({NATIVE_CACHE_DTYPE} KV pool)")
    return state
