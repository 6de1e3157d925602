"""A checkpoint directory's layout and what can be learned from it without loading weights
(standard library only: inspect, bench and the build driver's checks use it without torch).

    config.json                      model config (speedc section, or a family's Hugging Face keys)
    model.safetensors                weights; or shards named by model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, generation_config.json
    training.json                    `speedc train`'s metrics history
"""

from __future__ import annotations

import json
from pathlib import Path

from speedc.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "model.safetensors.index.json"  # sharded checkpoints: tensor name -> shard file
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TRAINING_FILE = "training.json"  # written by speedc train: metrics history


MAX_HEADER_BYTES = 100_000_000


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset where the tensor bytes start, the JSON header) of one safetensors file:
    [8-byte little-endian header length][JSON header][tensor bytes]. Raises ValueError / OSError."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if not 0 < length < MAX_HEADER_BYTES:
            raise ValueError(f"header length {length}")
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a table")
    return 8 + length, header


def declared_tensor_bytes(directory: Path) -> dict[str, tuple[int, str]]:
    """{tensor: (bytes, safetensors dtype)} from the safetensors headers alone (nothing else is read),
    so a build can check sizes against the disk before loading anything."""
    sizes: dict[str, tuple[int, str]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            _, header = read_safetensors_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    start, end = entry["data_offsets"]
                    sizes[name] = (int(end) - int(start), str(entry["dtype"]))
        except (OSError, ValueError, KeyError, TypeError) as bad:
            raise CheckpointError(f"{path}: unreadable safetensors header ({bad})") from None
    return sizes


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _first_id(value) -> int | None:
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tokenizer_config_ids(directory: Path) -> dict[str, int]:
    """bos/eos ids named as token strings in tokenizer_config.json, looked up in tokenizer.json."""
    config = _json_file(Path(directory) / TOKENIZER_CONFIG_FILE)
    tokenizer = _json_file(Path(directory) / TOKENIZER_FILE)
    vocab = {entry.get("content"): entry.get("id") for entry in tokenizer.get("added_tokens") or [] if isinstance(entry, dict)}
    model_vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab = {**model_vocab, **vocab}
    ids = {}
    for key in ("bos", "eos"):
        token = config.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and isinstance(vocab.get(token), int):
            ids[f"{key}_token_id"] = vocab[token]
    return ids


def token_ids(directory: Path) -> dict[str, tuple[int, str]]:
    """{bos_token_id / eos_token_id: (id, file it came from)}: generation_config.json, else
    tokenizer_config.json (some uploads set bos/eos to 0 in config.json while generation stops on the
    chat tokens); keys absent here come from config.json."""
    generation = _json_file(Path(directory) / GENERATION_CONFIG_FILE)
    from_tokenizer = _tokenizer_config_ids(directory)
    found = {}
    for key in ("bos_token_id", "eos_token_id"):
        if _first_id(generation.get(key)) is not None:
            found[key] = (_first_id(generation.get(key)), GENERATION_CONFIG_FILE)
        elif key in from_tokenizer:
            found[key] = (from_tokenizer[key], TOKENIZER_CONFIG_FILE)
    return found


def generation_eos_ids(directory: Path) -> tuple[int, ...] | None:
    """Every end-of-text id when generation_config.json lists several (None otherwise)."""
    listed = _json_file(Path(directory) / GENERATION_CONFIG_FILE).get("eos_token_id")
    if isinstance(listed, list) and listed and all(_first_id(value) is not None for value in listed):
        return tuple(listed)
    return None


def token_id_sources(directory: Path) -> dict[str, str]:
    found = token_ids(directory)
    return {key: found[key][1] if key in found else CONFIG_FILE for key in ("bos_token_id", "eos_token_id")}


def acceptance_hint_from_training(checkpoint: Path) -> float | None:
    """Exit/final top-1 agreement the last evaluation of `speedc train` measured, if any."""
    training = Path(checkpoint) / TRAINING_FILE
    try:
        history = json.loads(training.read_text())["history"]
        agreement = float(history[-1]["agree_top1"])
    except (OSError, KeyError, IndexError, ValueError, TypeError):
        return None
    if not 0 <= agreement <= 1:  # also nan: an agreement of 5 turned speculation off without a word
        raise CheckpointError(f"{training}: agree_top1 {agreement!r} is not an agreement in [0, 1]; fix or remove the file")
    return agreement


def has_speedc_section(checkpoint: Path) -> bool:
    """Whether config.json declares a speedc layer map and exit (else sharing is derived from the weights)."""
    try:
        return "speedc" in json.loads((Path(checkpoint) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
