"""Family `llama`: speedc's own checkpoints (Llama fields + a `speedc` section: layer map, exit,
block) and plain Hugging Face LlamaForCausalLM checkpoints (every layer stored; the compiler's share
pass finds repeated layers in the weights)."""

from __future__ import annotations

from typing import Any

from speedc.errors import CheckpointError
from speedc.models.config import ModelConfig
from speedc.models.families import Family, common_fields, register_family
from speedc.models.layer_map import first_pass_length, resolve_layer_map


def read_config(data: dict[str, Any]) -> ModelConfig:
    """A plain config has no speedc section: every layer is its own block (identity map), and the
    exit defaults to the end of the first pass through the unique blocks, read through the final norm."""
    try:
        num_layers = int(data["num_hidden_layers"])
    except KeyError:
        raise CheckpointError("config.json: missing field 'num_hidden_layers'") from None
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json: {bad}") from None
    section = data.get("speedc") or {}
    layer_map = resolve_layer_map(section["layer_map"], num_layers) if "layer_map" in section else list(range(num_layers))
    exit_section = section.get("exit") or {}
    block = section.get("block") or {}
    try:
        return ModelConfig(
            num_hidden_layers=num_layers, layer_map=layer_map,
            exit_layer=int(exit_section.get("layer", first_pass_length(layer_map))),
            exit_norm=exit_section.get("norm", "final"),
            architecture=str(block.get("architecture", "llama")),
            sandwich_norms=bool(block.get("sandwich_norms", False)), loop_norm=bool(block.get("loop_norm", False)),
            final_norm=bool(block.get("final_norm", True)),
            **common_fields(data))
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json: {bad}") from None


register_family(Family("llama", ("LlamaForCausalLM",), ("llama",), read_config,
                       description="Llama decoders: speedc's own shared-weight checkpoints and unrolled Hugging Face Llama"))
