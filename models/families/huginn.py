"""Family `huginn`: Huginn-0125 (RavenForCausalLM, model_type huginn_raven), a recurrent-depth decoder.

    e = prelude(wte(ids) * sqrt(n_embd))             # n_layers_in_prelude blocks, once
    s = 0                                            # the core's state (the published code: random; here zero,
                                                     #   or --state-init random: drawn per position)
    for r in range(recurrence):                      # mean_recurrence by default (--recurrence R at build)
        s = core(adapter(cat[s, e]))                 # n_layers_in_recurrent_block blocks; K/V per (r, layer)
    logits = lm_head(ln_f(coda(ln_f(s))))            # n_layers_in_coda blocks, ln_f twice (one weight)

    block (SandwichBlock, post-norm):  x = norm_2(x + attn(norm_1(x)));  x = norm_4(x + mlp(norm_3(x)))
    attention: Wqkv rows q | k | v; qk_bias[0] / [1] added to q / k before rotary over ADJACENT pairs
    mlp: fc rows gate | up; proj(silu(gate) * up)

As a depth plan: prelude, a core of 4 blocks repeated R times with the adapter injection, a readout norm
(ln_f) before the coda at every readout and the final norm (ln_f again) at the head. The tensors map
onto speedc's names at read time (nothing is copied): Wqkv and fc split into row ranges; q and k rows
(and their biases) reordered per head from adjacent rotary pairs to the half-split layout speedc's
rotary uses, which leaves every attention score unchanged (q and k get the same permutation).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from speedc.errors import CheckpointError
from speedc.models.config import ModelConfig
from speedc.format.depth_plan import DepthPlan
from speedc.models.families import Family, boolean, common_fields, positive_int, refuse_options, register_family

INJECTION = "adapter-concat"

# What the published model does that speedc would not reproduce; the values shown are the published ones.
REFUSED = {
    "injection_type": lambda v: v == "linear",
    "bias": lambda v: not v,
    "test_time_noise": lambda v: not v,
    "block_class_name": lambda v: v == "SandwichBlock",
    "mlp_class_name": lambda v: v == "GatedMLP",
    "nonlin_name": lambda v: v == "SiLU",
    "norm_class_name": lambda v: v in ("RMSNorm_llama", "RMSNorm"),
}
BLOCK_NORMS = {"norm_1": "input_layernorm", "norm_2": "input_layernorm_2", "norm_3": "post_attention_layernorm",
               "norm_4": "post_attention_layernorm_2"}


def _field(data: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if data.get(name) is not None:
            return data[name]
    return default


def depth_plan(data: dict[str, Any], recurrence: int | None = None) -> DepthPlan:
    hidden = _field(data, "n_embd", "hidden_size")
    prelude = positive_int(data, "n_layers_in_prelude", 2)
    core = positive_int(data, "n_layers_in_recurrent_block", 4)
    coda = data.get("n_layers_in_coda", 2)
    if not isinstance(coda, int) or isinstance(coda, bool) or coda < 0:
        raise CheckpointError(f"config.json: n_layers_in_coda must be a non-negative integer, got {coda!r}")
    repeats = recurrence if recurrence is not None else positive_int(data, "mean_recurrence", 32)
    return DepthPlan(tuple(range(prelude)), tuple(range(prelude, prelude + core)), repeats,
                     tuple(range(prelude + core, prelude + core + coda)), injection=INJECTION, readout_norm=True, state_std=random_state_std(hidden))


def random_state_std(hidden: Any) -> float:
    """The published initialize_state's scale: init std sqrt(2 / (5 H)), then x embed_scale sqrt(H)."""
    return math.sqrt(2 / (5 * hidden)) * math.sqrt(hidden) if isinstance(hidden, int) and hidden > 0 else 0.0


def read_config(data: dict[str, Any]) -> ModelConfig:
    refuse_options(data, "Huginn", REFUSED)
    hidden = _field(data, "n_embd", "hidden_size")
    heads = _field(data, "n_heads", "num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1 or hidden % heads:
        raise CheckpointError(f"config.json: n_embd {hidden!r} must be a multiple of n_heads {heads!r}")
    kv_heads = _field(data, "num_key_value_heads", default=heads)
    if kv_heads != heads:  # qk_bias is [2, 1, heads, head_dim]: one bias per query head for k too
        raise CheckpointError(f"config.json: Huginn with {kv_heads} key/value heads for {heads} heads is not supported")
    plan = depth_plan(data)
    fields = dict(data, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                  head_dim=hidden // heads, vocab_size=_field(data, "padded_vocab_size", "vocab_size"),
                  rms_norm_eps=_field(data, "norm_eps", "rms_norm_eps", default=1e-6),
                  rope_theta=_field(data, "rope_base", "rope_theta", default=50000.0),
                  max_position_embeddings=_field(data, "block_size", "max_position_embeddings", default=4096),
                  tie_word_embeddings=boolean("tie_embeddings", _field(data, "tie_embeddings", "tie_word_embeddings",
                                                                      default=True)))
    for key in ("rope_parameters", "rope_scaling", "attention_bias", "mlp_bias", "hidden_act"):
        fields.pop(key, None)  # not Huginn keys: its own are checked above
    return ModelConfig(depth_plan=plan, exit_layer=plan.first_repeat_end(),
                       exit_norm="final", architecture="huginn", sandwich_norms=True, post_norms=True,
                       qk_bias=boolean("qk_bias", data.get("qk_bias", True)), embed_scale=math.sqrt(hidden),
                       **common_fields(fields))


def half_split_order(heads: int, head_dim: int) -> np.ndarray:
    """Row order taking each head's adjacent rotary pairs (x0 x1)(x2 x3).. to halves x0 x2 .. | x1 x3 .."""
    within = np.concatenate((np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)))  # [hd]
    return (np.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)  # [heads * hd]


