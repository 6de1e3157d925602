"""Family `ouro`: ByteDance Ouro (OuroForCausalLM), a looped transformer.

    h = embed(ids)
    for loop in range(total_ut_steps):              # the whole stack is the cycle: P = loops
        for layer in layers:                         # each (loop, layer) has its own KV
            h = h + input_layernorm_2(attn(input_layernorm(h)))            # sandwich norms
            h = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))
        h = model.norm(h)                            # every loop, the last included
    logits = lm_head(h)                              # no further norm

SPEED's draft is lm_head of the loop-1 normed state (exit after L layers, no norm: the loop norm did
it). Every loop's normed state is a readout (the plan's loop_exits), so a request may choose the loops run
and the exit rule (exit_at_step, exit_threshold, weighted_exit: runtimes/exit_rule.py); the gate
`model.early_exit_gate.*` is kept for them in the manifest (the model itself never reads it). A threshold
in config.json is shown by `inspect`, never applied by default: a request asks for one.
"""

from __future__ import annotations

from typing import Any

from speedc.models.config import ModelConfig
from speedc.models.families import Family, common_fields, positive_int, refuse_options, register_family
from speedc.format.depth_plan import looped_plan

# Options that would change the computation; None / False is what the checkpoints ship (sliding window and
# layer types: models/families/__init__.py UNIMPLEMENTED_ATTENTION, for every family).
REFUSED = {
    "rope_scaling": lambda v: v is None,
    "exit_at_step": lambda v: v is None,
    "use_weighted_exit": lambda v: not v,
}


def read_config(data: dict[str, Any]) -> ModelConfig:
    refuse_options(data, "Ouro", REFUSED)
    layers = positive_int(data, "num_hidden_layers")
    loops = positive_int(data, "total_ut_steps", default=4)
    plan = looped_plan(layers, loops, loop_norm=True, final_norm=False, loop_exits=True)  # model.norm after every loop
    return ModelConfig(depth_plan=plan, exit_layer=plan.first_repeat_end(),
                       exit_norm="none", architecture="ouro", sandwich_norms=True, **common_fields(data))


def config_notes(data: dict[str, Any]) -> list[str]:
    notes = [f"{data.get('num_hidden_layers')} layers looped total_ut_steps={data.get('total_ut_steps', 4)} times"]
    threshold = data.get("early_exit_threshold")
    if threshold is not None:
        notes.append(f"early_exit_threshold={threshold} in config.json is not applied by default: a request asks for "
                     "an exit rule (exit_threshold, exit_at_step, weighted_exit, loops)")
    return notes


register_family(Family("ouro", ("OuroForCausalLM",), ("ouro",), read_config, ignored_tensors=("model.early_exit_gate.",),
                       exit_gate=("model.early_exit_gate.weight", "model.early_exit_gate.bias"),
                       description="ByteDance Ouro looped transformers (Ouro-1.4B, Ouro-2.6B, -Thinking)",
                       notes=config_notes))
