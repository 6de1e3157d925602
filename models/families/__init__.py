"""Checkpoint families: which config.json / weight layouts speedc reads, as a registry.

A family module (models/families/*.py) says how its config maps onto ModelConfig (what its block is,
what happens at a loop boundary, which options it validates and refuses) and how its tensor names map
onto speedc's (`model.layers.{i}.*` -> `model.blocks.{i}.*`, tensors read and ignored). Everything
downstream (the reference model, the trace pass, the PyTorch backend) reads only ModelConfig, so no
consumer branches on a family's name.

    architectures[0] and model_type        -> the registered family matching both, else a one-line error
    (speedc's own configs, with a `speedc` section, say LlamaForCausalLM / llama: family "llama")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from speedc.errors import CheckpointError

ConfigReader = Callable[[dict], "ModelConfig"]  # noqa: F821 (a family module's reader; they import models.config)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # Hugging Face `architectures` values
    model_types: tuple[str, ...]
    read_config: ConfigReader
    ignored_tensors: tuple[str, ...] = ()  # tensor-name prefixes the model drops (e.g. exit gates)
    exit_gate: tuple[str, str] | None = None  # (weight [1, H], bias [1]) of a per-loop exit gate, kept in the manifest
    description: str = ""
    notes: Callable[[dict], list[str]] = lambda data: []  # what inspect says about a config (e.g. ignored options)
    # The family's tensor names and fused layouts -> speedc's: {name: TensorSource}, ModelConfig -> the same
    # (row ranges and row orders of the stored bytes; nothing read). None: the names are speedc's or Hugging Face Llama's.
    map_tensors: Callable[[dict, Any], dict] | None = None
    # A config without Hugging Face's architectures / model_type keys recognised by its own content (Parcae
    # writes its dataclass: model_class_name "Parcae"); checked before those keys.
    recognises: Callable[[dict], bool] | None = None
    # Keys of UNIMPLEMENTED_OPTIONS this family implements and checks itself (Parcae's qk_norm).
    own_options: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def _load_families() -> None:
    """Import every models/families/*.py (each registers itself): a new family is one file."""
    import importlib
    import pkgutil

    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")


def supported() -> str:
    _load_families()
    return ", ".join(a for f in FAMILIES.values() for a in f.architectures)


def family_of(data: dict[str, Any]) -> Family:
    """The family whose `architectures` and `model_type` both match (either may be absent; a config
    with neither is read as Llama). speedc's own configs say LlamaForCausalLM / llama."""
    _load_families()
    for family in FAMILIES.values():
        if family.recognises is not None and family.recognises(data):
            return family
    architectures = data.get("architectures") or []
    model_type = data.get("model_type")
    if not architectures and model_type is None:
        return FAMILIES["llama"]
    for family in FAMILIES.values():
        if ((not architectures or architectures[0] in family.architectures)
                and (model_type is None or model_type in family.model_types)):
            return family
    named = architectures[0] if architectures else f"model_type={model_type!r}"
    if architectures and model_type is not None:
        named = f"{architectures[0]} (model_type={model_type!r})"
    raise CheckpointError(f"config.json: unsupported architecture {named} (supported: {supported()})")


def off(value: Any) -> bool:
    return not value


# Options of Hugging Face decoder configs asking for computation speedc's layer and head (models/row_layer.py,
# models/llama.py) do not do, whatever the family: a q/k norm, logit soft-capping, another score scale,
# sliding-window or other non-full attention layers, rotary over part of each head. A config setting one describes a
# model trained with it (even where transformers' Llama code would ignore the key), so it is refused
# by name rather than built into a model that computes something else.
UNIMPLEMENTED_OPTIONS = {
    "qk_norm": off, "use_qk_norm": off, "qk_layernorm": off,
    "attn_logit_softcapping": lambda v: v is None, "final_logit_softcapping": lambda v: v is None,
    "query_pre_attn_scalar": lambda v: v is None,
    "use_sliding_window": off,
    "layer_types": lambda v: v is None or (isinstance(v, list) and all(t == "full_attention" for t in v)),
    "partial_rotary_factor": lambda v: v is None or v == 1,
}


def load_config(path: Path):
    """The ModelConfig of a config.json of any registered family."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise CheckpointError(f"{path}: not valid JSON ({bad})") from None
    return read_config(data)


def read_config(data: dict[str, Any]):
    """The ModelConfig of a config.json's contents (DATA), read by its family."""
    if not isinstance(data, dict):
        raise CheckpointError("config.json: top level must be an object")
    family = family_of(data)
    refuse_options(data, family.architectures[0],
                   {key: fine for key, fine in UNIMPLEMENTED_OPTIONS.items() if key not in family.own_options})
    return family.read_config(data)


# ---- fields every family shares (Hugging Face decoder configs) -------------------------------------
def common_fields(data: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from the standard Hugging Face decoder keys (checked)."""
    if data.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: unsupported hidden_act={data.get('hidden_act')!r} (only 'silu')")
    if data.get("attention_bias") or data.get("mlp_bias"):
        raise CheckpointError("config.json: attention/MLP biases are not supported")
    for key in ("rope_parameters", "rope_scaling"):  # both: a rope_scaling beside plain rope_parameters still scales
        rope = data.get(key) or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"config.json: {key} must be an object, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise CheckpointError(f"config.json: unsupported rope type {rope.get('rope_type', rope.get('type'))!r} "
                                  f"({key})")
        if rope.get("partial_rotary_factor", 1) != 1:  # rotary over part of each head: row_layer rotates all of it
            raise CheckpointError(f"config.json: unsupported partial_rotary_factor {rope['partial_rotary_factor']!r} ({key})")
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    # transformers 5.x: rope_parameters.rope_theta; 4.x: top-level rope_theta.
    rope_theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or data.get("rope_theta", 10000.0)
    try:
        eos_ids = data.get("eos_token_id", 0)
        eos_ids = eos_ids if isinstance(eos_ids, list) and eos_ids else [eos_ids]  # several: a chat model's end ids
        eos_ids = tuple(integer(data, "eos_token_id", value or 0) for value in eos_ids)
        bos = data.get("bos_token_id")
        bos = bos[0] if isinstance(bos, list) else bos
        return dict(
            vocab_size=integer(data, "vocab_size", data["vocab_size"]),
            hidden_size=integer(data, "hidden_size", data["hidden_size"]),
            intermediate_size=integer(data, "intermediate_size", data["intermediate_size"]),
            num_attention_heads=integer(data, "num_attention_heads", data["num_attention_heads"]),
            num_key_value_heads=integer(data, "num_key_value_heads",
                                        data.get("num_key_value_heads") or data["num_attention_heads"]),
            head_dim=integer(data, "head_dim", data["head_dim"]) if data.get("head_dim") else None,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            max_position_embeddings=integer(data, "max_position_embeddings", data.get("max_position_embeddings", 1024)),
            tie_word_embeddings=boolean("tie_word_embeddings", data.get("tie_word_embeddings", False)),  # transformers' default
            bos_token_id=integer(data, "bos_token_id", bos or 0),
            eos_token_id=eos_ids[0], eos_token_ids=eos_ids,
        )
    except KeyError as missing:
        raise CheckpointError(f"config.json: missing field {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json: {bad}") from None


def integer(data: dict[str, Any], key: str, value: Any) -> int:
    """VALUE (config.json's KEY) as it must be: a JSON integer (8.7 layers or "8" are refused, not truncated)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def boolean(key: str, value: Any) -> bool:
    """A JSON true/false (the string "false" is refused: bool("false") would read it as true)."""
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def section(data: dict[str, Any], *path: str) -> dict[str, Any]:
    """The object at DATA[path...] ({} when absent); a non-object there is refused in one line."""
    value: Any = data
    for key in path:
        value = value.get(key) or {}
        if not isinstance(value, dict):
            raise CheckpointError(f"config.json: {'.'.join(path[:path.index(key) + 1])} must be an object, got {value!r}")
    return value


def positive_int(data: dict[str, Any], key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def refuse_options(data: dict[str, Any], family: str, options: dict[str, Callable[[Any], bool]]) -> None:
    """One-line error for the first option whose value this build does not implement.
    OPTIONS: config key -> predicate that is True for the values that are fine."""
    for key, fine in options.items():
        if key in data and not fine(data[key]):
            raise CheckpointError(f"config.json: {family} option {key}={data[key]!r} is not supported by this speedc "
                                  "build (it would change the model's computation)")
