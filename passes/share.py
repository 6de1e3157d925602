"""Pass `share` (phase analysis): merge identical weights and derive the layer map from them.

    before: layer 0 -> W_a   layer 1 -> W_b   layer 2 -> W_a' (== W_a)   layer 3 -> W_b' (== W_b)
    after:  layer 0 -> W_a   layer 1 -> W_b   layer 2 -> W_a            layer 3 -> W_b
            layer map [0, 1, 0, 1], blocks renamed model.blocks.{m}.*

Identical initializers are found by (dtype, shape, sha256) and confirmed by an exact compare, both
streamed from the checkpoint files a row block at a time. A
logical layer is the set of nodes between hidden.{l-1} and hidden.{l}; two layers are the same block
when they read the same weights. A checkpoint saved by Hugging Face with every layer stored thus comes
out with its sharing recognised and its weights named exactly as a speedc-native checkpoint's.
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np
import onnx_graphsurgeon as gs

from speedc.errors import BuildError
from speedc.format.depth_plan import fit_plan
from speedc.models.layer_map import describe_layer_map, first_pass_length
from speedc.passes.base import CompileState, register_pass
from speedc.models.checkpoint.tensor_source import same_values
from speedc.passes.graph_utils import ancestors, descendants, replace_uses, tensor, weight_constants
from speedc.passes.source_weights import source_weight

_BLOCK_NAME = re.compile(r"^model\.blocks\.(\d+)\.(.+)$")


def _content_key(const: gs.Constant) -> tuple:
    """(dtype, shape, sha256 of the values): streamed from the checkpoint for a weight."""
    weight = source_weight(const)
    if weight is not None and len(weight.parts) == 1:
        return weight.parts[0].dtype, tuple(const.shape), weight.parts[0].digest()
    values = np.ascontiguousarray(const.values)
    return values.dtype.str, values.shape, hashlib.sha256(values.tobytes()).hexdigest()


def _same(a: gs.Constant, b: gs.Constant) -> bool:
    wa, wb = source_weight(a), source_weight(b)
    if wa is not None and wb is not None and len(wa.parts) == len(wb.parts) == 1:
        return same_values(wa.parts[0], wb.parts[0])
    return np.array_equal(a.values, b.values)


def _role(name: str) -> str:
    """What a weight is in its block (self_attn.k_proj.weight); "" for the weights outside the blocks."""
    match = _BLOCK_NAME.match(name)
    return match.group(2) if match else ""


def merge_identical_constants(graph: gs.Graph, merged_into: dict[str, gs.Constant] | None = None) -> int:
    """Point every use of a duplicated weight at one copy; returns how many copies were dropped.
    MERGED_INTO (filled when given): dropped name -> the constant that now stands for it.
    Only weights of the same role merge (block 0's k_proj with block 4's): later passes find the
    projections by name, and a k_proj equal to its v_proj (both zero, say) merged under one name left
    them a v projection that reads k_proj (an "internal" error)."""
    canonical: dict[tuple, list[gs.Constant]] = {}
    merged = 0
    constants = [t for t in graph.tensors().values() if isinstance(t, gs.Constant) and math.prod(t.shape) > 1]
    for const in sorted(constants, key=lambda c: c.name):
        bucket = canonical.setdefault((_role(const.name), *_content_key(const)), [])
        twin = next((c for c in bucket if _same(c, const)), None)
        if twin is None:
            bucket.append(const)
        else:
            replace_uses(const, twin)
            merged += 1
            if merged_into is not None:
                merged_into[const.name] = twin
    graph.cleanup()
    return merged


def derive_layer_map(graph: gs.Graph, num_layers: int) -> tuple[list[int], list[list[gs.Constant]]]:
    """Layer l's weights are those read by nodes that hidden.{l} needs but hidden.{l-1} does not; two
    layers are one block when their model.blocks.* weights are the same."""
    previous = ancestors([tensor(graph, "embeddings")])
    # Nodes on the residual stream, and the embedding's own: what a layer's side computations are not.
    stream = {**descendants([tensor(graph, "embeddings")]), **{i: None for i in previous}}
    block_of: dict[tuple[str, ...], int] = {}
    layer_map, block_weights = [], []
    nodes = graph.toposort().nodes  # once: sorting a 96-layer graph per layer costs minutes
    for layer in range(num_layers):
        reached = ancestors([tensor(graph, f"hidden.{layer}")])
        new = [n for n in nodes if id(n) in reached and id(n) not in previous]
        weights = weight_constants([*new, *_side_inputs(new, stream)])
        # A block is its block weights: model.norm after a repeat, an injection's adapter, are the plan's.
        key = tuple(sorted(w.name for w in weights if _BLOCK_NAME.match(w.name)))
        if key not in block_of:
            block_of[key] = len(block_of)
            block_weights.append(weights)
        layer_map.append(block_of[key])
        previous = reached
    return layer_map, block_weights


def _side_inputs(new: list[gs.Node], stream: dict[int, gs.Node]) -> list[gs.Node]:
    """Nodes off the residual stream feeding NEW (a layer's own nodes): a block's value-embedding lookup
    depends only on token ids and its table, so the exporter computes it once for all repeats of the block
    (common subexpressions merged) and only the first repeat's layer would otherwise read the table."""
    found: dict[int, gs.Node] = {}
    stack = [producer for node in new for t in node.inputs for producer in t.inputs]
    while stack:
        node = stack.pop()
        if id(node) not in found and id(node) not in stream:
            found[id(node)] = node
            stack.extend(producer for t in node.inputs for producer in t.inputs)
    return list(found.values())


def rename_blocks(block_weights: list[list[gs.Constant]]) -> None:
    """model.blocks.{first layer using it}.x -> model.blocks.{block index}.x"""
    for block, weights in enumerate(block_weights):
        for w in weights:
            match = _BLOCK_NAME.match(w.name)
            if match:
                w.name = f"model.blocks.{block}.{match.group(2)}"


def model_tensor_aliases(cfg, layer_map: list[int], merged_into: dict[str, gs.Constant]) -> dict[str, str]:
    """The names merged away or renamed away (MERGED_INTO: old name -> its constant now) that the compiled
    model still has as tensors (its blocks' norms that happened to be equal, say all ones, one constant
    renamed after the last block reading it), each -> the name now holding its values: the weight index lists
    them as views, so the model rebuilds from the artifact (PyTorch backend, peers) with every tensor.
    An unrolled checkpoint's later layers are not tensors of the compiled model and get none."""
    from speedc.models.checkpoint.torch_io import expected_shapes

    tensors = expected_shapes(cfg.with_layer_map(layer_map))
    return {name: twin.name for name, twin in merged_into.items() if name in tensors and name != twin.name}


def chosen_exit_layer(state: CompileState, layer_map: list[int]) -> int:
    """The exit point: explicit option > the checkpoint's speedc section or family > end of the first pass."""
    if state.options.exit_layer is not None:
        return state.options.exit_layer
    if state.has_speedc_section or state.cfg.loop_norm:
        return state.cfg.exit_layer
    return first_pass_length(layer_map)


@register_pass("share", phase="analysis", requires=("decode_program",), provides=("layer_map",))
def share(state: CompileState) -> CompileState:
    """Merge identical initializers, derive the layer map from the weights, fix the exit point."""
    graph = state.graphs["decode"]
    merged_into: dict[str, gs.Constant] = {}
    merged = merge_identical_constants(graph, merged_into)
    layer_map, block_weights = derive_layer_map(graph, state.cfg.num_hidden_layers)
    for weights in block_weights:  # a kept block weight's own name, in case the renaming moves it
        merged_into.update({w.name: w for w in weights if w.name not in merged_into})
    rename_blocks(block_weights)
    # The family's loops where the weights keep them (its norms sit at their ends), else derived from the map.
    cfg = state.cfg
    state.depth_plan = fit_plan(layer_map, cfg.depth_plan, cfg.loop_norm, cfg.final_norm)  # state.layer_map: its map
    state.notes.append(f"share: depth plan {state.depth_plan.describe()}")
    state.weight_aliases = model_tensor_aliases(state.cfg, layer_map, merged_into)
    state.notes.append(f"share: merged {merged} duplicate initializers; layer map {describe_layer_map(layer_map)}: {layer_map}")
    if state.has_speedc_section and layer_map != state.cfg.layer_map:
        state.notes.append(f"share: config.json declares {state.cfg.layer_map}, the weights say {layer_map}; using the weights")

    exit_layer = chosen_exit_layer(state, layer_map)
    if not 1 <= exit_layer <= len(layer_map):
        raise BuildError(f"--exit-layer must be in 1..{len(layer_map)}, got {exit_layer}")
    declared = state.cfg.exit_norm if state.options.exit_layer is None else None
    state.exit_layer = exit_layer
    if state.depth_plan.coda:  # the draft reads out through the coda, then the final readout's norm
        state.exit_norm = "model.norm.weight" if state.depth_plan.final_norm else None
    elif declared == "own" and state.has_speedc_section:
        state.exit_norm = "model.exit_norm.weight"
    elif declared == "none" or state.depth_plan.ends_loop(exit_layer - 1):
        state.exit_norm = None  # the loop-boundary norm already normalized the state the exit reads
    else:
        state.exit_norm = "model.norm.weight"
    state.notes.append(f"share: early exit after layer {exit_layer} through {state.exit_norm or 'no norm (loop-normed state)'}")
    return state
