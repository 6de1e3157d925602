"""The request fields clients send beyond plain text generation, checked through the engine (both modes),
transformers (the oracle) and the real openai client against `speedc serve`: a chat turn's end token,
log-probabilities (and echo), penalties, logit_bias, n and seed."""

from __future__ import annotations

import signal

import pytest
from tokenizers import Tokenizer

from serve_server import start_server
from speedc import Engine
from speedc.serve.chat_template import ChatTemplate

# Ends each turn with the tokenizer's one special token, as ChatML ends them with <|im_end|>.
TURN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MODES = ("speed", "autoregressive")


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact, threads=1)


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-features")
    (folder / "chat.jinja").write_text(TURN_TEMPLATE)
    running = start_server(tiny_artifact, folder, "--model-name", "tiny", "--chat-template", str(folder / "chat.jinja"))
    yield running
    assert running.stop() == -signal.SIGTERM, running.log.read_text()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


# ---- the end of a chat turn -----------------------------------------------------------------------
def test_end_of_turn_token_comes_from_the_template(tiny_artifact):
    tokenizer = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    im_end = tokenizer.token_to_id("<|im_end|>")
    # Ouro's case: the configured end of text (id 0 here) is not what ends a ChatML turn
    assert ChatTemplate(CHATML, {"eos_token": "<|endoftext|>"}).end_of_turn_ids(tokenizer) == [im_end, 0]
    assert ChatTemplate(CHATML, {}).end_of_turn_ids(tokenizer) == [im_end]
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert ChatTemplate(plain, {}).end_of_turn_ids(tokenizer) == []  # nothing special after a turn
    refuses = "{{ raise_exception('no') }}"
    assert ChatTemplate(refuses, {}).end_of_turn_ids(tokenizer) == []


def test_stop_token_ids_end_generation_in_both_modes(engine):
    prompt = engine.encode("ROMEO:")
    free = engine.generate(prompt, max_new_tokens=30, stop_at_eos=False)
    stop = free.ids[5]
    for mode in MODES:
        cut = engine.generate(prompt, max_new_tokens=30, stop_at_eos=False, stop_token_ids=[stop], mode=mode)
        assert cut.ids == free.ids[:free.ids.index(stop) + 1] and cut.stats.stop_reason == "eos"


def test_chat_stops_at_the_templates_end_of_turn(server, client, engine, tiny_artifact, tmp_path):
    from speedc.serve.app import ServeSettings, Service
    from speedc.serve.protocol import parse_request

    (tmp_path / "chat.jinja").write_text(TURN_TEMPLATE)
    service = Service(ServeSettings(tiny_artifact, "tiny", threads=1, max_batch=1, chat_template=tmp_path / "chat.jinja"))
    assert service.end_of_turn_ids == (0,)
    chat = parse_request({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [7]}, "chat")
    assert service.stop_token_ids(chat) == (7, 0)
    completion = parse_request({"model": "tiny", "prompt": "x"}, "completion")
    assert service.stop_token_ids(completion) == ()

    messages = [{"role": "user", "content": "Who goes there?"}]
    ids = engine.tokenizer.encode("<|user|>\nWho goes there?<|endoftext|>\n<|assistant|>\n", add_special_tokens=False).ids
    free = engine.generate(ids, max_new_tokens=20, stop_at_eos=False)
    stop = free.ids[3]
    expected = engine.generate(ids, max_new_tokens=20, stop_token_ids=[stop])
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"stop_token_ids": [stop]})
    assert whole.choices[0].message.content == expected.text and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(expected.ids) <= 4
