"""Family `nanbeige`: Nanbeige4.2 (NanbeigeForCausalLM), plain Llama blocks run num_loops times.

    h = embed(ids)
    for loop in range(num_loops):                    # P = loops; each (loop, layer) has its own KV
        for layer in layers: h = llama_layer(h)
        if not skip_loop_final_norm: h = model.norm(h)   # every loop, the last included
    if skip_loop_final_norm: h = model.norm(h)           # once, at the end
    logits = lm_head(h)

The draft is lm_head of the loop-1 state (through model.norm when the loops do not norm it). With a norm
after every loop each loop's state is a readout (the plan's loop_exits): a request may run fewer loops
(`loops`, as num_loops set lower) or read an earlier one (`exit_at_step`); there is no exit gate. The
published checkpoint turns every optional feature off; a config that turns one on is refused.
"""

from __future__ import annotations

from typing import Any

from speedc.models.config import ModelConfig
from speedc.models.families import Family, common_fields, off, positive_int, refuse_options, register_family
from speedc.format.depth_plan import looped_plan


REFUSED = {name: off for name in (
    "enable_mhc", "enable_hyper_connection", "enable_h_res_identity", "loop_share_kv", "enable_double_loop_split",
    "loop_middle_layers", "qk_layernorm", "emb_neighbor_num", "insert_ngram_layer_idx", "ngram_insert_all_layers",
    "enable_depth_attention", "mlp_bias", "attention_bias")}
REFUSED["rope_scaling"] = lambda v: v is None


def loop_count(data: dict[str, Any]) -> int:
    weights = data.get("loop_loss_weights") or []
    if weights:  # the published code derives the loop count from it when it is given
        return len(weights) + 1
    return positive_int(data, "num_loops")


def read_config(data: dict[str, Any]) -> ModelConfig:
    refuse_options(data, "Nanbeige", REFUSED)
    layers = positive_int(data, "num_hidden_layers")
    loops = loop_count(data)
    skip = bool(data.get("skip_loop_final_norm", False))
    plan = looped_plan(layers, loops, loop_norm=not skip, final_norm=skip, loop_exits=not skip)
    return ModelConfig(depth_plan=plan, exit_layer=plan.first_repeat_end(),
                       exit_norm="final" if skip else "none", architecture="nanbeige", sandwich_norms=False,
                       **common_fields(data))


def config_notes(data: dict[str, Any]) -> list[str]:
    norm = "once at the end" if data.get("skip_loop_final_norm") else "after every loop"
    return [f"{data.get('num_hidden_layers')} layers looped {loop_count(data)} times, model.norm {norm}"]


register_family(Family("nanbeige", ("NanbeigeForCausalLM",), ("nanbeige",), read_config,
                       description="Nanbeige4.2 looped Llama (Nanbeige4.2-3B)", notes=config_notes))
