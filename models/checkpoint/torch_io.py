"""Checkpoint directories: read and write.

speedc layout (each unique block stored once):
    config.json          Llama fields + speedc section (layer map, exit)
    model.safetensors    model.embed_tokens.weight, model.blocks.{m}.*, model.norm.weight,
                         [model.exit_norm.weight], [lm_head.weight]
    tokenizer.json       Hugging Face tokenizers file

Hugging Face layout (`save_pretrained`): model.layers.{l}.* for every logical layer. It loads as N
blocks with the identity map; the compiler's share pass finds the identical layers.

Weights are read with safetensors only. A pickled .bin/.pt file is refused unless the caller allows
it explicitly, and even then it is read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import numpy as np
from safetensors.torch import save_file

from speedc.errors import CheckpointError
from speedc.models.checkpoint.files import (CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE, WEIGHTS_FILE, generation_eos_ids,
                                           token_ids)
from speedc.models.config import ModelConfig
from speedc.models.families import load_config
from speedc.models.families import FAMILIES
from speedc.models.llama import SharedLlama
from speedc.models.checkpoint.tensor_source import TensorSource, safetensors_sources, same_values

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # TensorSource dtype names a checkpoint weight may have
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _read_sharded(directory: Path) -> tuple[dict[str, TensorSource], Path]:
    """Shards named by model.safetensors.index.json, each checked against the index (headers only)."""
    index_path = directory / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as bad:
        raise CheckpointError(f"{index_path}: not a valid safetensors index ({bad!r})") from None
    sources: dict[str, TensorSource] = {}
    for shard in shards:
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"{index_path}: shard {shard} is missing")
        part = safetensors_sources(path)
        for name in (name for name, where in weight_map.items() if where == shard):  # exactly what the index says
            if name not in part:
                raise CheckpointError(f"{index_path}: names tensor {name} in {shard}, which does not hold it")
            sources[name] = part[name]
    return sources, index_path


def _read_pickled(pickled: list[Path]) -> dict[str, TensorSource]:
    sources = {}
    for path in pickled:
        try:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as bad:  # torch raises many types here; all mean "unreadable"
            raise CheckpointError(f"{path}: cannot load with weights_only=True ({str(bad).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path}: expected a state dict, got {type(loaded).__name__}")
        sources.update({name: TensorSource.from_array(t.float().numpy()) for name, t in loaded.items()
                        if isinstance(t, torch.Tensor)})
    return sources


def _read_weights(directory: Path, allow_pickle: bool) -> tuple[dict[str, TensorSource], Path]:
    if (directory / INDEX_FILE).exists():
        return _read_sharded(directory)
    safetensors_files = sorted(directory.glob("*.safetensors"))
    if safetensors_files:
        sources: dict[str, TensorSource] = {}
        origin: dict[str, Path] = {}
        for path in safetensors_files:
            for name, source in safetensors_sources(path).items():
                if name in sources:  # which one the model meant is not ours to guess (a later file used to win)
                    raise CheckpointError(f"{directory}: tensor {name} is in both {origin[name].name} and {path.name}")
                sources[name], origin[name] = source, path
        return sources, safetensors_files[0]
    pickled = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled and any((directory / name).is_file() for name in ("manifest.json", "prefill.onnx")):  # speedc's own files
        raise CheckpointError(f"{directory}: a speedc artifact (or what is left of one), not a checkpoint: build from "
                              "the checkpoint it came from; `speedc generate` runs an artifact")
    if pickled:
        if not allow_pickle:
            raise CheckpointError(
                f"{pickled[0]}: pickled weights are refused (they can run code); convert to safetensors "
                "or pass --allow-pickle to load them with torch.load(weights_only=True)")
        return _read_pickled(pickled), pickled[0]
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} (or other weights file) found")


def _unrolled_to_blocks(sources: dict[str, TensorSource]) -> dict[str, TensorSource]:
    """Rename Hugging Face model.layers.{l}.* to model.blocks.{l}.* (one block per layer)."""
    out = {}
    for name, source in sources.items():
        match = _HF_LAYER.match(name)
        if match:
            out[f"model.blocks.{match.group(1)}.{match.group(2)}"] = source
        elif "rotary_emb" not in name:
            out[name] = source
    return out


def open_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> tuple[ModelConfig, dict[str, TensorSource]]:
    """Read a checkpoint directory's structure: (config, {speedc tensor name: where its bytes are}).

    Only headers are read (a safetensors checkpoint of any size costs no memory here); every tensor
    the config implies is checked to exist with the right shape, and nothing else may be there."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    raw_config_path = directory / CONFIG_FILE
    cfg = with_generation_token_ids(load_config(raw_config_path), directory)
    sources, weights_path = _read_weights(directory, allow_pickle)
    family = FAMILIES[cfg.architecture]
    ignored = family.ignored_tensors
    sources = {name: s for name, s in sources.items() if not name.startswith(ignored)} if ignored else sources
    if family.map_tensors is not None and "speedc" not in json.loads(raw_config_path.read_text()):
        sources = family.map_tensors(sources, cfg)
    if any(_HF_LAYER.match(name) for name in sources):
        sources = _unrolled_to_blocks(sources)
        if "speedc" in json.loads(raw_config_path.read_text()):
            raise CheckpointError(f"{weights_path}: unrolled model.layers.* weights but config.json has a speedc layer map")
    if cfg.tie_word_embeddings and "lm_head.weight" in sources:
        embedding = sources.get("model.embed_tokens.weight")
        if embedding is None or not same_values(sources["lm_head.weight"], embedding):
            raise CheckpointError(f"{weights_path}: lm_head.weight differs from the embedding but tie_word_embeddings is true")
        del sources["lm_head.weight"]
    _check_against_config(cfg, sources, weights_path)
    return cfg, sources


