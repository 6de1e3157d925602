r"""Pass `gqa_attention` (phase lowering): ONNX Runtime variants of the graphs whose attention is one
`com.microsoft.GroupQueryAttention` node per layer, writing the cache in place.

    q2d [R*L, h*hd] ─┐
    k2d ─────────────┼ Concat ── Reshape [R, L, (h+2kvh)*hd] ─┐   (packed q|k|v; after fuse_projections
    v2d ─────────────┘                                        │    the stacked projection's output itself)
                                                              ├─ GroupQueryAttention ── [R, L, h*hd] ── Reshape ── o_proj
    cache.key.{l} / cache.value.{l} ──────────┤   (rotary inside)    └─ cache.key.{l}.out (same buffer)
    seqlens_k = positions + L - 1 (int32) ────┤   (prefill: positions + chunk_lengths - 1, right padding)
    total_sequence_length = max(positions) + L┤
    cos/sin tables [max_context + 1, hd/2] ───┘  (computed from inv_freq, folded at load)

Why: the standard-op attention (rotary, two masks, split softmax, slices) is ~35 ONNX nodes a layer;
on a CPU most of a step's time outside the weight Gemms is those nodes and their dispatch. GQA does
the same math in one kernel, per row at its own position (row r reads cache rows 0..positions[r]+i),
exactly the slot semantics of a SPEED step, and writes the new K/V rows into the cache when the
runtime binds past and present to one buffer (IO binding; the `onnx` backend, runtimes/backends/onnx.py).

The standard batch step reads one cache slab per (stage layer, slot); its fused variant reads each stage
layer's whole pool as one buffer and runs one GroupQueryAttention a layer over it, and computes only the
rows the runtime names (computed_rows: bubbles skipped; BatchPool below): pool.key.{j} / pool.value.{j}.

What the fusion drops must be exactly what GroupQueryAttention computes: each layer's nodes between its
projections and o_proj are checked against the attention models/row_layer.py writes (op by op, and its
score scale), the rotary frequencies against rope_theta's, and the shared nodes falling away with them
(masks, tables) by op type. Anything else (a q/k norm, a soft-cap, a scaled rope, a sliding window) is a
one-line BuildError naming the node and the layer, never silently dropped (LAYER_ATTENTION_OPS below).

The standard programs stay (TensorRT, the numpy-fed backend); these are added as `prefill.gqa` and
`batch_step.gqa` (merge_programs then makes each variant one engine graph). Only for --target onnx: TensorRT has no such op.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_graphsurgeon as gs

from speedc.format import contract
from speedc.errors import BuildError
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import add_layer, ancestors, descendants, import_microsoft_domain, reshape

GQA_HEAD_DIM_MULTIPLE = 16  # ONNX Runtime's CPU kernel: "head_size shall be a multiple of 16"


def _projection(node: gs.Node, kind: str) -> bool:
    return (node.op == "Gemm" and isinstance(node.inputs[1], gs.Constant)
            and node.inputs[1].name.endswith(f"self_attn.{kind}_proj.weight"))


def _layers(graph: gs.Graph) -> list[tuple[gs.Tensor, gs.Tensor, gs.Tensor, gs.Node]]:
    """Per layer, in graph order: (q2d, k2d, v2d, o_proj Gemm)."""
    graph.toposort()
    qkv: dict[str, dict[str, gs.Tensor]] = {}
    for node in graph.nodes:
        for kind in ("q", "k", "v"):
            if _projection(node, kind):
                qkv.setdefault(node.inputs[0].name, {})[kind] = node.outputs[0]
    o_projs = [node for node in graph.nodes if _projection(node, "o")]
    groups = list(qkv.values())
    if len(groups) != len(o_projs) or any(len(g) != 3 for g in groups):
        raise BuildError(f"internal: gqa_attention found {len(groups)} q/k/v groups and {len(o_projs)} o_proj Gemms")
    return [(g["q"], g["k"], g["v"], o) for g, o in zip(groups, o_projs)]


# ---- what the fusion replaces must be exactly what GroupQueryAttention computes ----------------------------
# One layer's path from its q/k/v projections to its o_proj, as models/row_layer.py writes it (the same on
# every program and the batch step, whatever the head counts): q/k/v to heads (Reshape, Transpose),
# half-split rotary on q and k (Slice, Neg, Concat, Mul, Add), q scaled by head_dim**-0.5 (Mul), scores
# over past and new keys plus their masks (MatMul, Add), one softmax over both (Concat, Softmax, Slice),
# the two products with v summed (MatMul, Add), heads merged (Reshape, Transpose). The fusion drops every
# node there for one GroupQueryAttention, so anything else on the path (a q/k norm, a soft-cap, a score
# bias) would vanish from the model without a word: it is refused by name instead.
LAYER_ATTENTION_OPS = Counter({"Reshape": 6, "Transpose": 5, "Slice": 6, "Neg": 2, "Concat": 3, "Mul": 5, "Add": 5,
                               "MatMul": 4, "Softmax": 1})
# What else falls away with the attention, shared by its layers: the rotary tables from the positions, the
# two causal masks, the cache slabs' plumbing. Their counts vary with the graph, so only the op types are
# fixed; rope scaling changes values, not ops, so the rotary frequencies are compared by value.
SHARED_ATTENTION_OPS = frozenset({"Add", "Cast", "Concat", "Constant", "ConstantOfShape", "Cos", "Expand", "Gather",
                                  "Less", "LessOrEqual", "Mul", "Range", "Shape", "Sin", "Tile", "Transpose",
                                  "Unsqueeze", "Where"})
REFUSAL = "GroupQueryAttention does not compute that, so the fused graph would silently change the model"


def _constant_values(tensor: gs.Tensor) -> np.ndarray | None:
    """The values of a constant input (an initializer or a Constant node's output), else None."""
    if isinstance(tensor, gs.Constant):
        return tensor.values
    producer = tensor.inputs[0] if tensor.inputs else None
    if producer is not None and producer.op == "Constant" and isinstance(producer.attrs.get("value"), gs.Constant):
        return producer.attrs["value"].values
    return None


def attention_path(q2d: gs.Tensor, k2d: gs.Tensor, v2d: gs.Tensor, o_proj: gs.Node) -> list[gs.Node]:
    """The nodes between a layer's projections and its o_proj: reached from q/k/v (not past o_proj)
    and reaching o_proj's input; nearest the projections first."""
    reached = descendants([q2d, k2d, v2d], stop=o_proj)
    on_path: dict[int, gs.Node] = {}
    stack = [o_proj.inputs[0]]
    while stack:
        for producer in stack.pop().inputs:
            if id(producer) in reached and id(producer) not in on_path:
                on_path[id(producer)] = producer
                stack.extend(producer.inputs)
    return [node for node in reached.values() if id(node) in on_path]


def check_layer_attention(path: list[gs.Node], where: str, head_dim: int) -> None:
    """PATH's ops must be LAYER_ATTENTION_OPS exactly, and its q scale GQA's own (1/sqrt(head_dim))."""
    for node in path:
        if node.op not in LAYER_ATTENTION_OPS:
            raise BuildError(f"gqa_attention: {node.op} node {node.name!r} on the attention path of {where}: {REFUSAL}")
    counts = Counter(node.op for node in path)
    for op, known in LAYER_ATTENTION_OPS.items():
        if counts[op] != known:
            raise BuildError(f"gqa_attention: {counts[op]} {op} nodes on the attention path of {where} where the "
                             f"attention it fuses has {known}: {REFUSAL}")
    for node in (n for n in path if n.op == "Mul"):
        for value in (_constant_values(t) for t in node.inputs):
            if value is not None and value.size == 1 and not np.isclose(float(value), head_dim ** -0.5, rtol=1e-6):
                raise BuildError(f"gqa_attention: {where} scales its scores by {float(value):g} (node {node.name!r}), "
                                 f"not 1/sqrt(head_dim) = {head_dim ** -0.5:g}: {REFUSAL}")


def check_layer_paths(graph: gs.Graph, layers: list, head_dim: int) -> set[int]:
    """Each layer's attention path checked (check_layer_attention); the ids of all their nodes."""
    paths: set[int] = set()
    for layer, (q2d, k2d, v2d, o_proj) in enumerate(layers):
        path = attention_path(q2d, k2d, v2d, o_proj)
        block = o_proj.inputs[1].name.removesuffix(".o_proj.weight")
        check_layer_attention(path, f"layer {layer} ({block}) of graph {graph.name}", head_dim)
        paths.update(id(node) for node in path)
    return paths


def check_rotary_frequencies(graph: gs.Graph, inv_freq: np.ndarray) -> None:
    """The frequencies the graph's rotary tables multiply the positions by must be the ones
    rotary_tables computes from rope_theta (a scaled rope would otherwise be replaced by plain rope)."""
    tables = ancestors([t for node in graph.nodes if node.op in ("Cos", "Sin") for t in node.outputs])
    found = [value for node in graph.nodes if node.op == "Mul" and id(node) in tables
             for value in (_constant_values(t) for t in node.inputs) if value is not None and value.shape == inv_freq.shape]
    if not found:
        raise BuildError(f"gqa_attention: no rotary frequencies [{inv_freq.size}] found in graph {graph.name}: {REFUSAL}")
    for value in found:
        if not np.allclose(value, inv_freq, rtol=1e-6, atol=0):
            raise BuildError(f"gqa_attention: graph {graph.name} rotates by other frequencies than rope_theta's "
                             f"(a scaled rope?): {REFUSAL}")


def check_shared_attention(replaced: list[gs.Node], graph_name: str) -> None:
    """REPLACED: the nodes the fusion dropped outside the layers' paths; each must be of a known op type."""
    for node in replaced:
        if node.op not in SHARED_ATTENTION_OPS:
            raise BuildError(f"gqa_attention: {node.op} node {node.name!r} feeds the attention of graph {graph_name} "
                             f"(its rotary tables, masks or cache): {REFUSAL}")


def rotary_tables(graph: gs.Graph, head_dim: int, theta: float, rows: int) -> tuple[gs.Tensor, gs.Tensor]:
    """cos/sin [rows, hd/2] for positions 0..rows-1 (Hugging Face half-split rotary), computed in the
    graph from inv_freq (ONNX Runtime folds them at load) so the artifact does not store the tables.

        Range(rows) [rows] -> Cast float -> Unsqueeze [rows, 1] -> Mul inv_freq [hd/2] -> Cos / Sin
    """
    inv_freq = contract.rotary_inv_freq(head_dim, theta)
    index = add_layer(graph, op="Range", inputs=[gs.Constant("gqa.rows.start", np.array(0, np.int64)),
                                                 gs.Constant("gqa.rows.stop", np.array(rows, np.int64)),
                                                 gs.Constant("gqa.rows.step", np.array(1, np.int64))], outputs=["gqa.rows"])[0]
    index = add_layer(graph, op="Cast", inputs=[index], outputs=["gqa.rows.f"], attrs={"to": 1})[0]
    index = add_layer(graph, op="Unsqueeze", inputs=[index, gs.Constant("gqa.axis1", np.array([1], np.int64))],
                             outputs=["gqa.rows.col"])[0]
    freqs = add_layer(graph, op="Mul", inputs=[index, gs.Constant("gqa.inv_freq", inv_freq)], outputs=["gqa.freqs"])[0]
    return (add_layer(graph, op="Cos", inputs=[freqs], outputs=["gqa.cos_cache"])[0],
            add_layer(graph, op="Sin", inputs=[freqs], outputs=["gqa.sin_cache"])[0])


class BatchPool:
    r"""The batch step's attention over the runtime's cache pool (runtimes/backends/onnx.py): stage layer
    j's slabs of every slot and every pool row are one buffer [P*W, kvh, T, hd] (row s*W + b), so
    ONE GroupQueryAttention per layer serves the P slots of all n sequences, as in the single-sequence
    step (a GroupQueryAttention per slot group cost each step about 40% more, measured at n = 1).

    Only the rows the runtime names in computed_rows run the layers (bubbles, empty pipeline slots and
    sequences still prefilling, do not: their Gemm rows cost real compute once a batch is compute-bound);
    the attention scatters them into the pool's row order and gathers them back:

        slot_inputs [P*n, H] ── Gather(computed_rows) ── [R, H] ── stage layers
        pool_index [R] = (computed_rows // n) * W + computed_rows % n
        qkv [R, w] ── ScatterND into zeros [P*W, w] at pool_index ── Reshape [P*W, 1, w] ──┐
        seqlens_k [P*n] ── Reshape [P, n] ── Pad with 0 ── Reshape [P*W] ─────────────────┼─ GQA
        [R, 1, w'] ◄── Gather(pool_index) ◄── out [P*W, 1, w'] ◄──────────────────────────────┘

    The rows not computed attend with zero q|k|v and write zero K/V at their own position: a bubble
    at the position the runtime gives it (where no valid row reads before rewriting), a free pool row
    (n..W-1, the scheduler keeps the occupied ones a prefix) at position 0 of a row no sequence holds."""

    def __init__(self, graph: gs.Graph, ids_shape: gs.Tensor, seqlens: gs.Tensor, slots: int, pool_input: gs.Tensor,
                 slot_inputs: gs.Tensor, qkv_width: int) -> None:
        self.graph, self.slots, self.qkv_width = graph, slots, qkv_width
        self.n = add_layer(graph, op="Slice", inputs=[ids_shape, self._const("zero", [0]), self._const("one", [1])],
                           outputs=["gqa.pool.n"])[0]  # [1]
        self.pool_rows = add_layer(graph, op="Shape", inputs=[pool_input], outputs=["gqa.pool.shape"], attrs={"end": 1})[0]
        self.width = add_layer(graph, op="Div", inputs=[self.pool_rows, self._const("slots", [slots])],
                               outputs=["gqa.pool.W"])[0]  # [1]
        self.seqlens = self._pool_seqlens(seqlens)  # int32 [P*W]
        self.index = self._pool_index(self._compute_only(slot_inputs))  # [R] s*W + b
        self.index_2d = add_layer(graph, op="Unsqueeze", inputs=[self.index, self._const("axis1", [1])],
                                  outputs=["gqa.pool.index_2d"])[0]  # [R, 1]
        shape = add_layer(graph, op="Concat", inputs=[self.pool_rows, self._const("qkv_width", [qkv_width])],
                          outputs=["gqa.pool.zeros.shape"], attrs={"axis": 0})[0]
        self.zeros = add_layer(graph, op="ConstantOfShape", inputs=[shape],
                               outputs=["gqa.pool.zeros"])[0]  # [P*W, w] float 0 (the default), shared by every layer

    @staticmethod
    def _const(name: str, values: list[int]) -> gs.Constant:
        return gs.Constant(f"gqa.pool.{name}", np.array(values, np.int64))

    def _pool_seqlens(self, seqlens: gs.Tensor) -> gs.Tensor:
        """seqlens_k [P*n] (slot-major) -> [P*W], the free pool rows n..W-1 at 0."""
        graph = self.graph
        missing = add_layer(graph, op="Sub", inputs=[self.width, self.n], outputs=["gqa.pool.free"])[0]  # [1] W - n
        pads = add_layer(graph, op="Concat", inputs=[self._const("pads.head", [0, 0, 0]), missing], outputs=["gqa.pool.pads"],
                         attrs={"axis": 0})[0]  # ONNX pads of a [P, n] tensor: begins (0, 0), ends (0, W - n)
        by_slot = reshape(graph, seqlens, [self.slots, -1], "gqa.pool.seqlens.2d")
        padded = add_layer(graph, op="Pad", inputs=[by_slot, pads], outputs=["gqa.pool.seqlens.padded"])[0]
        return reshape(graph, padded, [-1], "gqa.pool.seqlens_k")

    def _compute_only(self, slot_inputs: gs.Tensor) -> gs.Tensor:
        """The stage layers' input slot_inputs [P*n, H] keeps only the rows of the new graph input
        computed_rows [R] (returned); hidden_out is then theirs."""
        graph = self.graph
        rows = gs.Variable(contract.COMPUTED_ROWS, np.int64, ["computed_rows"])
        graph.inputs.append(rows)
        every_row = gs.Variable("slot_inputs.every_row", np.float32, slot_inputs.shape)
        concat = slot_inputs.inputs[0]  # of the entering tokens' embeddings and hidden_in
        concat.outputs.clear()
        concat.outputs.append(every_row)
        graph.nodes.append(gs.Node("Gather", "gqa.pool.computed/Gather", attrs={"axis": 0}, inputs=[every_row, rows],
                                   outputs=[slot_inputs]))
        slot_inputs.shape = ["computed_rows", slot_inputs.shape[-1]] if slot_inputs.shape else None
        hidden_out = next(t for t in graph.outputs if t.name == contract.HIDDEN_OUT)
        hidden_out.shape = ["computed_rows", *hidden_out.shape[1:]]
        return rows

    def _pool_index(self, rows: gs.Tensor) -> gs.Tensor:
        """Slot-major rows s*n + b [R] -> pool rows s*W + b [R]."""
        graph = self.graph
        slot = add_layer(graph, op="Div", inputs=[rows, self.n], outputs=["gqa.pool.slot"])[0]  # [R] s
        start = add_layer(graph, op="Mul", inputs=[slot, self.n], outputs=["gqa.pool.slot_start"])[0]  # [R] s*n
        sequence = add_layer(graph, op="Sub", inputs=[rows, start], outputs=["gqa.pool.sequence"])[0]  # [R] b
        base = add_layer(graph, op="Mul", inputs=[slot, self.width], outputs=["gqa.pool.slot_base"])[0]  # [R] s*W
        return add_layer(graph, op="Add", inputs=[base, sequence], outputs=["gqa.pool.index"])[0]

    def spread(self, rows: gs.Tensor, name: str) -> gs.Tensor:
        """Packed q|k|v rows [R, w] -> [P*W, 1, w] (every row not computed zero)."""
        scattered = add_layer(self.graph, op="ScatterND", inputs=[self.zeros, self.index_2d, rows],
                              outputs=[f"{name}.scattered"])[0]  # [P*W, w]
        return reshape(self.graph, scattered, [-1, 1, self.qkv_width], f"{name}.pool")

    def gather(self, out: gs.Tensor, name: str) -> gs.Tensor:
        """GQA output [P*W, 1, w] -> [R, 1, w] (the computed rows)."""
        return add_layer(self.graph, op="Gather", inputs=[out, self.index], outputs=[name], attrs={"axis": 0})[0]


def _sequence_lengths(graph: gs.Graph, known: dict) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor, gs.Tensor]:
    """(input_ids' shape, L (the chunk length) [1], the per-row sequence lengths GQA expects (int32 [R]: the
    last real token's position), GQA's total sequence length (int32 scalar: the longest row's end))."""
    positions, input_ids = known[contract.POSITIONS], known[contract.INPUT_IDS]
    ids_shape = add_layer(graph, op="Shape", inputs=[input_ids], outputs=["gqa.ids_shape"])[0]
    chunk = add_layer(graph, op="Slice", inputs=[ids_shape, gs.Constant("gqa.one", np.array([1], np.int64)),
                                                 gs.Constant("gqa.two", np.array([2], np.int64))], outputs=["gqa.chunk"])[0]  # [1]
    last = add_layer(graph, op="Add", inputs=[positions, chunk], outputs=["gqa.end"])[0]  # [R] = positions + L
    last = add_layer(graph, op="Sub", inputs=[last, gs.Constant("gqa.one_i", np.array([1], np.int64))], outputs=["gqa.last"])[0]
    real_last = last
    if contract.CHUNK_LENGTHS in known:  # prefill: a right-padded row's last real token (a first chunk: no past)
        real_last = add_layer(graph, op="Add", inputs=[positions, known[contract.CHUNK_LENGTHS]], outputs=["gqa.real_end"])[0]
        real_last = add_layer(graph, op="Sub", inputs=[real_last, gs.Constant("gqa.one_r", np.array([1], np.int64))],
                              outputs=["gqa.real_last"])[0]  # [R] positions + chunk_lengths - 1
    seqlens = add_layer(graph, op="Cast", inputs=[real_last], outputs=["gqa.seqlens_k"], attrs={"to": 6})[0]  # int32 [R]
    longest = add_layer(graph, op="ReduceMax", inputs=[last], outputs=["gqa.longest"], attrs={"keepdims": 0})[0]  # scalar
    total = add_layer(graph, op="Add", inputs=[longest, gs.Constant("gqa.one_s", np.array(1, np.int64))], outputs=["gqa.total64"])[0]
    total = add_layer(graph, op="Cast", inputs=[total], outputs=["gqa.total"], attrs={"to": 6})[0]  # int32 scalar
    return ids_shape, chunk, seqlens, total


