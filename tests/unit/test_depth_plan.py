"""speedc/format/depth_plan.py: each family emits the phases of a token's trip, a bare layer map yields the
same plan, the pipeline places prelude / core / readouts on slots, the passes and the manifest carry
the plan, and a bad plan in config.json is one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import random_config
from looped_checkpoints import write_nanbeige, write_ouro
from speedc.format.cache_layout import CacheLayout
from speedc.errors import CheckpointError
from speedc.models.config import ModelConfig
from speedc.models.families import load_config, read_config
from speedc.format.depth_plan import CODA, CORE, PRELUDE, DepthPlan, derive_plan, fit_plan
from speedc.passes.base import BuildOptions, CompileState, run_passes
from speedc.cost_model import make_schedule

MIDDLE = [0, 1, 2, 1, 2, 1, 2, 3]  # one layer, a 2-block core x 3, one layer


def read(directory) -> ModelConfig:
    return load_config(directory / "config.json")


def test_looped_families_emit_their_loops(tmp_path):
    ouro = read(write_ouro(tmp_path / "ouro", layers=3, loops=4))
    assert ouro.depth_plan == DepthPlan((), (0, 1, 2), 4, (), loop_norm=True, final_norm=False, loop_exits=True)
    nanbeige = read(write_nanbeige(tmp_path / "nb", layers=2, loops=3))
    assert nanbeige.depth_plan == DepthPlan((), (0, 1), 3, (), loop_norm=True, final_norm=False, loop_exits=True)
    skip = read(write_nanbeige(tmp_path / "nb-skip", layers=2, loops=3, skip_loop_final_norm=True))
    assert skip.depth_plan == DepthPlan((), (0, 1), 3, (), loop_norm=False, final_norm=True)
    # the loop-boundary norm sits where the published forward puts it: after each loop's last layer
    assert [layer for layer in range(12) if ouro.depth_plan.ends_loop(layer)] == [2, 5, 8, 11]
    assert not any(skip.depth_plan.ends_loop(layer) for layer in range(6))


def test_loop_exits_need_readable_loops():
    """A plan whose every repeat's normed state the head reads as it is; refused where a repeat's end is not that."""
    plan = DepthPlan((), (0, 1), 4, loop_norm=True, final_norm=False, loop_exits=True)
    assert DepthPlan.from_json(plan.to_json()) == plan and "per-request loops and exit rules" in plan.describe()
    assert not DepthPlan.from_json({**plan.to_json(), "loop_exits": None}).loop_exits  # older manifests: off
    for bad in (dict(loop_norm=False), dict(final_norm=True)):
        with pytest.raises(CheckpointError, match="loop exits read each repeat's normed state"):
            DepthPlan((), (0, 1), 4, **{"loop_norm": True, "final_norm": False, **bad}, loop_exits=True)
    with pytest.raises(CheckpointError, match="loop exits"):
        DepthPlan((0,), (1,), 4, loop_norm=True, final_norm=False, loop_exits=True)
    # relabelled over another map of the same phases, it keeps them; derived from a bare map it has none
    assert fit_plan([0, 1] * 4, plan, True, False).loop_exits and not fit_plan([0, 1] * 4, None, True, False).loop_exits


def test_llama_layer_maps_are_instances():
    cycle = random_config(layers=6, blocks=2)
    assert cycle.depth_plan == DepthPlan((), (0, 1), 3)
    middle = random_config(layers=8, layer_map={"pattern": "middle-cycle", "num_blocks": 4}, blocks=4, exit_layer=3)
    assert middle.layer_map == MIDDLE
    plan = middle.depth_plan
    assert (plan.prelude, plan.core, plan.repeats, plan.coda) == ((0,), (1, 2), 3, (3,))
    assert [(s.phase, s.repeat) for s in plan.trip()] == [
        (PRELUDE, 0), (CORE, 0), (CORE, 0), (CORE, 1), (CORE, 1), (CORE, 2), (CORE, 2), (CODA, 0)]
    unshared = random_config(layers=4, layer_map=list(range(4)), blocks=4, exit_layer=4)
    assert unshared.depth_plan == DepthPlan((), (0, 1, 2, 3), 1)


def test_derived_plans():
    assert derive_plan([0, 1] * 4) == DepthPlan((), (0, 1), 4)
    assert derive_plan(MIDDLE) == DepthPlan((0,), (1, 2), 3, (3,))
    assert derive_plan([5, 0, 0, 0]).prelude == (5,) and derive_plan([5, 0, 0, 0]).repeats == 3
    # a map that is one cycle stays one (SPEED pipelines it) even where a coda would give more repeats
    assert derive_plan([0, 0, 0, 1] * 2) == DepthPlan((), (0, 0, 0, 1), 2)
    for layer_map in ([0, 1] * 4, MIDDLE, [0, 0, 1, 1], [3, 0, 1, 2, 0, 1, 2, 4, 5], list(range(5))):
        assert derive_plan(layer_map).layer_map == layer_map


def test_refitted_when_the_layer_map_changes():
    """with_layer_map (the share pass's aliases, the torch backend's artifact model) keeps the plan's loops and
    norms over the new labels; the layer map, its length and the norms are the plan's, never stored beside it."""
    ouro_like = random_config(layers=6, blocks=3)
    looped = dataclasses.replace(ouro_like, depth_plan=dataclasses.replace(ouro_like.depth_plan, loop_norm=True))
    assert looped.loop_norm and looped.depth_plan.core == (0, 1, 2) and looped.layer_map == [0, 1, 2] * 2
    merged = looped.with_layer_map([0, 0, 1] * 2)  # two equal blocks merged: same loops, new labels
    assert merged.depth_plan == DepthPlan((), (0, 0, 1), 2, (), loop_norm=True, final_norm=True)
    assert merged.layer_map == [0, 0, 1] * 2 and merged.num_hidden_layers == 6
    assert [layer for layer in range(6) if merged.depth_plan.ends_loop(layer)] == [2, 5]
    with pytest.raises(AttributeError):  # a derived fact: changed through the plan only
        merged.loop_norm = False


