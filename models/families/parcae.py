"""Family `parcae`: Parcae (sandyresearch/parcae, parcae_lm/models/parcae/parcae.py), a looped decoder whose
core reads the prelude's output through a diagonal, decaying injection.

    e = ln_prelude(prelude(wte(ids)))                # n_layers_in_prelude blocks, once (ln_prelude if prelude_norm)
    s = 0                                            # the published code draws s at random (state_init); here zero,
                                                     #   or --state-init random: drawn per position
    for r in range(mean_recurrence):
        s = decay * s + dt * (e B^T)                 # dt = softplus(dt_bias), decay = exp(-dt * exp(A_log)), per channel
        s = core(s)                                  # n_layers_in_recurrent_block blocks; K/V per (r, layer)
    logits = lm_head(ln_f(coda(C(s))))               # the readout projection C, n_layers_in_coda blocks, tied head

    block (TransformerPreNormBlock): x = x + attn(norm_1 x); x = x + mlp(norm_2 x)
    attention: c_q / c_k / c_v / c_proj; rotary over ADJACENT pairs, then q and k RMS-normed per head
               (weightless: qk_norm); on value-embedding layers v += 2 sigmoid(ve_gate(xn[:32])) * value_embeds[token]
    mlp (BaseMLP, ReLU2): proj(0.5 * relu(fc x)^2)

Value embeddings: value_embeds.{i} exists for block i when has_ve(i, prelude + core + coda); a layer's
ve_gate exists when has_ve(layer_id, core * mean_backprop_depth), layer_id counting the coda after all
mean_recurrence repeats; v gets the embedding only where both exist (the others are read and dropped).
A core block's value embedding is its token's on every repeat: a slot carries its token's id ([state |
e | id], ModelConfig.carries_token_id).

The computation is the published generation path's (receval/models/parcae.py forward_for_generation):
every token runs mean_recurrence repeats (training's sampled depths do not apply).

As a depth plan: prelude (normed), a core repeated R times with the diagonal-decay injection, the readout
projection before the coda at every readout, model.norm (ln_f) at the head. q and k rows are reordered
per head from adjacent rotary pairs to speedc's half-split rotary (every score unchanged: q and k get the
same permutation, and the per-head q/k norm does not depend on the order).
"""

from __future__ import annotations

import math
from typing import Any

from speedc.errors import CheckpointError
from speedc.models.config import ModelConfig
from speedc.format.depth_plan import DepthPlan
from speedc.models.families import Family, boolean, common_fields, positive_int, refuse_options, register_family
from speedc.models.families.huginn import half_split_order

INJECTION = "diagonal-decay"
SCALE_FREE_INITS = ("scaled-zero",)  # init strategies whose logit_scale and embedding_scale are 1 (the published one)

# What the published model does that speedc would not reproduce; the values shown are the published ones.
REFUSED = {
    "injection_type": lambda v: v == "diagonal",
    "block_class_name": lambda v: v == "TransformerPreNormBlock",
    "norm_class_name": lambda v: v == "RMSNorm",
    "mlp_class_name": lambda v: v == "BaseMLP",
    "nonlin_name": lambda v: v == "ReLU2",
    "bias": lambda v: not v,
    "qk_bias": lambda v: not v,
    "clip_qkv": lambda v: v is None,
    "logit_softcap": lambda v: v is None,
    "use_abacus": lambda v: not v,
    "attn_impl": lambda v: v in ("flash", "sdpa"),
    "init_strategy": lambda v: v in SCALE_FREE_INITS,  # others scale the embedding or the logits
    "mup_model_scaling_factor": lambda v: v == 1,
    "model_class_name": lambda v: v == "Parcae",
}
BLOCK_NAMES = {"norm_1.weight": "input_layernorm.weight", "norm_2.weight": "post_attention_layernorm.weight",
               "attn.c_v.weight": "self_attn.v_proj.weight", "attn.c_proj.weight": "self_attn.o_proj.weight",
               "attn.ve_gate.weight": "self_attn.value_gate.weight", "mlp.fc.weight": "mlp.up_proj.weight",
               "mlp.proj.weight": "mlp.down_proj.weight"}
GLOBAL_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight", "transformer.ln_f.weight": "model.norm.weight",
                "transformer.ln_prelude.weight": "model.prelude_norm.weight", "transformer.C.weight": "model.readout.weight",
                "transformer.adapter.A_log": "model.injection.A_log", "transformer.adapter.dt_bias": "model.injection.dt_bias",
                "transformer.adapter.B": "model.injection.B", "lm_head.weight": "lm_head.weight"}


