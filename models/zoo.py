"""The bundled models: models/zoo/NAME, which users name as `zoo:NAME` wherever the CLI takes a
checkpoint.

They ship inside the package (pyproject package-data), so their directory is found from this file,
not from the working directory: `zoo:tiny` works wherever speedc is installed. Reads only JSON, so
listing them (e.g. in --help) imports nothing heavy.

They carry no tokenizer_config.json of their own: `speedc build` writes this module's into their
artifacts (tokenizer_config_text), so `speedc serve` finds their chat template where it finds a
Hugging Face checkpoint's.
"""

from __future__ import annotations

import json
from pathlib import Path

from speedc.errors import CheckpointError
from speedc.models.checkpoint.files import CONFIG_FILE, TOKENIZER_CONFIG_FILE

PREFIX = "zoo:"
ZOO_DIR = Path(__file__).resolve().parent / "zoo"

# The bundled models' chat template (Jinja, rendered as transformers' apply_chat_template does). They
# were trained on play text, so each message is a speech: the speaker's name in capitals and a full stop
# on a line of its own (the role: USER., SYSTEM., ASSISTANT.), the text, a blank line; the generation
# prompt opens the assistant's speech. Play text has no token that ends a speech, so a reply ends at the
# model's end of text: the eos_token the tokenizer_config names (a chat completion stops there).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}.\n{{ message['content'] }}\n\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT.\n{% endif %}")


def names() -> list[str]:
    """Bundled model names, smallest first."""
    found = [d for d in ZOO_DIR.iterdir() if (d / CONFIG_FILE).is_file()] if ZOO_DIR.is_dir() else []
    return [d.name for d in sorted(found, key=_weight_bytes)]


def _weight_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def description(name: str) -> str:
    """One line from the model's config.json: depth over shared blocks, width, vocabulary, size."""
    directory = ZOO_DIR / name
    cfg = json.loads((directory / CONFIG_FILE).read_text())
    speedc = cfg["speedc"]  # the depth plan (configs written since), else the resolved layer map
    plan = speedc.get("depth")
    blocks = len({*plan["prelude"], *plan["core"], *plan["coda"]}) if plan else len(set(speedc["layer_map"]))
    return (f"{cfg['num_hidden_layers']} layers over {blocks} shared blocks, hidden {cfg['hidden_size']}, "
            f"vocab {cfg['vocab_size']}, {_weight_bytes(directory) / 1e6:.1f} MB")


def help_text() -> str:
    """The bundled models as a click help epilog (\\b keeps click from re-wrapping the table)."""
    rows = [f"  {PREFIX}{name:<8} {description(name)}" for name in names()]
    return (f"Bundled models (give one as the checkpoint; each has a MODEL_CARD.md in {ZOO_DIR}):\n\n\b\n"
            + "\n".join(rows))


def resolve(spec: str | Path) -> Path:
    """`zoo:NAME` -> that bundled model's directory; anything else is a path and stays one."""
    text = str(spec)
    if text.startswith(PREFIX):
        name = text[len(PREFIX):]
        if name not in names():
            available = ", ".join(PREFIX + n for n in names())
            raise CheckpointError(f"{text}: no bundled model of that name (available: {available})")
        return ZOO_DIR / name
    path = Path(spec)
    if not path.exists() and text in names():  # the old way of naming them, from inside the repo
        raise CheckpointError(f"{text}: no such directory; the bundled model is {PREFIX}{text}")
    return path


def tokenizer_config_text(checkpoint: str | Path) -> str | None:
    """The tokenizer_config.json a bundled model's artifact carries (the chat template and the special
    tokens it names, as a Hugging Face checkpoint holds them); None for any other checkpoint."""
    directory = Path(checkpoint).resolve()
    bundled = directory.parent == ZOO_DIR and (directory / CONFIG_FILE).is_file()
    if not bundled or (directory / TOKENIZER_CONFIG_FILE).exists():  # (one it carries itself is copied)
        return None
    from speedc.models.tokenizer import EOS_TOKEN  # (tokenizers: imported only when building one)

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
              "chat_template": CHAT_TEMPLATE}
    return json.dumps(config, indent=2) + "\n"