def test_pipeline_places_phases_on_slots():
    plan = derive_plan(MIDDLE)
    assert plan.valid_slots(3) == [1]  # this build runs a prelude / coda on the plain engine only
    assert plan.valid_slots(3, pipelined_phases=True) == [1, 3]
    pipe = plan.pipeline(3, draft_layer=3)
    assert pipe.stage_layers == 2 and pipe.stage_blocks == [1, 2]
    assert pipe.slot_layers() == [[0, 1, 2], [3, 4], [5, 6]]  # slot 0: the prelude, then its repeat
    assert pipe.readouts() == {"draft": {"slot": 0, "after_layer": 3, "coda": True},
                               "final": {"slot": 2, "after_layer": 7, "coda": True}}
    cycle = derive_plan([0, 1, 2, 3] * 4)
    assert cycle.valid_slots(4) == [1, 2, 4] and cycle.valid_slots(5) == [1, 2]  # the draft tap lies in slot 0
    two = cycle.pipeline(2, 4)
    assert two.stage_layers == 8 and two.slot_layers() == [list(range(8)), list(range(8, 16))]


def test_schedule_records_the_plan_and_the_layout_follows_it():
    sched = make_schedule(derive_plan([0, 1] * 4), 2, alpha=0.9, requested=4)
    assert sched.depth_plan == DepthPlan((), (0, 1), 4) and sched.readouts["final"]["slot"] == 3
    assert sched.to_json()["depth_plan"] == DepthPlan((), (0, 1), 4).to_json()
    assert sched.cache_layout == DepthPlan.from_json(sched.to_json()["depth_plan"]).cache_layout(sched.slots) == CacheLayout.cycle(2, 4)
    plain = make_schedule(derive_plan(MIDDLE), 3, alpha=0.9, requested=None)
    assert plain.slots == 1 and "prelude" in plain.reason
    assert plain.cache_layout == CacheLayout.plain(8)


def test_passes_fit_the_plan_to_the_weights(tmp_path):
    """The share pass derives the layer map from the weights of an Ouro checkpoint and keeps its loops;
    the schedule pass reads the plan."""
    from speedc.models.checkpoint.torch_io import open_checkpoint
    from speedc.passes import schedule, share, trace  # noqa: F401  (registers)

    directory = write_ouro(tmp_path / "ouro", layers=2, loops=3)
    cfg, weights = open_checkpoint(directory)
    state, _ = run_passes(CompileState(cfg, weights, BuildOptions(), has_speedc_section=False), ["trace", "share", "schedule"])
    assert state.depth_plan == DepthPlan((), (0, 1), 3, (), loop_norm=True, final_norm=False, loop_exits=True)
    assert state.schedule.slots == 3 and state.schedule.depth_plan is state.depth_plan  # the one plan object
    assert state.layer_map == state.depth_plan.layer_map == [0, 1] * 3  # the found map is the found plan's
    assert state.exit_norm is None  # the draft reads the loop-normed state


