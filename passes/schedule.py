"""Pass `schedule` (phase analysis): choose the pipeline depth P and the slot -> layer table from the
depth plan the share pass fitted (P divides its core repeats; slot 0 also runs the prelude).

    cycle M=4, N=16:  stage blocks 0 1 2 3 | 0 1 2 3 | 0 1 2 3 | 0 1 2 3   -> P=4 (or P=2, S=8)
    sequence M=4:     stage blocks 0 0 0 0 | 1 1 1 1 | ...                 -> no P>1 shares weights

The rule and the cost model live in speedc/cost_model.py (torch-free: bench and inspect use them too);
this pass applies them to the layer map and exit point the share pass derived, at the expected
acceptance (the option, else the checkpoint's measured exit/final agreement, else a default).
"""

from __future__ import annotations

import dataclasses
import re

from speedc.format.depth_plan import fit_plan
from speedc.models.checkpoint.tensor_source import TensorSource, same_values
from speedc.models.config import ModelConfig
from speedc.passes.base import CompileState, register_pass
from speedc.passes.share import chosen_exit_layer
from speedc.passes.trace import draft_coda
from speedc.cost_model import DEFAULT_ALPHA, make_schedule


def phases_pipeline(state: CompileState) -> bool:
    """Whether the graphs can pipeline the plan's prelude / coda: the decode program was traced with the
    same phases (and, with a coda, the draft readout's own coda at the same tap: trace.draft_coda)."""
    plan, traced, cfg = state.depth_plan, state.cfg.depth_plan, state.cfg
    same = traced.fits(plan.layer_map) and traced.relabel(plan.layer_map) == plan  # the same trip over share's blocks
    return same and state.exit_layer == cfg.exit_layer and (draft_coda(cfg) or not plan.coda)


_BLOCK_WEIGHT = re.compile(r"^model\.blocks\.(\d+)\.(.+)$")


def found_plan_checkpoint(state: CompileState) -> tuple[ModelConfig, dict[str, TensorSource]] | None:
    """The checkpoint as the depth plan share found (config and weights, block b's weights those of the
    first layer running it), when that plan has a prelude / coda the traced program did not run as phases:
    traced again from these, it pipelines like the same plan declared by a family. None: nothing to retrace
    (plan_in_weights finds such a plan before the trace, so this holds only where the two disagree)."""
    plan, cfg = state.depth_plan, state.cfg
    if plan is None or plan.cycle or plan.repeats < 2 or phases_pipeline(state):
        return None
    if cfg.layer_map == state.layer_map or not len(plan.prelude) < state.exit_layer <= plan.num_layers - len(plan.coda):
        return None  # the declared map already (its exit elsewhere), or a draft tap outside the core
    return _checkpoint_as(state, plan, state.exit_layer)


def plan_in_weights(state: CompileState) -> tuple[ModelConfig, dict[str, TensorSource]] | None:
    """Before the trace: the layer map the stored blocks' weights give (logical layers whose block weights are
    equal, role by role, run one block: what share finds in the traced graph), and where its depth plan has
    a prelude / coda that the config does not declare, the checkpoint as that plan (found_plan_checkpoint's
    form): the trace then runs it as phases, once. None where the config's own plan stands."""
    cfg = state.cfg
    stored: dict[int, dict[str, TensorSource]] = {}  # stored block -> role -> its weights
    for name, source in state.weights.items():
        match = _BLOCK_WEIGHT.match(name)
        if match is not None:
            stored.setdefault(int(match.group(1)), {})[match.group(2)] = source
    if len(stored) < 2 or set(stored) != set(cfg.layer_map):
        return None
    keys = {b: tuple(sorted((role, source.digest()) for role, source in roles.items())) for b, roles in stored.items()}
    blocks: dict[tuple, tuple[int, int]] = {}  # key -> (block index, the stored block holding it)
    layer_map = []
    for b in cfg.layer_map:
        block, first = blocks.setdefault(keys[b], (len(blocks), b))
        if first != b and not all(same_values(stored[b][role], stored[first][role]) for role in stored[b]):
            return None  # equal digests, other values: nothing merges here (share, exact, decides)
        layer_map.append(block)
    plan = fit_plan(layer_map, cfg.depth_plan, cfg.loop_norm, cfg.final_norm)
    if plan.cycle or plan.repeats < 2 or layer_map == cfg.layer_map:
        return None
    exit_layer = chosen_exit_layer(state, layer_map)
    if not len(plan.prelude) < exit_layer <= plan.num_layers - len(plan.coda):
        return None  # a draft tap outside the core: the plain engine (share says so)
    return _checkpoint_as(state, plan, exit_layer)


def _checkpoint_as(state: CompileState, plan, exit_layer: int) -> tuple[ModelConfig, dict[str, TensorSource]]:
    """(config, weights) of the checkpoint over PLAN's blocks: block b's weights those of the first logical layer
    running it (later copies hold the same values), the draft after EXIT_LAYER layers."""
    cfg = state.cfg
    weights = {name: source for name, source in state.weights.items() if not _BLOCK_WEIGHT.match(name)}
    for name, source in state.weights.items():
        match = _BLOCK_WEIGHT.match(name)
        if match is None:
            continue
        layer = cfg.layer_map.index(int(match.group(1)))  # the first logical layer reading this stored block
        block = plan.layer_map[layer]
        if plan.layer_map.index(block) == layer:  # later copies of the block are the same values
            weights[f"model.blocks.{block}.{match.group(2)}"] = source
    return dataclasses.replace(cfg, exit_layer=exit_layer, depth_plan=plan), weights


@register_pass("schedule", phase="analysis", requires=("layer_map",), provides=("schedule",))
def schedule(state: CompileState) -> CompileState:
    """Pick P and the slot -> logical-layer table from the layer map and the cost model."""
    alpha = state.options.alpha if state.options.alpha is not None else (state.acceptance_hint or DEFAULT_ALPHA)
    state.schedule = make_schedule(state.depth_plan, state.exit_layer, alpha, state.options.slots,
                                   pipelined_phases=phases_pipeline(state))
    state.notes.append(f"schedule: {state.schedule.reason}")
    return state
