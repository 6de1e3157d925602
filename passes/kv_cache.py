"""Pass `kv_cache` (phase lowering): cache inputs and new-row outputs in the runtime's layout.

The runtime owns one pool per K and V laid out [S, P, W, kvh, T, hd] (stage layer, slot, pool row,
...), so slot s's rows for stage layer j, logical layer s*S + j, over sequences b..b+B are one contiguous
slab (runtimes/backends/onnx.py):

    prefill graph  cache.key.{l}  = pool[j, s, b:b+B] for l = s*S + j   [B, kvh, T, hd]
                   new_key        [N, B, kvh, L, hd]   rows start .. start+L-1
    batch step     cache inputs named by passes/batch_step_graph.py; new_key [S, R, kvh, 1, hd]

Which slab each entry is lives in speedc/format/cache_layout.py (a depth plan's prelude / coda included: its
prefill writes N + Lc entries, the draft readout's coda last).

The graphs only read the cache; new rows leave as one small tensor each for K and V, so a step
never copies or concatenates the cache (the copy that cost the prototype 25% of its speed).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import add_layer


def stack_presents(graph: gs.Graph, layers: int, rows: int | str, chunk: int | str, kv_heads: int, head_dim: int) -> None:
    stacked = []
    tensors = graph.tensors()  # once: a lookup per layer would scan the whole graph each time
    for kind in contract.KV_KINDS:
        parts = []
        for layer in range(layers):
            present = tensors[f"present.{kind}.{layer}"]
            axis0 = gs.Constant(f"{contract.new_rows(kind)}.axis0.{layer}", np.array([0], dtype=np.int64))
            parts.append(add_layer(graph, op="Unsqueeze", inputs=[present, axis0], outputs=[f"{contract.new_rows(kind)}.{layer}"],
                                          name=f"kv_cache/Unsqueeze_{kind}_{layer}")[0])
        out = add_layer(graph, op="Concat", inputs=parts, outputs=[contract.new_rows(kind)], attrs={"axis": 0},
                               name=f"kv_cache/Concat_{kind}")[0]
        out.dtype, out.shape = np.float32, [layers, rows, kv_heads, chunk, head_dim]
        stacked.append(out)
    graph.outputs = [t for t in graph.outputs if not t.name.startswith("present.")] + stacked


def drop_entries_from(graph: gs.Graph, entries: int) -> None:
    """Cache inputs and present outputs of entries >= ENTRIES leave the graph (cleanup drops their nodes)."""
    def index(name: str) -> int:
        return int(name.rsplit(".", 1)[1])

    graph.inputs = [t for t in graph.inputs if not (t.name.startswith("cache.") and index(t.name) >= entries)]
    graph.outputs = [t for t in graph.outputs if not (t.name.startswith("present.") and index(t.name) >= entries)]


def rename_cache_inputs(graph: gs.Graph) -> None:
    for t in graph.inputs:
        if t.name.startswith("past."):
            kind, index = t.name[len("past."):].split(".")
            t.name = contract.cache_input(kind, int(index))


@register_pass("kv_cache", phase="lowering", requires=("programs", "layer_presents"), provides=("cache_io",),
               consumes=("layer_presents",))
def kv_cache(state: CompileState) -> CompileState:
    """Name cache inputs per (stage) layer and stack the new K/V rows into one output each."""
    cfg, sched = state.cfg, state.schedule
    layout = sched.cache_layout  # prefill: one entry a logical layer (+ readout codas)
    shapes = {contract.PREFILL: (len(layout.entries), "batch", "chunk"), contract.BATCH_STEP: (layout.stage_layers, "rows", 1)}
    for name in [n for n in shapes if n in state.graphs]:  # a plain engine (P = 1) has no batch step
        graph = state.graphs[name]
        rename_cache_inputs(graph)
        if name == contract.PREFILL:  # the plain engine reads no draft-readout coda the trace may have run
            drop_entries_from(graph, shapes[name][0])
        stack_presents(graph, *shapes[name], cfg.num_key_value_heads, cfg.head_dim)
        graph.cleanup().toposort()
    return state
