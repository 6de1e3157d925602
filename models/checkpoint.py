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
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from speedc.errors import CheckpointError
from speedc.models.checkpoint_files import CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE, WEIGHTS_FILE, token_ids
from speedc.models.config import ModelConfig
from speedc.models.families import FAMILIES
from speedc.models.llama import SharedLlama

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _read_sharded(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Shards named by model.safetensors.index.json, each checked against the index."""
    index_path = directory / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as bad:
        raise CheckpointError(f"{index_path}: not a valid safetensors index ({bad!r})") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"{index_path}: shard {shard} is missing")
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as bad:
            raise CheckpointError(f"{path}: unreadable safetensors file ({str(bad).splitlines()[0]})") from None
        for name in (name for name, where in weight_map.items() if where == shard):  # exactly what the index says
            if name not in part:
                raise CheckpointError(f"{index_path}: names tensor {name} in {shard}, which does not hold it")
            tensors[name] = part[name]
    return tensors, index_path


def _read_weights(directory: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], Path]:
    if (directory / INDEX_FILE).exists():
        return _read_sharded(directory)
    safetensors_files = sorted(directory.glob("*.safetensors"))
    if safetensors_files:
        tensors: dict[str, torch.Tensor] = {}
        for path in safetensors_files:
            try:
                tensors.update(load_file(str(path)))
            except (SafetensorError, OSError, ValueError) as bad:
                raise CheckpointError(f"{path}: unreadable safetensors file ({str(bad).splitlines()[0]})") from None
        return tensors, safetensors_files[0]
    pickled = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        if not allow_pickle:
            raise CheckpointError(
                f"{pickled[0]}: pickled weights are refused (they can run code); convert to safetensors "
                "or pass --allow-pickle to load them with torch.load(weights_only=True)")
        tensors = {}
        for path in pickled:
            try:
                loaded = torch.load(str(path), map_location="cpu", weights_only=True)
            except Exception as bad:  # torch raises many types here; all mean "unreadable"
                raise CheckpointError(f"{path}: cannot load with weights_only=True ({str(bad).splitlines()[0]})") from None
            if not isinstance(loaded, dict):
                raise CheckpointError(f"{path}: expected a state dict, got {type(loaded).__name__}")
            tensors.update(loaded)
        return tensors, pickled[0]
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} (or other weights file) found")


def _unrolled_to_blocks(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Rename Hugging Face model.layers.{l}.* to model.blocks.{l}.* (one block per layer)."""
    out = {}
    for name, tensor in tensors.items():
        match = _HF_LAYER.match(name)
        if match:
            out[f"model.blocks.{match.group(1)}.{match.group(2)}"] = tensor
        elif "rotary_emb" not in name:
            out[name] = tensor
    return out


def load_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint directory into (config, state dict in speedc block naming)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    raw_config_path = directory / CONFIG_FILE
    cfg = with_generation_token_ids(ModelConfig.load(raw_config_path), directory)
    tensors, weights_path = _read_weights(directory, allow_pickle)
    ignored = FAMILIES[cfg.architecture].ignored_tensors
    tensors = {name: t for name, t in tensors.items() if not name.startswith(ignored)} if ignored else tensors
    if any(_HF_LAYER.match(name) for name in tensors):
        tensors = _unrolled_to_blocks(tensors, cfg.num_hidden_layers)
        if "speedc" in json.loads(raw_config_path.read_text()):
            raise CheckpointError(f"{weights_path}: unrolled model.layers.* weights but config.json has a speedc layer map")
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight", torch.empty(0))):
            raise CheckpointError(f"{weights_path}: lm_head.weight differs from the embedding but tie_word_embeddings is true")
        del tensors["lm_head.weight"]
    _check_against_config(cfg, tensors, weights_path)
    return cfg, tensors


def with_generation_token_ids(cfg: ModelConfig, directory: Path) -> ModelConfig:
    """The checkpoint's generation token ids (checkpoint_files.token_ids) over config.json's."""
    return dataclasses.replace(cfg, **{key: value for key, (value, _) in token_ids(directory).items()})


def _check_against_config(cfg: ModelConfig, tensors: dict[str, torch.Tensor], weights_path: Path) -> None:
    expected = {name: tuple(p.shape) for name, p in SharedLlama(cfg).to("meta").state_dict().items()}
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


def read_tokenizer_json(path: str | Path) -> str | None:
    file = Path(path) / TOKENIZER_FILE
    return file.read_text() if file.exists() else None