def read_exit_gate(path: str | Path, cfg: ModelConfig, *, allow_pickle: bool = False) -> dict | None:
    """The family's per-loop exit gate (Family.exit_gate) of the checkpoint at PATH as the manifest keeps it,
    {"weight": [H floats], "bias": float} (float32 values), or None where the family has none."""
    names = FAMILIES[cfg.architecture].exit_gate
    directory = Path(path)
    if names is None or not cfg.depth_plan.loop_exits or not directory.is_dir():
        return None
    sources, weights_path = _read_weights(directory, allow_pickle)
    missing = [name for name in names if name not in sources]
    if missing:
        raise CheckpointError(f"{weights_path}: missing tensor {missing[0]} (the exit gate)")
    weight, bias = (as_torch(sources[name]).float().reshape(-1) for name in names)
    if weight.numel() != cfg.hidden_size or bias.numel() != 1:
        raise CheckpointError(f"{weights_path}: the exit gate {names[0]} has {weight.numel()} values and {names[1]} "
                              f"{bias.numel()}: expected {cfg.hidden_size} and 1")
    return {"weight": weight.tolist(), "bias": float(bias[0])}


def as_torch(source: TensorSource) -> torch.Tensor:
    array = source.read()
    if source.dtype == "bfloat16":  # torch cannot wrap ml_dtypes' bfloat16: reinterpret the bits
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def sources_from_state(state: dict[str, torch.Tensor]) -> dict[str, TensorSource]:
    """An in-memory state dict as the compiler's tensor sources (models built in tests and benches)."""
    return {name: TensorSource.from_array(t.detach().float().contiguous().numpy()) for name, t in state.items()}


def load_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint directory into (config, state dict in speedc block naming), all in memory
    (training, tests and the reference decoder; the build reads `open_checkpoint`'s sources instead)."""
    cfg, sources = open_checkpoint(path, allow_pickle=allow_pickle)
    return cfg, {name: as_torch(source) for name, source in sources.items()}


def with_generation_token_ids(cfg: ModelConfig, directory: Path) -> ModelConfig:
    """The checkpoint's generation token ids (checkpoint.files.token_ids) over config.json's; every
    end-of-text id generation_config.json lists (Llama-3-style chat models end on several)."""
    found = {key: value for key, (value, _) in token_ids(directory).items()}
    if "eos_token_id" in found:
        found["eos_token_ids"] = generation_eos_ids(directory) or (found["eos_token_id"],)
    return dataclasses.replace(cfg, **found)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of CFG holds, with its shape (the model is built on the meta device:
    no memory, whatever its size)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in SharedLlama(cfg).state_dict().items()}


def _check_against_config(cfg: ModelConfig, tensors: dict[str, TensorSource], weights_path: Path) -> None:
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{weights_path}: missing tensor {missing[0]}{more} required by config.json")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{weights_path}: unexpected tensor {unexpected[0]} (does config.json match these weights?)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{weights_path}: {name} has shape {list(tensors[name].shape)} but config.json implies {list(shape)}")
        if tensors[name].dtype not in FLOAT_DTYPES:  # an int32 weight built and generated gibberish
            raise CheckpointError(f"{weights_path}: {name} is {tensors[name].dtype}; weights must be floating point "
                                  f"({', '.join(FLOAT_DTYPES)})")


