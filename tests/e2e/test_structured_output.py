"""Structured output: a grammar (llguidance) masks the final head's choice as plain decoding masks it and
the draft along the speculative path, so constrained SPEED equals constrained plain decoding; what comes
out parses and validates against its schema (100 varied schemas, greedy and sampled), on zoo:tiny and on
a copy whose exit head is perturbed to mispredict; the server takes OpenAI's response_format and vLLM's
and llama-server's grammar fields."""

from __future__ import annotations

import json
import random
import shutil
import signal

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from conftest import ZOO, build_artifact
from serve_server import start_server
from speedc import Engine
from speedc.errors import GenerationError
from speedc.models.checkpoint.torch_io import load_model
from speedc.serve.protocol import JSON_OPTIONS

MODES = ("speed-always", "autoregressive")  # speed-always: every step speculates


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """zoo:tiny, and zoo:tiny with a perturbed exit head (the same final head: the same outputs, more flushes)."""
    root = tmp_path_factory.mktemp("structured")
    model = load_model(ZOO / "tiny")
    with torch.no_grad():
        weight = model.model.exit_norm.weight
        weight.mul_(1 + 3.0 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(2)))
    perturbed = build_artifact(model, root / "perturbed")
    shutil.copy(ZOO / "tiny" / "tokenizer.json", perturbed / "tokenizer.json")
    return [Engine.load(build_artifact(ZOO / "tiny", root / "tiny"), threads=1), Engine.load(perturbed, threads=1)]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every instance is short (bounded strings, arrays, enums), so a small model
    finishes it within the token budget."""
    kinds = ["string", "integer", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "king", "queen", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "age", "title", "house", "alive", "rank", "city"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}, "required": names,
            "additionalProperties": False}


def test_constrained_output_validates_and_speed_equals_plain(engines):
    rng = random.Random(0)
    accepted = checked = 0
    for number in range(100):
        schema = {"type": "object", "properties": {"answer": random_schema(rng)}, "required": ["answer"],
                  "additionalProperties": False} if number % 2 else random_schema(rng)
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        engine = engines[number % 2]
        settings = dict(temperature=0.9, seed=number) if number % 3 == 0 else {}
        prompt = rng.choice(["ROMEO:", "KING HENRY:\n", "{", "The answer is "])
        runs = {mode: engine.generate(prompt, max_new_tokens=96, mode=mode, grammar=grammar, **settings) for mode in MODES}
        assert runs["speed-always"].ids == runs["autoregressive"].ids, (number, schema)
        result = runs["speed-always"]
        assert result.stats.stop_reason == "eos", (number, schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)
        accepted += result.stats.accepted
        checked += result.stats.accepted + result.stats.failed_speculations
    assert checked > 500 and accepted > 0


def test_regex_choice_and_lark_grammars(engines):
    engine = engines[0]
    for grammar, check in [(LLMatcher.grammar_from_regex(r"[A-Z][a-z]{2,6}, [0-9]{1,3}!"),
                            lambda t: t[0].isupper() and t.endswith("!") and ", " in t),
                           (LLMatcher.grammar_from_lark('start: "yes" | "no" | "perhaps"'),
                            lambda t: t in ("yes", "no", "perhaps")),
                           (LLMatcher.grammar_from_lark('start: word (" " word)*\nword: /[a-z]{1,5}/'),
                            lambda t: all(w.isalpha() and w.islower() for w in t.split(" ")))]:
        for mode in MODES:
            result = engine.generate("ROMEO:", max_new_tokens=40, mode=mode, grammar=grammar, temperature=0.7, seed=1)
            assert check(result.text), result.text


def test_a_grammar_needs_an_end_and_must_be_valid(engines):
    engine = engines[0]
    grammar = LLMatcher.grammar_from_lark('start: "yes"')
    with pytest.raises(GenerationError, match="needs an end"):
        engine.generate("x", max_new_tokens=4, grammar=grammar, stop_at_eos=False)
    assert engine.generate("x", max_new_tokens=4, grammar=grammar, stop_at_eos=False, stop_token_ids=[0]).text == "yes"
    with pytest.raises(GenerationError, match="grammar is not valid"):
        engine.generate("x", max_new_tokens=4, grammar=LLMatcher.grammar_from_lark("start: ("))


@pytest.fixture(scope="module")
def client(engines, tmp_path_factory):
    import openai

    folder = tmp_path_factory.mktemp("serve-structured")
    (folder / "chat.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n"
                                       "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    running = start_server(engines[0].directory, folder, "--model-name", "tiny", "--chat-template",
                           str(folder / "chat.jinja"))
    yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0), running
    assert running.stop() == -signal.SIGTERM, running.log.read_text()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


def test_served_response_format_and_grammar_fields(client, engines):
    import openai

    client, running = client
    engine = engines[0]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "loyal": {"type": "boolean"}}, "required": ["name", "loyal"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Who goes there?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "who", "schema": schema}})
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    ids = engine.tokenizer.encode("<|user|>\nWho goes there?<|endoftext|>\n<|assistant|>\n", add_special_tokens=False).ids
    expected = engine.generate(ids, max_new_tokens=60,
                               grammar=LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
    assert whole.choices[0].message.content == expected.text
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0, stream=True,
                                              response_format={"type": "json_schema",
                                                               "json_schema": {"name": "who", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text
    anything = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0.8, seed=4,
                                              response_format={"type": "json_object"})
    # any object: zoo:tiny writes Shakespeare into its first key until max_tokens (a schema bounds it)
    assert anything.choices[0].message.content.startswith('{"') and anything.choices[0].finish_reason == "length"
    choice = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=10, n=3, temperature=1.0, seed=2,
                                       extra_body={"guided_choice": ["aye", "nay"]})
    assert {c.text for c in choice.choices} <= {"aye", "nay"}
    regex = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    gbnf = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=20, temperature=0,
                                     extra_body={"grammar": 'root ::= "my " ("lord" | "liege")'})
    assert gbnf.choices[0].text in ("my lord", "my liege")
    for extra, param in [({"grammar": "root ::= ("}, "grammar"), ({"guided_regex": "[a-"}, "guided_regex"),
                         ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
                         ({"guided_choice": []}, "guided_choice"), ({"guided_regex": "a", "ignore_eos": True}, "guided_regex")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
        assert refused.value.body["param"] == param, (extra, refused.value.body)


# ---- tool calls -----------------------------------------------------------------------------------
TOOL_TEMPLATE = """{% if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}Call one as <tool_call> JSON </tool_call>.<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for call in m.tool_calls %}<tool_call>
{{ call.function | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
MUSTER = {"type": "function", "function": {"name": "muster", "parameters": {
    "type": "object", "properties": {"men": {"type": "integer", "minimum": 1, "maximum": 999}}, "required": ["men"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server(engines, tmp_path_factory):
    import openai

    folder = tmp_path_factory.mktemp("serve-tools")
    (folder / "chat.jinja").write_text(TOOL_TEMPLATE)
    running = start_server(engines[0].directory, folder, "--model-name", "tiny", "--chat-template",
                           str(folder / "chat.jinja"))
    yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0), folder
    assert running.stop() == -signal.SIGTERM, running.log.read_text()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


def test_tool_calls(tool_server, engines, client):
    import openai

    from speedc.serve.chat_template import ChatTemplate
    from speedc.serve.tools import call_grammar

    tools_client, folder = tool_server
    engine = engines[0]
    messages = [{"role": "user", "content": "What weather in Verona?"}]
    called = tools_client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, MUSTER],
                                                  tool_choice="required", max_tokens=80, temperature=0)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    schema = {WEATHER["function"]["name"]: WEATHER, "muster": MUSTER}[call.function.name]["function"]["parameters"]
    jsonschema.validate(arguments, schema)
    prompt = ChatTemplate(TOOL_TEMPLATE, {}).render(messages, tools=[WEATHER, MUSTER])
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False).ids
    expected = engine.generate(ids, max_new_tokens=80, grammar=call_grammar([WEATHER, MUSTER], "required"))
    assert expected.text == "<tool_call>\n" + json.dumps({"name": call.function.name, "arguments": arguments},
                                                         separators=(",", ":")) + "\n</tool_call>"

    named = tools_client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, MUSTER], max_tokens=80, temperature=0.9, seed=3,
        tool_choice={"type": "function", "function": {"name": "muster"}})
    assert named.choices[0].message.tool_calls[0].function.name == "muster"
    jsonschema.validate(json.loads(named.choices[0].message.tool_calls[0].function.arguments), MUSTER["function"]["parameters"])

    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Rain, and a cold wind."}]
    auto = tools_client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=40,
                                                temperature=0.8, seed=1)
    message = auto.choices[0].message
    assert (message.tool_calls is None) == isinstance(message.content, str)

    plain_client, _ = client  # its template writes no tool calls
    for sender, extra, param in [(plain_client, dict(tools=[WEATHER]), "tools"),
                                 (tools_client, dict(tools=[WEATHER], stream=True), "tools"),
                                 (tools_client, dict(tool_choice="required"), "tool_choice"),
                                 (tools_client, dict(tools=[WEATHER], tool_choice={"type": "function",
                                                                                   "function": {"name": "fly"}}), "tool_choice"),
                                 (tools_client, dict(tools=[{"type": "function"}]), "tools"),
                                 (tools_client, dict(tools=[WEATHER], response_format={"type": "json_object"}),
                                  "response_format")]:
        with pytest.raises(openai.BadRequestError) as refused:
            sender.chat.completions.create(model="tiny", messages=messages, max_tokens=4, **extra)
        assert refused.value.body["param"] == param, (extra, refused.value.body)