def _add_pool_inputs(graph: gs.Graph, known: dict, layers: int, kv_heads: int, head_dim: int) -> None:
    """The batch step's pool inputs, pool.{key,value}.{j} [P*W, kvh, T+1, hd]: stage layer j's whole pool."""
    for layer in range(layers):
        for kind in contract.KV_KINDS:
            name = contract.pool_input(kind, layer)
            known[name] = gs.Variable(name, np.float32, ["pool_rows", kv_heads, "context", head_dim])
            graph.inputs.append(known[name])


def _attention(graph: gs.Graph, prefix: str, qkv: gs.Tensor, seqlens_k: gs.Tensor, caches: list[gs.Tensor],
               cache_outputs: list, *, heads: int, kv_heads: int, total: gs.Tensor, cos_sin: tuple) -> gs.Tensor:
    """One GroupQueryAttention over packed rows q|k|v [r, L, (h + 2 kvh) hd] and their cache slabs CACHES (K, V),
    written in place (key and value inputs left empty: GroupQueryAttention's packed form); the cache outputs
    (the same buffers) are added to CACHE_OUTPUTS. -> its output [r, L, h*hd]."""
    out = gs.Variable(f"{prefix}.out", np.float32)
    presents = [gs.Variable(contract.in_place_output(past.name), np.float32, past.shape) for past in caches]
    graph.nodes.append(gs.Node(
        "GroupQueryAttention", f"{prefix}/GroupQueryAttention", domain="com.microsoft",
        attrs={"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": 1, "rotary_interleaved": 0},
        inputs=[qkv, gs.Variable.empty(), gs.Variable.empty(), *caches, seqlens_k, total, *cos_sin],
        outputs=[out, *presents]))
    cache_outputs.extend(presents)
    return out


