"""The artifact format: file layout and manifest, read by the build driver and every runtime.

    OUT/
      manifest.json     format version, versions, source hash, model dims, schedule, graph I/O,
                        weight index, file hashes
      step.onnx         P-slot speculative step graph            (absent for a plain engine)
      step_flush.onnx   the same step with every slot's exit head (for early flush)
      prefill.onnx      plain N-layer graph: prompt chunks, and autoregressive decoding
      step.gqa.onnx, step_flush.gqa.onnx, prefill.gqa.onnx
                        ONNX Runtime variants: fused GroupQueryAttention writes the cache in place
      cache_write_step.onnx, cache_write_prefill.onnx
                        in-place K/V row writers for device-resident caches (IO binding)
      weights.bin       every unique weight once, shared by all graphs as ONNX external data
      config.json       the model config (for the PyTorch backend and inspection)
      tokenizer.json    (when the checkpoint has one)

This module imports only the standard library and numpy: the runtime path stays light.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from speedc.errors import ArtifactError

FORMAT_VERSION = 1
WEIGHT_PREFIXES = ("model.", "lm_head.")  # checkpoint tensor names (native or Hugging Face layout)
MANIFEST = "manifest.json"
STEP_GRAPH = "step.onnx"
STEP_FLUSH_GRAPH = "step_flush.onnx"
PREFILL_GRAPH = "prefill.onnx"
CACHE_WRITE_STEP_GRAPH = "cache_write_step.onnx"
CACHE_WRITE_PREFILL_GRAPH = "cache_write_prefill.onnx"
FUSED_SUFFIX = ".gqa"  # graph names (and files) of the ONNX Runtime variants with fused attention
GRAPH_FILES = {"step": STEP_GRAPH, "step_flush": STEP_FLUSH_GRAPH, "prefill": PREFILL_GRAPH,
               "cache_write_step": CACHE_WRITE_STEP_GRAPH, "cache_write_prefill": CACHE_WRITE_PREFILL_GRAPH,
               **{f"{name}{FUSED_SUFFIX}": f"{name}{FUSED_SUFFIX}.onnx" for name in ("step", "step_flush", "prefill")}}
WEIGHTS = "weights.bin"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHT_ALIGN = 64


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Manifest:
    format_version: int
    speedc_version: str
    onnx_opset: int
    source_checkpoint_sha256: str
    model: dict[str, Any]  # vocab_size, hidden_size, num_layers, num_kv_heads, head_dim, max_context, eos_token_id
    layer_map: list[int]
    exit_layer: int
    schedule: dict[str, Any]  # passes.schedule.Schedule as JSON
    dtype: str
    target: str
    graphs: dict[str, dict[str, Any]]  # name -> {file, inputs: [{name, shape, dtype}], outputs: [...]}
    weights: dict[str, Any]  # {file, unique_bytes, stored_bytes, index: {name: {offset, length, dtype, shape}}}
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    build: dict[str, Any] = field(default_factory=dict)  # timings, notes

    @property
    def slots(self) -> int:
        return int(self.schedule["slots"])

    @property
    def stage_layers(self) -> int:
        return int(self.schedule["stage_layers"])

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2) + "\n"


def read_manifest(directory: str | Path, *, verify_hashes: bool = True) -> Manifest:
    """Load and check an artifact's manifest: format version, and (optionally) every file's hash."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: not an artifact directory")
    if not path.exists():
        raise ArtifactError(f"{directory}: no {MANIFEST} (not a speedc artifact, or an unfinished build)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as bad:
        raise ArtifactError(f"{path}: unreadable ({bad})") from None
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format version {version} but this speedc reads version {FORMAT_VERSION}; "
                            "rebuild it with `speedc build`")
    try:
        manifest = Manifest(**data)
    except TypeError as bad:
        raise ArtifactError(f"{path}: malformed manifest ({bad})") from None
    if verify_hashes:
        for name, expected in manifest.files.items():
            file = directory / name
            if not file.exists():
                raise ArtifactError(f"{file}: listed in the manifest but missing")
            if sha256_file(file) != expected:
                raise ArtifactError(f"{file}: sha256 does not match the manifest (corrupt or modified); rebuild the artifact")
    return manifest


def is_weight_name(name: str) -> bool:
    """A model weight (a checkpoint tensor, or a stack of them), not a table a compiler pass computed."""
    return name.startswith(WEIGHT_PREFIXES)


def checkpoint_tensor_names(manifest: "Manifest") -> list[str]:
    """The checkpoint tensors the artifact stores (each once; a stacked weight's parts, not the stack)."""
    return [name for name, entry in manifest.weights["index"].items() if is_weight_name(name) and "parts" not in entry]


def read_weight(directory: str | Path, manifest: Manifest, name: str) -> np.ndarray:
    """One stored weight as a numpy array (memory-mapped from weights.bin)."""
    entry = manifest.weights["index"][name]
    data = np.memmap(Path(directory) / manifest.weights["file"], dtype=np.uint8, mode="r",
                     offset=entry["offset"], shape=(entry["length"],))
    return np.frombuffer(data, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])
