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
MODES = ("speed-always", "autoregressive")  # speed-always: every step speculates


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


# ---- log-probabilities and echo -------------------------------------------------------------------
def _completion_columns(logprobs):
    return list(zip(logprobs.tokens, logprobs.token_logprobs))


def test_completion_logprobs_equal_the_engines_streamed_or_whole(client, engine):
    prompt = "KING HENRY:\n"
    expected = engine.generate(prompt, max_new_tokens=20, stop_at_eos=False, logprobs=3)
    texts = [engine.tokenizer.decode([t]) for t in expected.ids]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    logprobs = whole.choices[0].logprobs
    assert _completion_columns(logprobs) == list(zip(texts, [p.logprob for p in expected.logprobs]))  # exact floats
    for top, entry, text in zip(logprobs.top_logprobs, expected.logprobs, texts):
        assert max(top.values()) == top[text] == entry.logprob  # greedy: the chosen one is the best
        assert 3 <= len(top) <= 4
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(texts[0])

    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, logprobs=3,
                                              stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert list(zip(tokens, values)) == _completion_columns(logprobs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_echo_scores_the_prompt(client, engine):
    """What evaluation harnesses send: echo, logprobs, max_tokens 0 (or 1, the extra token ignored)."""
    ids = engine.encode("ROMEO: I dreamt a dream tonight.")
    expected = engine.generate(ids, max_new_tokens=1, prompt_logprobs=1, logprobs=1)
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == engine.tokenizer.decode(ids) and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [p.logprob for p in expected.prompt_logprobs]
    assert choice.logprobs.tokens == [engine.tokenizer.decode([i]) for i in ids]
    one_more = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert one_more.choices[0].logprobs.token_logprobs[:-1] == choice.logprobs.token_logprobs
    assert one_more.choices[0].logprobs.token_logprobs[-1] == expected.logprobs[0].logprob
    streamed = list(client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        choice.logprobs.token_logprobs


def test_chat_logprobs(client, engine):
    messages = [{"role": "user", "content": "Who goes there?"}]
    ids = engine.tokenizer.encode("<|user|>\nWho goes there?<|endoftext|>\n<|assistant|>\n", add_special_tokens=False).ids
    expected = engine.generate(ids, max_new_tokens=12, logprobs=2, temperature=0.8, seed=5)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, logprobs=True, top_logprobs=2,
                                           temperature=0.8, seed=5)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == [p.logprob for p in expected.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[v for _, v in p.top] for p in expected.logprobs]
    assert bytes(b for c in content for b in c.bytes).decode() == expected.text
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, logprobs=True,
                                                   top_logprobs=2, temperature=0.8, seed=5, stream=True))
    assert [c.logprob for s in streamed if s.choices and s.choices[0].logprobs for c in s.choices[0].logprobs.content] \
        == [c.logprob for c in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0.8, seed=5)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == expected.text


# ---- penalties, logit_bias, n, best_of, seed ------------------------------------------------------
def test_penalties_and_logit_bias_equal_the_engine(client, engine):
    settings = dict(presence_penalty=0.6, frequency_penalty=0.9, temperature=0.7, seed=3)
    bias = {engine.encode(" the")[0]: 4.0, engine.encode("\n")[0]: -100.0}
    expected = engine.generate("ROMEO:", max_new_tokens=30, logit_bias=bias, **settings)
    whole = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=30,
                                      logit_bias={str(k): v for k, v in bias.items()}, **settings)
    assert whole.choices[0].text == expected.text and "\n" not in expected.text
    assert expected.text != engine.generate("ROMEO:", max_new_tokens=30, **settings).text


def test_n_choices_are_the_generations_of_seed_plus_index(client, engine):
    expected = [engine.generate("JULIET:", max_new_tokens=16, temperature=1.0, seed=40 + i).text for i in range(3)]
    whole = client.completions.create(model="tiny", prompt="JULIET:", max_tokens=16, temperature=1.0, seed=40, n=3)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert len(set(expected)) > 1
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Speak."}],
                                                 max_tokens=10, temperature=1.0, seed=7, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    whole_chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Speak."}],
                                                max_tokens=10, temperature=1.0, seed=7, n=2)
    assert [texts[0], texts[1]] == [c.message.content for c in whole_chat.choices]
    assert chunks[-1].usage.completion_tokens == whole_chat.usage.completion_tokens


def test_best_of_returns_the_most_likely_generation(client, engine):
    runs = [engine.generate("ROMEO:", max_new_tokens=8, temperature=1.2, seed=9 + i, logprobs=0, stop_at_eos=False)
            for i in range(4)]
    best = max(runs, key=lambda r: sum(p.logprob for p in r.logprobs))
    whole = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=8, temperature=1.2, seed=9, best_of=4,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in whole.choices] == [best.text] and whole.choices[0].logprobs is None
    assert whole.usage.completion_tokens == 32


def test_single_sequence_server_gives_the_same_logprobs(tiny_artifact, tmp_path, engine):
    import openai

    running = start_server(tiny_artifact, tmp_path, "--model-name", "tiny", "--max-batch", "1")
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        ids = engine.encode("ROMEO:")
        expected = engine.generate(ids, max_new_tokens=10, prompt_logprobs=2, logprobs=2, temperature=0.9, seed=1)
        got = client.completions.create(model="tiny", prompt=ids, max_tokens=10, echo=True, logprobs=2,
                                        temperature=0.9, seed=1, n=2)
        values = got.choices[0].logprobs.token_logprobs
        assert values == [None] + [p.logprob for p in expected.prompt_logprobs + expected.logprobs]
    finally:
        assert running.stop() == -signal.SIGTERM, running.log.read_text()