def recognises(data: dict[str, Any]) -> bool:
    """Parcae's config.json is its config dataclass written out (no architectures / model_type keys)."""
    return data.get("model_class_name") == "Parcae" or data.get("_class_name") == "ParcaeConfig"


def phases(data: dict[str, Any]) -> tuple[int, int, int, int]:
    """(prelude, core, coda, mean_recurrence) layer counts."""
    coda = data.get("n_layers_in_coda", 1)
    if not isinstance(coda, int) or isinstance(coda, bool) or coda < 0:
        raise CheckpointError(f"config.json: n_layers_in_coda must be a non-negative integer, got {coda!r}")
    return (positive_int(data, "n_layers_in_prelude", 1), positive_int(data, "n_layers_in_recurrent_block", 4), coda,
            positive_int(data, "mean_recurrence", 32))


def has_ve(index: int, count: int) -> bool:
    """The published rule: alternating layers, the last one always included."""
    return index % 2 == (count - 1) % 2


def value_embedding_use(data: dict[str, Any]) -> tuple[set[int], set[int]]:
    """(blocks holding a value_embeds table, blocks holding a ve_gate), by the published construction."""
    prelude, core, coda, repeats = phases(data)
    blocks = prelude + core + coda
    gate_layers = core * positive_int(data, "mean_backprop_depth", 8)  # the published config's n_layer
    coda_first_id = prelude + core * repeats  # the published coda's layer_id offset

    def layer_id(block: int) -> int:
        return block if block < prelude + core else coda_first_id + block - prelude - core

    tables = {b for b in range(blocks) if has_ve(b, blocks)}
    gates = {b for b in range(blocks) if has_ve(layer_id(b), gate_layers)}
    return tables, gates


def depth_plan(data: dict[str, Any], hidden: int) -> DepthPlan:
    prelude, core, coda, repeats = phases(data)
    return DepthPlan(tuple(range(prelude)), tuple(range(prelude, prelude + core)), repeats,
                     tuple(range(prelude + core, prelude + core + coda)), injection=INJECTION, prelude_norm=boolean("prelude_norm", data.get("prelude_norm", False)),
                     readout_projection=True, state_std=math.sqrt(2 / (5 * hidden)))  # like-init: the embedding's std


def _check_shapes(data: dict[str, Any]) -> tuple[int, int, int]:
    hidden, heads = data.get("n_embd"), data.get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1 or hidden % heads:
        raise CheckpointError(f"config.json: n_embd {hidden!r} must be a multiple of num_attention_heads {heads!r}")
    if data.get("num_key_value_heads") not in (None, heads):  # the core's blocks always have heads kv heads
        raise CheckpointError(f"config.json: Parcae with {data['num_key_value_heads']} key/value heads for {heads} heads "
                              "is not supported")
    if data.get("recurrent_num_attention_heads") not in (None, heads):  # the core's own head count
        raise CheckpointError(f"config.json: Parcae option recurrent_num_attention_heads="
                              f"{data['recurrent_num_attention_heads']!r} is not supported by this speedc build "
                              f"(the core's heads differ from the prelude's {heads})")
    if data.get("use_fused_head") == "full-triton" and not data.get("tie_embeddings", False):
        raise CheckpointError("config.json: Parcae option use_fused_head='full-triton' with untied embeddings (a "
                              "transposed lm_head) is not supported by this speedc build")
    inter = data.get("intermediate_size") or 4 * hidden
    for key, value in (("recurrent_embedding_dimension", hidden), ("recurrent_intermediation_embedding_dimension", inter)):
        if data.get(key, value) != value:  # a core of another width: its blocks would not be the prelude's shape
            raise CheckpointError(f"config.json: Parcae option {key}={data[key]!r} (the core's width differs from "
                                  f"the prelude's {value}) is not supported by this speedc build")
    rope = data.get("rope_settings") or {}
    if not isinstance(rope, dict) or not rope.get("use_rope", True) or rope.get("rope_condense_ratio", 1) != 1:
        raise CheckpointError(f"config.json: Parcae option rope_settings={rope!r} is not supported by this speedc build "
                              "(only rotary positions, condense ratio 1)")
    return hidden, heads, inter


