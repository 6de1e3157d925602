"""Family `llama`: speedc's own checkpoints (Llama fields + a `speedc` section: layer map, exit,
block) and plain Hugging Face LlamaForCausalLM checkpoints (every layer stored; the compiler's share
pass finds repeated layers in the weights)."""

from __future__ import annotations

from typing import Any

from speedc.errors import CheckpointError
from speedc.models.config import CONFIG_FORMAT_VERSION, ModelConfig
from speedc.models.families import Family, boolean, common_fields, integer, positive_int, register_family, section
from speedc.format.depth_plan import DepthPlan
from speedc.models.layer_map import first_pass_length, resolve_layer_map


def read_config(data: dict[str, Any]) -> ModelConfig:
    """A plain config has no speedc section: every layer is its own block (identity map), and the
    exit defaults to the end of the first pass through the unique blocks, read through the final norm."""
    if "num_hidden_layers" not in data:
        raise CheckpointError("config.json: missing field 'num_hidden_layers'")
    num_layers = positive_int(data, "num_hidden_layers")
    speedc = section(data, "speedc")
    if speedc.get("format_version", CONFIG_FORMAT_VERSION) != CONFIG_FORMAT_VERSION:
        raise CheckpointError(f"config.json: speedc.format_version {speedc['format_version']!r} is not one this speedc "
                              f"reads ({CONFIG_FORMAT_VERSION})")
    # speedc.depth: the depth plan a build recorded (speedc/format/depth_plan.py: its layer map too); else the plan
    # is derived from speedc.layer_map (configs written by hand, or before the plan was recorded)
    plan = DepthPlan.from_json(section(data, "speedc", "depth")) if speedc.get("depth") else None
    if "layer_map" in speedc:
        layer_map = resolve_layer_map(speedc["layer_map"], num_layers)
    elif plan is not None:
        if plan.num_layers != num_layers:
            raise CheckpointError(f"config.json: speedc.depth ({plan.describe()}) does not fit the layer map of "
                                  f"{num_layers} layers (num_hidden_layers)")
        layer_map = plan.layer_map
    else:
        layer_map = list(range(num_layers))
    if plan is not None and not plan.fits(layer_map):
        raise CheckpointError(f"config.json: speedc.depth ({plan.describe()}) does not fit the layer map {layer_map}")
    exit_section, block = section(data, "speedc", "exit"), section(data, "speedc", "block")
    try:
        return ModelConfig.from_layer_map(
            layer_map, loop_norm=_plan_norm(plan, block, "loop_norm", False),
            final_norm=_plan_norm(plan, block, "final_norm", True), declared=plan,
            exit_layer=integer(data, "speedc.exit.layer", exit_section.get("layer", first_pass_length(layer_map))),
            exit_norm=exit_section.get("norm", "final"),
            architecture=str(block.get("architecture", "llama")),
            sandwich_norms=boolean("speedc.block.sandwich_norms", block.get("sandwich_norms", False)),
            post_norms=boolean("speedc.block.post_norms", block.get("post_norms", False)),
            qk_bias=boolean("speedc.block.qk_bias", block.get("qk_bias", False)),
            embed_scale=float(block.get("embed_scale", 1.0)),
            qk_norm=boolean("speedc.block.qk_norm", block.get("qk_norm", False)),
            mlp_act=str(block.get("mlp_act", "silu-gated")),
            value_embed_blocks=tuple(integer(data, "speedc.block.value_embed_blocks", b)
                                     for b in block.get("value_embed_blocks", ())),
            **common_fields(data))
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json: {bad}") from None


def _plan_norm(plan: DepthPlan | None, block: dict[str, Any], key: str, default: bool) -> bool:
    """speedc.depth's KEY where a plan is recorded (the one place a config written today holds it), else
    speedc.block's (configs written before the plan held the norms); both given, they must agree."""
    declared = boolean(f"speedc.block.{key}", block.get(key, default))
    if plan is None:
        return declared
    if key in block and declared != getattr(plan, key):
        raise CheckpointError(f"config.json: speedc.block.{key} = {declared} but speedc.depth.{key} = "
                              f"{getattr(plan, key)}; give it once, in speedc.depth")
    return getattr(plan, key)


register_family(Family("llama", ("LlamaForCausalLM",), ("llama",), read_config,
                       description="Llama decoders: speedc's own shared-weight checkpoints and unrolled Hugging Face Llama"))
