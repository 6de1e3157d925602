r"""Pass `cache_writer` (phase lowering): two tiny graphs that write new K/V rows into the cache.

A backend whose cache lives on the device (ONNX Runtime with IO binding, CUDA or CPU) cannot index
it from numpy. It binds the cache buffer as both the input and the output of these graphs;
ScatterND then writes only the new rows (ONNX Runtime skips its input->output copy when both are the
same buffer, so a step never copies the cache; tests/test_backends.py checks the writes land in place).

    cache.key [S, P, kvh, T, hd] ──────────────────────────────┐
    new_key   [S, P, kvh, L, hd]  (slot_major: [P, S, ...]) ─┬─ ScatterND ── cache.key.out (same buffer)
    write_start [P] ── + Range(L) ── indices [S, P, kvh, L, 4] ┘
                     (s, p, h, write_start[p] + i)

`cache_write_step` takes the step graph's new rows ([S, P, kvh, 1, hd]); `cache_write_prefill` the
prefill graph's ([N, 1, kvh, L, hd] = [P, S, kvh, L, hd] in memory, transposed in-graph). Bubbles
(invalid slots) get write_start = T - 1: the runtime allocates one scratch row past the capacity,
which no mask ever lets attention read.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from speedc import contract
from speedc.passes.base import CompileState, register_pass


def _index_grid(graph: gs.Graph, name: str, size: int, axis: int, shape: gs.Tensor) -> gs.Tensor:
    """[S, P, kvh, L, 1] int64 tensor holding its index along AXIS (0..size-1), expanded to SHAPE."""
    dims = [1] * 5
    dims[axis] = size
    iota = gs.Constant(f"{name}.iota", np.arange(size, dtype=np.int64).reshape(dims))
    return graph.layer(op="Expand", inputs=[iota, shape], outputs=[f"{name}.grid"])[0]


def build_cache_writer(stage_layers: int, slots: int, kv_heads: int, head_dim: int, *, slot_major: bool) -> gs.Graph:
    s_, p_, h_ = stage_layers, slots, kv_heads
    graph = gs.Graph(opset=17, name=contract.CACHE_WRITE_PREFILL if slot_major else contract.CACHE_WRITE_STEP)
    write_start = gs.Variable(contract.WRITE_START, np.int64, [p_])
    cache = {kind: gs.Variable(contract.cache_buffer(kind), np.float32, [s_, p_, h_, "capacity", head_dim]) for kind in contract.KV_KINDS}
    rows_shape = [p_, s_, h_, "chunk", head_dim] if slot_major else [s_, p_, h_, "chunk", head_dim]
    new = {kind: gs.Variable(contract.new_rows(kind), np.float32, rows_shape) for kind in contract.KV_KINDS}
    graph.inputs = [cache["key"], cache["value"], new["key"], new["value"], write_start]
    if slot_major:  # [P, S, kvh, L, hd] -> [S, P, kvh, L, hd]
        for kind in ("key", "value"):
            new[kind] = graph.layer(op="Transpose", inputs=[new[kind]], outputs=[f"new_{kind}.stage_major"],
                                    attrs={"perm": [1, 0, 2, 3, 4]})[0]
    # chunk length L and the grid shape [S, P, kvh, L, 1]
    shape = graph.layer(op="Shape", inputs=[new["key"]], outputs=["rows.shape"])[0]
    length = graph.layer(op="Slice", inputs=[shape, gs.Constant("three", np.array([3], np.int64)),
                                             gs.Constant("four", np.array([4], np.int64))], outputs=["rows.length"])[0]  # [1]
    grid_shape = graph.layer(op="Concat", inputs=[gs.Constant("grid.lead", np.array([s_, p_, h_], np.int64)), length,
                                                  gs.Constant("one", np.array([1], np.int64))], outputs=["grid.shape"],
                             attrs={"axis": 0})[0]
    scalar_length = graph.layer(op="Squeeze", inputs=[length, gs.Constant("axis0", np.array([0], np.int64))],
                                outputs=["rows.length.scalar"])[0]
    offsets = graph.layer(op="Range", inputs=[gs.Constant("zero", np.array(0, np.int64)), scalar_length,
                                              gs.Constant("step1", np.array(1, np.int64))], outputs=["rows.offsets"])[0]  # [L]
    starts = graph.layer(op="Reshape", inputs=[write_start, gs.Constant("starts.shape", np.array([1, p_, 1, 1, 1], np.int64))],
                         outputs=["starts.5d"])[0]
    offsets5 = graph.layer(op="Reshape", inputs=[offsets, gs.Constant("offsets.shape", np.array([1, 1, 1, -1, 1], np.int64))],
                           outputs=["offsets.5d"])[0]
    time_index = graph.layer(op="Add", inputs=[starts, offsets5], outputs=["time.index"])[0]  # [1, P, 1, L, 1]
    grids = [_index_grid(graph, "stage", s_, 0, grid_shape), _index_grid(graph, "slot", p_, 1, grid_shape),
             _index_grid(graph, "head", h_, 2, grid_shape),
             graph.layer(op="Expand", inputs=[time_index, grid_shape], outputs=["time.grid"])[0]]
    indices = graph.layer(op="Concat", inputs=grids, outputs=["indices"], attrs={"axis": 4})[0]  # [S, P, kvh, L, 4]
    outputs = []
    for kind in ("key", "value"):
        out = graph.layer(op="ScatterND", inputs=[cache[kind], indices, new[kind]], outputs=[contract.cache_buffer_out(kind)])[0]
        out.name, out.dtype, out.shape = contract.cache_buffer_out(kind), np.float32, [s_, p_, h_, "capacity", head_dim]  # layer() suffixes names
        outputs.append(out)
    graph.outputs = outputs
    return graph.cleanup().toposort()


@register_pass("cache_writer", phase="lowering", requires=("schedule",), provides=("cache_writers",))
def cache_writer(state: CompileState) -> CompileState:
    """Add the in-place cache-write graphs for device-resident caches (IO binding)."""
    cfg, sched = state.cfg, state.schedule
    dims = (sched.stage_layers, sched.slots, cfg.num_key_value_heads, cfg.head_dim)
    if state.schedule.speculative:  # a plain engine (P=1) only prefills
        state.graphs[contract.CACHE_WRITE_STEP] = build_cache_writer(*dims, slot_major=False)
    state.graphs[contract.CACHE_WRITE_PREFILL] = build_cache_writer(*dims, slot_major=True)
    return state