def lower_to_gqa(graph: gs.Graph, *, slots: int, heads: int, kv_heads: int, head_dim: int, theta: float,
                 max_context: int) -> gs.Graph:
    """GRAPH with one fused GroupQueryAttention per layer. SLOTS: the batch step's pipeline depth P (its
    per-slot cache slabs become the pool), 0 for the prefill."""
    graph = graph.copy()
    standard = graph.name  # the graph this fused variant stands in for
    layers = _layers(graph)
    original_nodes = list(graph.nodes)  # before any rewiring: what falls away is checked against them at the end
    paths = check_layer_paths(graph, layers, head_dim)
    check_rotary_frequencies(graph, contract.rotary_inv_freq(head_dim, theta))
    graph.name = contract.fused(graph.name)
    known = graph.tensors()  # looked up once: graph.tensors() scans the whole graph (per layer: minutes)
    ids_shape, chunk, seqlens, total = _sequence_lengths(graph, known)
    cos_cache, sin_cache = rotary_tables(graph, head_dim, theta, max_context + 1)  # + the runtime's scratch row

    chunk_shapes: dict[int, gs.Tensor] = {}  # width -> [-1, L, width], made once for every layer

    def rows_by_chunk(x: gs.Tensor, width: int, name: str) -> gs.Tensor:  # [R*L, width] -> [R, L, width]
        # One shape per graph, not per layer: inside merge_programs' If branch ONNX Runtime does not merge
        # the per-layer copies, and each Concat cost 10 us a run (zoo:small's plain token: 165 us of 8.5 ms).
        shape = chunk_shapes.get(width)
        if shape is None:
            shape = chunk_shapes[width] = add_layer(
                graph, op="Concat", inputs=[gs.Constant(f"gqa.rows.{width}.minus1", np.array([-1], np.int64)), chunk,
                                            gs.Constant(f"gqa.rows.{width}.width", np.array([width], np.int64))],
                outputs=[f"gqa.rows.{width}.shape"], attrs={"axis": 0})[0]
        return add_layer(graph, op="Reshape", inputs=[x, shape], outputs=[f"{name}.3d"])[0]

    def attention(prefix: str, qkv: gs.Tensor, seqlens_k: gs.Tensor, cache_names: list[str]) -> gs.Tensor:
        return _attention(graph, prefix, qkv, seqlens_k, [known[name] for name in cache_names], cache_outputs,
                          heads=heads, kv_heads=kv_heads, total=total, cos_sin=(cos_cache, sin_cache))

    width = (heads + 2 * kv_heads) * head_dim  # packed q|k|v
    pool = None
    if slots:  # the pool inputs replace the per-slot slabs (their Concats fall away with the old attention)
        _add_pool_inputs(graph, known, len(layers), kv_heads, head_dim)
        pool = BatchPool(graph, ids_shape, seqlens, slots, known[contract.pool_input("key", 0)], known["slot_inputs"], width)
    cache_name = contract.pool_input if slots else contract.cache_input
    cache_outputs = []
    for layer, (q2d, k2d, v2d, o_proj) in enumerate(layers):
        prefix = f"gqa.{layer}"
        caches = [cache_name(kind, layer) for kind in contract.KV_KINDS]
        # Packed q|k|v rows: fuse_projections then stacks the three Gemms into one whose output is exactly
        # this Concat (and drops the Split + Concat), so each layer reshapes (and pads) one tensor, not three.
        packed = add_layer(graph, op="Concat", inputs=[q2d, k2d, v2d], outputs=[f"{prefix}.qkv"], attrs={"axis": 1})[0]
        if pool is None:
            out = attention(prefix, rows_by_chunk(packed, width, f"{prefix}.qkv"), seqlens, caches)
        else:
            out = pool.gather(attention(prefix, pool.spread(packed, f"{prefix}.qkv"), pool.seqlens, caches),
                              f"{prefix}.rows")  # [R, 1, h*hd]
        o_proj.inputs[0] = reshape(graph, out, [-1, heads * head_dim], f"{prefix}.ctx")  # [R*L, h*hd]
    # The new rows now land in the cache inside the graph: the stacked new_key/new_value outputs go.
    stacked = {contract.new_rows(kind) for kind in contract.KV_KINDS}
    graph.outputs = [t for t in graph.outputs if t.name not in stacked] + cache_outputs
    import_microsoft_domain(graph)
    graph.cleanup(remove_unused_graph_inputs=True)
    kept = {id(node) for node in graph.nodes}
    check_shared_attention([n for n in original_nodes if id(n) not in kept and id(n) not in paths], standard)
    return graph.toposort()


