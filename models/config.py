"""Model configuration: Hugging Face LlamaConfig fields plus a `speedc` section.

config.json example (the speedc section is what a plain Llama config lacks):

    {"model_type": "llama", "hidden_size": 384, "num_hidden_layers": 16, ...,
     "speedc": {"format_version": 1,
                "layer_map": {"pattern": "cycle", "num_blocks": 4},
                "exit": {"layer": 4, "norm": "own"}}}

`exit.layer` is the number of logical layers the early-exit head reads after (4 = after layers
0..3); `exit.norm` is "own" (a separate RMSNorm weight) or "final" (reuse the final norm).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from speedc.errors import CheckpointError
from speedc.models.layer_map import describe_layer_map, resolve_layer_map

CONFIG_FORMAT_VERSION = 1


@dataclasses.dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    layer_map: list[int]
    exit_layer: int
    exit_norm: str = "own"  # "own" | "final"
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    # ---- derived ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return max(self.layer_map) + 1

    def validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise CheckpointError(f"config.json: {message}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.head_dim % 2 == 0, "head_dim must be even (rotary embedding)")
        need(self.exit_norm in ("own", "final"), f"speedc.exit.norm must be 'own' or 'final', got {self.exit_norm!r}")
        need(1 <= self.exit_layer <= self.num_hidden_layers,
             f"speedc.exit.layer must be in 1..{self.num_hidden_layers}, got {self.exit_layer}")
        resolve_layer_map(self.layer_map, self.num_hidden_layers)

    def describe(self) -> str:
        return (f"N={self.num_hidden_layers} layers over {describe_layer_map(self.layer_map)}, "
                f"hidden {self.hidden_size}, heads {self.num_attention_heads}/{self.num_key_value_heads} kv, "
                f"vocab {self.vocab_size}, exit after layer {self.exit_layer}")

    # ---- (de)serialisation --------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            "speedc": {
                "format_version": CONFIG_FORMAT_VERSION,
                "layer_map": self.layer_map,
                "exit": {"layer": self.exit_layer, "norm": self.exit_norm},
            },
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], *, default_layer_map: list[int] | None = None) -> "ModelConfig":
        """Read a speedc or plain Hugging Face Llama config.

        A plain config has no speedc section: every layer is its own block (identity map) unless the
        caller passes the map it recognised from the weights, and the exit defaults to the end of
        the first pass through the unique blocks, read through the final norm.
        """
        if not isinstance(data, dict):
            raise CheckpointError("config.json: top level must be an object")
        model_type = data.get("model_type", "llama")
        if model_type != "llama":
            raise CheckpointError(f"config.json: unsupported architecture model_type={model_type!r} (speedc supports 'llama')")
        if data.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json: unsupported hidden_act={data.get('hidden_act')!r} (only 'silu')")
        if data.get("attention_bias") or data.get("mlp_bias"):
            raise CheckpointError("config.json: attention/MLP biases are not supported")
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise CheckpointError(f"config.json: unsupported rope type {rope.get('rope_type', rope.get('type'))!r}")
        # transformers 5.x: rope_parameters.rope_theta; 4.x: top-level rope_theta.
        rope_theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or data.get("rope_theta", 10000.0)
        try:
            num_layers = int(data["num_hidden_layers"])
            section = data.get("speedc") or {}
            if "layer_map" in section:
                layer_map = resolve_layer_map(section["layer_map"], num_layers)
            else:
                layer_map = default_layer_map or list(range(num_layers))
            exit_section = section.get("exit") or {}
            first_pass = _first_pass_length(layer_map)
            eos = data.get("eos_token_id", 0)
            eos = eos[0] if isinstance(eos, list) else eos
            return cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_hidden_layers=num_layers,
                num_attention_heads=int(data["num_attention_heads"]),
                num_key_value_heads=int(data.get("num_key_value_heads") or data["num_attention_heads"]),
                head_dim=data.get("head_dim"),
                layer_map=layer_map,
                exit_layer=int(exit_section.get("layer", first_pass)),
                exit_norm=exit_section.get("norm", "final"),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(data.get("max_position_embeddings", 1024)),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
                bos_token_id=int(data.get("bos_token_id") or 0),
                eos_token_id=int(eos or 0),
            )
        except KeyError as missing:
            raise CheckpointError(f"config.json: missing field {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise CheckpointError(f"config.json: {bad}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, **kwargs: Any) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
            raise CheckpointError(f"{path}: not valid JSON ({bad})") from None
        return cls.from_json_dict(data, **kwargs)


def _first_pass_length(layer_map: list[int]) -> int:
    """Layers until a block repeats: the default exit point (end of the first pass)."""
    seen: set[int] = set()
    for layer, block in enumerate(layer_map):
        if block in seen:
            return layer
        seen.add(block)
    return len(layer_map)