def test_config_round_trip_and_bad_plan(tmp_path):
    cfg = random_config(layers=8, layer_map={"pattern": "middle-cycle", "num_blocks": 4}, blocks=4, exit_layer=3)
    data = cfg.to_json_dict()
    assert data["speedc"]["depth"]["prelude"] == [0]
    assert read_config(data).depth_plan == cfg.depth_plan
    data["speedc"]["depth"] = dict(data["speedc"]["depth"], repeats=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as error:
        load_config(path)
    assert "\n" not in str(error.value) and "does not fit the layer map" in str(error.value)
    data["speedc"]["depth"] = dict(cfg.depth_plan.to_json(), injection="gated")
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as error:
        load_config(path)
    assert "\n" not in str(error.value) and "unknown injection 'gated'" in str(error.value)
    data["speedc"]["depth"] = {"prelude": [], "core": [], "repeats": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as error:
        load_config(path)
    assert "\n" not in str(error.value) and "at least one block" in str(error.value)


def test_config_json_holds_the_loop_norms_once():
    """The plan's norms are written in speedc.depth only; a config written when speedc.block held them too
    reads the same, and one whose two copies disagree is refused in one line."""
    base = random_config(layers=8, blocks=4)
    cfg = dataclasses.replace(base, depth_plan=dataclasses.replace(base.depth_plan, loop_norm=True, final_norm=False))
    data = cfg.to_json_dict()
    assert "loop_norm" not in data["speedc"]["block"] and data["speedc"]["depth"]["loop_norm"] is True
    assert (read_config(data).loop_norm, read_config(data).final_norm) == (True, False)
    data["speedc"]["block"].update(loop_norm=True, final_norm=False)  # the older form, both copies agreeing
    assert read_config(data).depth_plan == cfg.depth_plan
    data["speedc"]["block"]["loop_norm"] = False
    with pytest.raises(CheckpointError) as error:
        read_config(data)
    assert "\n" not in str(error.value) and "speedc.block.loop_norm = False but speedc.depth.loop_norm = True" in str(error.value)
    del data["speedc"]["depth"]  # no plan recorded: the block's norms
    assert read_config(data).loop_norm is False


def test_speedc_middle_cycle_checkpoint_pipelines_losslessly(tmp_path):
    """speedc's own checkpoint with a middle-cycle layer map (declared in its speedc section) gets the
    prelude / coda pipeline too: batched SPEED == batched plain == the PyTorch reference (greedy), SPEED ==
    plain (seeded sampling), with mispredictions (random weights). The transformers oracle for this
    shape is tests/numeric/test_family_looped_llama.py."""
    import torch

    from conftest import build_artifact, randomize
    from speedc import Engine
    from speedc.format.artifact import read_manifest
    from speedc.models.generate import generate as reference_generate
    from speedc.models.llama import SharedLlama

    cfg = random_config(layers=8, layer_map={"pattern": "middle-cycle", "num_blocks": 4}, blocks=4, exit_layer=3,
                        exit_norm="final", hidden=64, heads=4, kv_heads=2)
    model = randomize(SharedLlama(cfg), seed=21)
    artifact = build_artifact(model, tmp_path / "art")
    manifest = read_manifest(artifact)
    assert manifest.slots == 3 and manifest.schedule["slot_layers"] == [[0, 1, 2], [3, 4], [5, 6]]
    engine = Engine.load(artifact, lazy=True)
    prompts = [torch.randint(0, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    plain = engine.generate_batch(prompts, max_new_tokens=12, stop_at_eos=False, row_budget=0, max_batch=2)
    speed = engine.generate_batch(prompts, max_new_tokens=12, stop_at_eos=False, max_batch=2)
    reference = [reference_generate(model, p, 12) for p in prompts]
    assert [r.ids for r in speed] == [r.ids for r in plain] == reference
    assert sum(r.stats.mispredicted for r in speed) > 0
    settings = [{"temperature": 1.0, "seed": 5}, {"temperature": 0.7, "top_k": 10, "seed": 6}]
    runs = [engine.generate_batch(prompts, max_new_tokens=12, stop_at_eos=False, settings=settings, max_batch=2, **extra)
            for extra in ({}, {"row_budget": 0})]
    assert [r.ids for r in runs[0]] == [r.ids for r in runs[1]]


def test_cross_repeat_attention_plan():
    """IQuest's cross-repeat attention: later repeats read repeat 0's layer at the same core index, one
    repeat a slot (a slot's later repeat would read repeat 0 inside its own step), kept through JSON."""
    plan = DepthPlan((), (0, 1, 2), 3, cross_window=4)
    assert [plan.cross_source(layer) for layer in range(9)] == [None, None, None, 0, 1, 2, 0, 1, 2]
    assert plan.valid_slots(3) == [1, 3] and DepthPlan((), (0, 1, 2), 3).valid_slots(3) == [1, 3]
    assert DepthPlan((), (0, 1), 4, cross_window=4).valid_slots(2) == [1, 4]  # not P = 2 (two repeats a slot)
    assert DepthPlan((), (0, 1), 4).valid_slots(2) == [1, 2, 4]
    assert DepthPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert "cross-repeat attention" in plan.describe()
    for bad in (dict(prelude=(0,), core=(1,), repeats=2), dict(prelude=(), core=(0,), repeats=1)):
        with pytest.raises(CheckpointError, match="cross-repeat attention is built for one core"):
            DepthPlan(**bad, cross_window=4)
    with pytest.raises(CheckpointError, match="cross_window must be an integer"):
        DepthPlan((), (0,), 2, cross_window=-1)
