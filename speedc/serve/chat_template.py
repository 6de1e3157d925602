"""Chat messages -> prompt text, rendered the way transformers' apply_chat_template does.

The template comes from `--chat-template FILE`, else the artifact's chat_template.jinja, else the
`chat_template` of its tokenizer_config.json (a string, or a list of named templates: "default").
Templates are untrusted code from a model upload, so they run in jinja2's immutable sandbox, with
the environment transformers gives them: trim_blocks, lstrip_blocks, the loopcontrols extension,
raise_exception(), a tojson filter that keeps non-ASCII text, strftime_now(), the special tokens
named in tokenizer_config.json (bos_token, eos_token, ...), and the `{% generation %}` block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from speedc.format.artifact import CHAT_TEMPLATE, TOKENIZER_CONFIG
from speedc.errors import SpeedcError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateRenderError(Exception):
    """The template refused the messages (raise_exception) or failed while rendering them."""


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_config(artifact: Path) -> dict:
    path = artifact / TOKENIZER_CONFIG
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as bad:
        raise SpeedcError(f"{path}: unreadable ({bad})") from None
    return config if isinstance(config, dict) else {}


def _template_in_config(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message):
    raise TemplateRenderError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's part (for training masks in
        transformers); rendering a prompt only needs its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols], undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass
class ChatTemplate:
    source: str  # the template text
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as text

    def __post_init__(self) -> None:
        import jinja2

        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as bad:
            raise SpeedcError(f"the chat template does not parse: {bad}") from None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=None, **self.special_tokens)
        except TemplateRenderError:
            raise
        except jinja2.TemplateError as bad:
            raise TemplateRenderError(f"the chat template failed on these messages: {bad}") from None
        except MemoryError:
            raise
        except Exception as bad:  # the template is code: any error in it ({{ 1/0 }} was a bare 500)
            raise TemplateRenderError(f"the chat template failed on these messages: {type(bad).__name__}: {bad}") from None

    def end_of_turn_text(self) -> str | None:
        """The text the template writes right after an assistant turn's content (ChatML's "<|im_end|>\n",
        Llama 3's "<|eot_id|>", ...), found by rendering a probe conversation; None where the template
        refuses the probe or writes nothing there."""
        probe = "speedc-end-of-turn-probe"
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                               add_generation_prompt=False)
        except TemplateRenderError:
            return None
        at = text.rfind(probe)
        return text[at + len(probe):] or None if at >= 0 else None

    def end_of_turn_ids(self, tokenizer) -> list[int]:
        """Ids that end an assistant turn: the special token the template writes right after one, and the
        tokenizer_config's eos_token (where each is one special token of TOKENIZER). A chat completion
        stops at them even where the checkpoint's configured end-of-text id differs (Ouro's configs list
        id 0, its ChatML turns end with <|im_end|>)."""
        special = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        ids = []
        after = self.end_of_turn_text()
        if after is not None:
            first = max((text for text in special if after.startswith(text)), key=len, default=None)
            if first is not None:
                ids.append(special[first])
        eos = self.special_tokens.get("eos_token")
        if eos in special and special[eos] not in ids:
            ids.append(special[eos])
        return ids


def load_chat_template(artifact: Path, override: Path | None = None) -> ChatTemplate | None:
    """The artifact's chat template (OVERRIDE's text instead, when given); None when it has none."""
    config = _tokenizer_config(Path(artifact))
    special = {key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None}
    if override is not None:
        try:
            return ChatTemplate(Path(override).read_text(), special)
        except OSError as bad:
            raise SpeedcError(f"--chat-template {override}: {bad.strerror or bad}") from None
    own_file = Path(artifact) / CHAT_TEMPLATE
    if own_file.exists():
        return ChatTemplate(own_file.read_text(), special)
    source = _template_in_config(config)
    return ChatTemplate(source, special) if source is not None else None