def load_model(path: str | Path, *, allow_pickle: bool = False, dtype: torch.dtype = torch.float32) -> SharedLlama:
    cfg, tensors = load_checkpoint(path, allow_pickle=allow_pickle)
    return model_from_state(cfg, tensors, dtype=dtype)


def model_from_state(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> SharedLlama:
    model = SharedLlama(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return model.to(dtype).eval()


def _atomic_directory(out: Path, write) -> Path:
    """Write into a temp dir beside `out`, then rename: an interrupted save leaves nothing loadable."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_atomic(path: Path, write) -> None:
    """WRITE(temp path) then rename over PATH: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def checkpoint_tensors(model: SharedLlama, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state dict a speedc checkpoint stores: each unique block once, a tied LM head not at all."""
    state = {name: t.detach().to(dtype or t.dtype).contiguous().cpu() for name, t in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_checkpoint_files(directory: Path, model: SharedLlama, *, tokenizer_json: str | None = None,
                           dtype: torch.dtype | None = None) -> None:
    """config.json, model.safetensors and tokenizer.json into DIRECTORY, each file atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = checkpoint_tensors(model, dtype)
    if tokenizer_json is not None:
        write_atomic(directory / TOKENIZER_FILE, lambda p: p.write_text(tokenizer_json))
    write_atomic(directory / CONFIG_FILE, lambda p: model.cfg.save(p))
    write_atomic(directory / WEIGHTS_FILE, lambda p: save_file(state, str(p), metadata={"format": "pt", "speedc": "1"}))


def save_checkpoint(model: SharedLlama, out: str | Path, *, tokenizer_json: str | None = None,
                    dtype: torch.dtype = torch.float32, extra_files: dict[str, str] | None = None) -> Path:
    """Write a speedc-layout checkpoint directory (each unique block once), atomically as a whole."""

    def write(tmp: Path) -> None:
        write_checkpoint_files(tmp, model, tokenizer_json=tokenizer_json, dtype=dtype)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    return _atomic_directory(Path(out), write)


def save_unrolled_hf(model: SharedLlama, out: str | Path, *, tokenizer_json: str | None = None) -> Path:
    """Write the model in plain Hugging Face Llama layout: every logical layer stored, no speedc section.

    This is what `save_pretrained` of an unrolled model produces; transformers' LlamaForCausalLM
    loads it directly. Exit heads have no place in that layout and are dropped.
    """
    cfg = model.cfg
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.blocks."):
            continue
        if name.startswith("model.exit_norm") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        state[name] = tensor.detach().float().contiguous().clone()
    for layer, block in enumerate(cfg.layer_map):
        prefix = f"model.blocks.{block}."
        for name, tensor in model.state_dict().items():
            if name.startswith(prefix):
                state[f"model.layers.{layer}.{name[len(prefix):]}"] = tensor.detach().float().contiguous().clone()
    config = cfg.to_json_dict()
    del config["speedc"]

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer_json is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer_json)

    return _atomic_directory(Path(out), write)


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over config.json and the weights files, in name order: identifies a checkpoint."""
    directory = Path(path)
    digest = hashlib.sha256()
    for file in sorted(directory.iterdir()):
        if file.name == CONFIG_FILE or file.suffix == ".safetensors" or file.suffix in PICKLE_SUFFIXES:
            digest.update(file.name.encode())
            with open(file, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def read_tokenizer_json(path: str | Path, vocab_size: int | None = None) -> str | None:
    """The checkpoint's tokenizer.json text (None: it has none), checked to load, and, given the model's
    VOCAB_SIZE, to produce no id the model has no row for (a build used to copy a broken one, and
    `speedc generate` failed with a traceback; a larger tokenizer failed only at its first big id)."""
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        text = file.read_text(encoding="utf-8")
        tokenizer = Tokenizer.from_str(text)
    except Exception as bad:  # the tokenizers package raises its own Exception type
        raise CheckpointError(f"{file}: not a tokenizer the tokenizers package can load ({str(bad).splitlines()[0]})") from None
    if vocab_size is not None and tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise CheckpointError(f"{file}: {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, but the model's "
                              f"vocabulary has {vocab_size} rows")
    return text


