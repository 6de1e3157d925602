"""Family `looped_llama`: a Llama decoder whose middle layers loop (prelude, core x loops, coda), each
unique layer stored once under Llama's tensor names. The whole description is a depth plan
(speedc/format/depth_plan.py); nothing downstream knows this family.

    config.json: LlamaForCausalLM's fields, architectures ["LoopedLlamaForCausalLM"], model_type
    "looped_llama", num_hidden_layers = the stored (unique) layers, and
        num_prelude_layers  layers run once on entry            (default 0)
        num_coda_layers     layers run at the readout            (default 0)
        num_loops           repeats of the layers in between     (required)
        loop_norm           model.norm after every repeat        (default false)
    model.layers.{i}: prelude layers first, then the core, then the coda

    h = embed(ids)
    for layer in prelude: h = layer(h)
    for loop in range(num_loops):
        for layer in core: h = layer(h)
        if loop_norm: h = model.norm(h)
    for layer in coda: h = layer(h)
    logits = lm_head(h if loop_norm and not coda else model.norm(h))

E.g. 4 stored layers, 1 prelude, 1 coda, 3 loops: the layer map [0, 1, 2, 1, 2, 1, 2, 3]. Without a
prelude and coda it is a cycle, which SPEED pipelines one loop per slot. The draft reads the state
after the prelude and the first loop (through model.norm unless the loop norm did it).
"""

from __future__ import annotations

from typing import Any

from speedc.errors import CheckpointError
from speedc.models.config import ModelConfig
from speedc.format.depth_plan import DepthPlan
from speedc.models.families import Family, boolean, common_fields, integer, positive_int, register_family


def depth_plan(data: dict[str, Any]) -> DepthPlan:
    stored = positive_int(data, "num_hidden_layers")
    prelude = integer(data, "num_prelude_layers", data.get("num_prelude_layers", 0))
    coda = integer(data, "num_coda_layers", data.get("num_coda_layers", 0))
    loops = positive_int(data, "num_loops")
    loop_norm = boolean("loop_norm", data.get("loop_norm", False))
    core = stored - prelude - coda
    if prelude < 0 or coda < 0 or core < 1:
        raise CheckpointError(f"config.json: {stored} stored layers leave no core after {prelude} prelude and "
                              f"{coda} coda layers")
    # The final readout normalizes unless the last loop's norm is the last thing that touched the state.
    final_norm = not (loop_norm and coda == 0)
    return DepthPlan(tuple(range(prelude)), tuple(range(prelude, prelude + core)), loops,
                     tuple(range(prelude + core, stored)), loop_norm=loop_norm, final_norm=final_norm)


def read_config(data: dict[str, Any]) -> ModelConfig:
    plan = depth_plan(data)
    draft_norm = "none" if plan.loop_norm else "final"  # a loop-normed state is read as it is
    return ModelConfig(depth_plan=plan, exit_layer=plan.first_repeat_end(),
                       exit_norm=draft_norm, architecture="looped_llama", **common_fields(data))


def config_notes(data: dict[str, Any]) -> list[str]:
    return [f"depth plan {depth_plan(data).describe()}"]


register_family(Family("looped_llama", ("LoopedLlamaForCausalLM",), ("looped_llama",), read_config,
                       description="Llama with looped middle layers (prelude, core x loops, coda), unique layers stored once",
                       notes=config_notes))