def read_config(data: dict[str, Any]) -> ModelConfig:
    refuse_options(data, "Parcae", REFUSED)
    hidden, heads, inter = _check_shapes(data)
    vocab = data.get("padded_vocab_size")
    if vocab is None:  # the published find_multiple(vocab_size, padding_multiple)
        multiple = positive_int(data, "padding_multiple", 512)
        vocab = -(-positive_int(data, "vocab_size") // multiple) * multiple
    tables, gates = value_embedding_use(data)
    plan = depth_plan(data, hidden)
    rope = data.get("rope_settings") or {}
    fields = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": heads, "rms_norm_eps": data.get("norm_eps", 1e-5),
              "rope_theta": rope.get("rope_base", 50000), "max_position_embeddings": data.get("block_size", 4096),
              "tie_word_embeddings": boolean("tie_embeddings", data.get("tie_embeddings", False))}
    fields.update({key: data[key] for key in ("bos_token_id", "eos_token_id") if key in data})
    return ModelConfig(depth_plan=plan, exit_layer=plan.first_repeat_end(),
                       exit_norm="final", architecture="parcae", qk_norm=boolean("qk_norm", data.get("qk_norm", False)),
                       mlp_act="relu2", value_embed_blocks=tuple(sorted(tables & gates)), **common_fields(fields))


def map_tensors(sources: dict, cfg: ModelConfig) -> dict:
    """Parcae's tensor names -> speedc's (q / k row orders; nothing read). A value_embeds table or ve_gate
    the published forward never applies (its partner absent) is dropped."""
    plan = cfg.depth_plan
    h, hd = cfg.num_attention_heads, cfg.head_dim
    order = half_split_order(h, hd)
    out, rest = {}, dict(sources)
    for name, ours in GLOBAL_NAMES.items():
        if name in rest:
            out[ours] = rest.pop(name)
    groups = (("prelude", plan.prelude), ("core_block", plan.core), ("coda", plan.coda))
    for group, blocks in groups:
        for index, block in enumerate(blocks):
            theirs, ours = f"transformer.{group}.{index}.", f"model.blocks.{block}."
            for projection, speedc_name in (("c_q", "q_proj"), ("c_k", "k_proj")):
                if theirs + f"attn.{projection}.weight" in rest:
                    weight = rest.pop(theirs + f"attn.{projection}.weight")  # [h hd, H]
                    if weight.shape[0] != h * hd:
                        raise CheckpointError(f"{theirs}attn.{projection}.weight has {weight.shape[0]} rows, config.json "
                                              f"implies {h * hd}")
                    out[ours + f"self_attn.{speedc_name}.weight"] = weight.reordered(order)
            for name, speedc_name in BLOCK_NAMES.items():
                if theirs + name in rest:
                    out[ours + speedc_name] = rest.pop(theirs + name)
            if f"value_embeds.{block}.weight" in rest:
                out[ours + "self_attn.value_embed.weight"] = rest.pop(f"value_embeds.{block}.weight")
            if block not in cfg.value_embed_blocks:  # a table without its gate, or a gate without its table: inert
                out.pop(ours + "self_attn.value_embed.weight", None)
                out.pop(ours + "self_attn.value_gate.weight", None)
    out.update(rest)  # anything left is reported by the shape check as unexpected, under its own name
    return out


def config_notes(data: dict[str, Any]) -> list[str]:
    hidden = data.get("n_embd")
    notes = [f"depth plan {depth_plan(data, hidden if isinstance(hidden, int) and hidden > 0 else 1).describe()}"]
    tables, gates = value_embedding_use(data)
    if tables != gates:
        notes.append(f"value embeddings applied on blocks {sorted(tables & gates)}; tables {sorted(tables - gates)} and "
                     f"gates {sorted(gates - tables)} have no partner and are never applied (read and dropped)")
    if data.get("state_init", "like-init") != "zero":
        notes.append(f"state_init={data.get('state_init', 'like-init')!r} in config.json (a random start state): speedc "
                     "starts the core's state at zero unless built with --state-init random --seed S (drawn per "
                     "position, the same in plain decoding and SPEED)")
    return notes


register_family(Family("parcae", ("Parcae",), ("parcae",), read_config, ignored_tensors=("freqs_cis",),
                       map_tensors=map_tensors, recognises=recognises, own_options=("qk_norm",),
                       description="Parcae looped decoder (prelude, core x R with a diagonal injection, coda)",
                       notes=config_notes))