def map_tensors(sources: dict, cfg: ModelConfig) -> dict:
    """Huginn's tensor names and fused layouts -> speedc's (row ranges and row orders; nothing read)."""
    plan = cfg.depth_plan
    h, hd, inter = cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    order = half_split_order(h, hd)
    groups = {"prelude": 0, "core_block": len(plan.prelude), "coda": len(plan.prelude) + len(plan.core)}
    out, rest = {}, dict(sources)
    simple = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
              "transformer.adapter.weight": "model.adapter.weight", "lm_head.weight": "lm_head.weight"}
    for name, ours in simple.items():
        if name in rest:
            out[ours] = rest.pop(name)
    for group, first in groups.items():
        index = 0
        while f"transformer.{group}.{index}.attn.Wqkv.weight" in rest:
            theirs, ours = f"transformer.{group}.{index}.", f"model.blocks.{first + index}."
            qkv = rest.pop(theirs + "attn.Wqkv.weight")  # [3 h hd, H]
            if qkv.shape[0] != 3 * h * hd:
                raise CheckpointError(f"{theirs}attn.Wqkv.weight has {qkv.shape[0]} rows, config.json implies {3 * h * hd}")
            out[ours + "self_attn.q_proj.weight"] = qkv.rows(0, h * hd).reordered(order)
            out[ours + "self_attn.k_proj.weight"] = qkv.rows(h * hd, h * hd).reordered(order)
            out[ours + "self_attn.v_proj.weight"] = qkv.rows(2 * h * hd, h * hd)
            if theirs + "attn.qk_bias" in rest:
                bias = rest.pop(theirs + "attn.qk_bias")  # [2, 1, h, hd]
                if bias.numel != 2 * h * hd:
                    raise CheckpointError(f"{theirs}attn.qk_bias has shape {list(bias.shape)}, config.json implies "
                                          f"[2, 1, {h}, {hd}]")
                flat = bias.reshaped((2 * h * hd,))
                out[ours + "self_attn.q_bias"] = flat.rows(0, h * hd).reordered(order)
                out[ours + "self_attn.k_bias"] = flat.rows(h * hd, h * hd).reordered(order)
            if theirs + "attn.proj.weight" in rest:
                out[ours + "self_attn.o_proj.weight"] = rest.pop(theirs + "attn.proj.weight")
            fc = rest.pop(theirs + "mlp.fc.weight", None)  # [2 I, H]: gate | up
            if fc is not None:
                if fc.shape[0] != 2 * inter:
                    raise CheckpointError(f"{theirs}mlp.fc.weight has {fc.shape[0]} rows, config.json implies {2 * inter}")
                out[ours + "mlp.gate_proj.weight"] = fc.rows(0, inter)
                out[ours + "mlp.up_proj.weight"] = fc.rows(inter, inter)
            if theirs + "mlp.proj.weight" in rest:
                out[ours + "mlp.down_proj.weight"] = rest.pop(theirs + "mlp.proj.weight")
            for norm, speedc_name in BLOCK_NORMS.items():
                if theirs + f"{norm}.weight" in rest:
                    out[ours + f"{speedc_name}.weight"] = rest.pop(theirs + f"{norm}.weight")
            index += 1
    out.update(rest)  # anything left is reported by the shape check as unexpected, under its own name
    return out


def config_notes(data: dict[str, Any]) -> list[str]:
    notes = [f"depth plan {depth_plan(data).describe()}"]
    if data.get("state_init", "like-init") != "zero":
        notes.append(f"state_init={data.get('state_init', 'like-init')!r} in config.json (a random start state): speedc "
                     "starts the core's state at zero unless built with --state-init random --seed S (drawn per "
                     "position, the same in plain decoding and SPEED)")
    return notes


register_family(Family("huginn", ("RavenForCausalLM",), ("huginn_raven",), read_config,
                       ignored_tensors=("freqs_cis",), map_tensors=map_tensors,
                       description="Huginn-0125 recurrent depth (prelude, core x R with injection, coda)",
                       notes=config_notes))
