"""Family `iquest_loop`: IQuest-Coder-V1-Loop (IQuestLoopCoderForCausalLM, model type `iquestloopcoder`),
Llama layers run loop_num = 2 times, the second loop reading the first's K/V.

    h = embed(ids)
    loop 0: for layer i: h = llama_layer_i(h)               (own K/V, full causal)
    loop 1: for layer i: the layer's attention becomes      (no norm between the loops)
              g * Attn(q, loop 0's K/V of layer i, full causal) + (1 - g) * Attn(q, its own K/V, last W positions)
              g = sigmoid(<q_h, w_h> + b_h) per head, q after rotary, w / b: model.gate_projections.{i}
    logits = lm_head(model.norm(h))

As the published code reads it (vLLM / SGLang iquest_loopcoder.py, mlx-lm iquestloopcoder.py): W =
loop_window_size keys up to the query's own (vLLM's sliding window and mlx-lm's mask; SGLang hands W to
a window that excludes the query's own key, so attends W + 1 there), loop 0's K/V up to the query's position. SPEED pipelines it
at P = 2 (one loop a slot): loop 1 of token t reads loop 0's K/V at positions <= t, which slot 0 wrote a
step earlier. The draft is lm_head(model.norm(h)) after loop 0 (the published model has no exit head).
"""

from __future__ import annotations

from typing import Any

from speedc.errors import CheckpointError
from speedc.models.config import ModelConfig
from speedc.format.depth_plan import DepthPlan
from speedc.models.families import Family, common_fields, off, positive_int, refuse_options, register_family

REFUSED = {
    "loop_num": lambda v: v == 2,  # the published checkpoints' count; mlx-lm runs only 2
    "rope_scaling": lambda v: v is None,
    "dual_chunk_attention_config": lambda v: v is None,
    "is_causal": lambda v: v is True,
    "attention_bias": off,
    "mlp_bias": off,
}


def read_config(data: dict[str, Any]) -> ModelConfig:
    refuse_options(data, "IQuestLoopCoder", REFUSED)
    layers = positive_int(data, "num_hidden_layers")
    loops = positive_int(data, "loop_num", default=2)
    window = positive_int(data, "loop_window_size", default=64)
    fields = common_fields(data)
    # vLLM and SGLang size a head hidden_size / heads, mlx-lm reads head_dim: refused where they would differ
    derived = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["head_dim"] not in (None, derived):
        raise CheckpointError(f"config.json: IQuestLoopCoder head_dim={fields['head_dim']} differs from hidden_size / "
                              f"num_attention_heads = {derived} (the published implementations disagree there)")
    plan = DepthPlan((), tuple(range(layers)), loops, cross_window=window)
    return ModelConfig(depth_plan=plan, exit_layer=plan.first_repeat_end(),
                       exit_norm="final", architecture="iquest_loop", **fields)


def config_notes(data: dict[str, Any]) -> list[str]:
    return [f"{data.get('num_hidden_layers')} layers looped {data.get('loop_num', 2)} times; the second loop reads "
            f"the first's K/V, gated against its own last loop_window_size={data.get('loop_window_size', 64)} positions "
            "(the query's own included, as vLLM and mlx-lm count them; SGLang's window holds one more)"]


register_family(Family("iquest_loop", ("IQuestLoopCoderForCausalLM",), ("iquestloopcoder",), read_config,
                       description="IQuest-Coder-V1-Loop (loop 2 reads loop 1's K/V, gated with a sliding window)",
                       notes=config_notes))