@register_pass("gqa_attention", phase="lowering", requires=("heads", "cache_io", "separate_projections"),
               provides=("fused_attention",))
def gqa_attention(state: CompileState) -> CompileState:
    """Add ONNX Runtime graph variants with one fused GroupQueryAttention per layer (--target onnx)."""
    if state.options.target != "onnx":
        return state
    cfg = state.cfg
    if state.schedule.cache_layout.pipelined_phases:
        state.notes.append("gqa_attention: skipped (the fused batch step runs a cycle; this plan pipelines a prelude / coda)")
        return state
    if cfg.depth_plan.cross_window:  # two attentions a layer, gated: not one GroupQueryAttention
        state.notes.append("gqa_attention: skipped (cross-repeat attention, IQuest-Coder-V1-Loop: standard graphs only)")
        return state
    if cfg.qk_bias:  # an Add on q and k before rotary: not what the fusion's packed q|k|v input computes
        state.notes.append("gqa_attention: skipped (q/k biases before rotary, e.g. Huginn's qk_bias)")
        return state
    if cfg.head_dim % GQA_HEAD_DIM_MULTIPLE:
        state.notes.append(f"gqa_attention: skipped (ONNX Runtime's GroupQueryAttention needs head_dim % "
                           f"{GQA_HEAD_DIM_MULTIPLE} == 0, this model has {cfg.head_dim})")
        return state
    for name in [n for n in contract.PROGRAMS if n in state.graphs]:
        state.graphs[contract.fused(name)] = lower_to_gqa(
            state.graphs[name], slots=state.schedule.slots if name == contract.BATCH_STEP else 0,
            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, theta=cfg.rope_theta, max_context=cfg.max_position_embeddings)
    state.notes.append("gqa_attention: added ONNX Runtime variants with fused GroupQueryAttention")
    return state
