"""Typed views of an artifact manifest's sections, built once when the manifest is read (read_manifest):
the runtime, its backends and the tools read fields, not dict keys.

    Manifest.dims     ModelDims    the "model" section: sizes, end-of-text ids, the exit norm, a drawn start
    Manifest.store    WeightStore  the "weights" section: weights.bin, its index, byte counts, quantization

The JSON keeps its serialised names (num_kv_heads, schedule.slots, ...): a view changes nothing on disk,
so artifacts already built read as before. Standard library only (the runtime path stays light).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the exit norm's weight (the model section's exit_norm) -> how the exit head normalizes
EXIT_NORM_WEIGHTS = {"model.exit_norm.weight": "own", "model.norm.weight": "final", None: "none"}


@dataclass(frozen=True)
class ModelDims:
    """The manifest's model section."""
    vocab_size: int
    max_context: int
    hidden_size: int  # H
    num_layers: int  # N logical layers
    kv_heads: int
    head_dim: int
    state_width: int  # floats a slot carries per token: H, or 2H = [state | e] with an injection (Huginn)
    initial_state: dict | None  # {seed, std}: a recurrent core's drawn start state (None: zeros)
    eos_token_id: int | None
    eos_token_ids: frozenset[int]  # every end-of-text id (artifacts built before eos_token_ids: the one id)
    exit_norm: str  # how the exit head normalizes: "own", "final" or "none"
    architecture: str

    @classmethod
    def of(cls, model: dict[str, Any], index: dict[str, dict]) -> "ModelDims":
        """KeyError / TypeError / ValueError where the section is malformed (read_manifest says so in one line)."""
        eos = model.get("eos_token_id")
        if "exit_norm" in model:
            exit_norm = EXIT_NORM_WEIGHTS[model["exit_norm"]]
        else:  # artifacts written before the key existed: own if stored, else the final norm
            exit_norm = "own" if "model.exit_norm.weight" in index else "final"
        return cls(int(model["vocab_size"]), int(model["max_context"]), int(model["hidden_size"]),
                   int(model["num_layers"]), int(model["num_kv_heads"]), int(model["head_dim"]),
                   int(model.get("state_width", model["hidden_size"])), model.get("initial_state") or None, eos,
                   frozenset(model.get("eos_token_ids") or ([] if eos is None else [eos])), exit_norm,
                   str(model.get("architecture", "llama")))


@dataclass(frozen=True)
class WeightStore:
    """The manifest's weights section: where every stored tensor lies in weights.bin and what it holds."""
    file: str
    index: dict[str, dict]  # name -> {offset, length, dtype, shape, ...} (artifact.py's module docstring)
    stored_bytes: int
    unique_bytes_fp32: int  # the unique weights at fp32
    unrolled_bytes_fp32: int  # what an unrolled export storing every layer would need at fp32
    native_artifact: str | None  # the id the native kernel's products know these weights by (None: no twins)
    quantization: dict | None  # {bits, block_size, ...} of a block-quantized artifact

    @classmethod
    def of(cls, weights: dict[str, Any]) -> "WeightStore":
        return cls(str(weights["file"]), dict(weights["index"]), int(weights["stored_bytes"]),
                   int(weights["unique_bytes_fp32"]), int(weights["unrolled_bytes_fp32"]),
                   weights.get("native_artifact"), weights.get("quantization"))

    @property
    def block_size(self) -> int | None:
        return None if self.quantization is None else int(self.quantization["block_size"])
