"""Chat templates render exactly as transformers' apply_chat_template renders them (the oracle), run
sandboxed, and are found where checkpoints keep them."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from conftest import ZOO
from speedc.errors import SpeedcError
from speedc.models import zoo
from speedc.serve.chat_template import ChatTemplate, TemplateRenderError, load_chat_template

SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HEADERS = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
           "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Indented, multi-line: only right with trim_blocks + lstrip_blocks; loop controls, tojson, raise_exception.
BLOCKS = """{% if messages[0].role == 'system' %}
    {% set system = messages[0].content %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = none %}
    {% set rest = messages %}
{% endif %}
{% if system %}<<SYS>>{{ system | tojson }}<</SYS>>
{% endif %}
{% for m in rest %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% if (m.role == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('conversation roles must alternate user/assistant') }}
    {% endif %}
    [{{ m.role | upper }}] {{ m.content }}{{ eos_token if m.role == 'assistant' }}
    {% if loop.index >= 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""
GENERATION_BLOCK = """{% for m in messages %}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}
{% endfor %}"""

CONVERSATION = [{"role": "system", "content": "Be brief. Grüße, 世界 \"quoted\""},
                {"role": "user", "content": "  Who goes there?  "},
                {"role": "assistant", "content": "A friend."},
                {"role": "user", "content": "Stand and unfold yourself."}]


@pytest.fixture(scope="module")
def oracle() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=str(ZOO / "tiny" / "tokenizer.json"), **SPECIAL)


@pytest.mark.parametrize("template", [CHATML, HEADERS, BLOCKS, GENERATION_BLOCK, zoo.CHAT_TEMPLATE],
                         ids=["chatml", "headers", "blocks", "generation-block", "zoo"])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]], ids=["conversation", "one-message"])
def test_renders_like_transformers(oracle, template, messages):
    ours = ChatTemplate(template, SPECIAL)
    for generation_prompt in (True, False):
        expected = oracle.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=generation_prompt)
        assert ours.render(messages, add_generation_prompt=generation_prompt) == expected
    ids = oracle.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    assert oracle.backend_tokenizer.encode(ours.render(messages), add_special_tokens=False).ids == list(ids)


def test_template_errors_and_the_sandbox():
    refusing = ChatTemplate(BLOCKS, SPECIAL)
    with pytest.raises(TemplateRenderError, match="roles must alternate"):
        refusing.render([{"role": "assistant", "content": "first"}])
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", SPECIAL)
    with pytest.raises(TemplateRenderError, match="unsafe|access"):
        escape.render(CONVERSATION)
    mutate = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}", SPECIAL)
    with pytest.raises(TemplateRenderError):  # immutable sandbox: a template cannot change the request
        mutate.render(CONVERSATION)
    with pytest.raises(SpeedcError, match="does not parse"):
        ChatTemplate("{% for m in messages %}", SPECIAL)
    with pytest.raises(TemplateRenderError, match="ZeroDivisionError"):  # any error in the template: a bare 500 before
        ChatTemplate("{{ 1 / 0 }}", SPECIAL).render(CONVERSATION)


def test_where_templates_are_found(tmp_path):
    assert load_chat_template(tmp_path) is None  # no tokenizer_config.json, no chat_template.jinja
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}D"}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    assert load_chat_template(tmp_path).render([]) == "<s>D"  # the default of several named; AddedToken dicts
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert load_chat_template(tmp_path).render([]) == "J</s>"  # its own file wins over tokenizer_config.json
    (tmp_path / "override.jinja").write_text("O")
    assert load_chat_template(tmp_path, tmp_path / "override.jinja").render([]) == "O"
    with pytest.raises(SpeedcError, match="--chat-template"):
        load_chat_template(tmp_path, tmp_path / "missing.jinja")


def test_the_bundled_models_template_writes_play_text(tmp_path):
    """zoo:tiny / zoo:small carry a plain-text template (models/zoo.py, written into their artifacts by
    the build): each message a speech of its role, the generation prompt the assistant's speaker line; a
    reply ends at the model's end of text, the tokenizer_config's eos_token."""
    (tmp_path / "tokenizer_config.json").write_text(zoo.tokenizer_config_text(ZOO / "tiny"))
    template = load_chat_template(tmp_path)
    chat = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend."}]
    assert template.render(chat, add_generation_prompt=False) == "USER.\nWho goes there?\n\nASSISTANT.\nA friend.\n\n"
    assert template.render(chat[:1]) == "USER.\nWho goes there?\n\nASSISTANT.\n"
    from tokenizers import Tokenizer

    assert template.end_of_turn_ids(Tokenizer.from_file(str(ZOO / "tiny" / "tokenizer.json"))) == [0]  # <|endoftext|>
    assert zoo.tokenizer_config_text(tmp_path) is None  # any other checkpoint: its own files or none
