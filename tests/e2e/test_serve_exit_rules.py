"""A looped model's depth rules through `speedc serve`: the request body's loops / exit_at_step /
exit_threshold / weighted_exit (the OpenAI clients' extra_body) give the engine's tokens for the same rule,
requests with and without a rule share the batch, a rule the artifact cannot run is a 400 naming it, and
/metrics counts the loops tokens exited at."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import pytest

from looped_checkpoints import write_ouro
from serve_server import start_server
from speedc import Engine
from speedc.build import build
from speedc.models import zoo
from speedc.passes.base import BuildOptions

PROMPT = [5, 17, 300, 42, 9, 77]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ouro_artifact(tmp_path_factory):
    """A tiny Ouro checkpoint with the bundled tiny model's tokenizer (the server needs one)."""
    root = tmp_path_factory.mktemp("serve-ouro")
    checkpoint = write_ouro(root / "ckpt", layers=1, loops=4, seed=2, vocab=1024, residual_scale=0.3)
    shutil.copy(zoo.ZOO_DIR / "tiny" / "tokenizer.json", checkpoint / "tokenizer.json")
    return build(checkpoint, root / "art", BuildOptions()).out


@pytest.fixture(scope="module")
def server(ouro_artifact, tmp_path_factory):
    running = start_server(ouro_artifact, tmp_path_factory.mktemp("serve-ouro-log"), "--model-name", "ouro")
    yield running
    assert running.stop() == -signal.SIGTERM, running.log.read_text()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


def complete(server, **extra) -> httpx.Response:
    body = {"model": "ouro", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_rules_in_the_body_give_the_engines_tokens(server, ouro_artifact):
    engine = Engine.load(ouro_artifact, threads=1)
    rules = [{}, {"exit_threshold": 0.5}, {"exit_at_step": 1}, {"loops": 2}, {"weighted_exit": True}]
    texts = {}
    for rule in rules:
        response = complete(server, **rule)
        assert response.status_code == 200, response.text
        texts[str(rule)] = response.json()["choices"][0]["text"]
        expected = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, mode="autoregressive", stop_at_eos=False, **rule)
        assert texts[str(rule)] == expected.text, rule
    assert len(set(texts.values())) > 1, "every rule gave the same text: the rules were not applied"
    exits = {name: value for name, value in server.metrics().items() if name.startswith("speedc_token_exit_loop_total")}
    assert sum(exits.values()) == NEW_TOKENS * (len(rules) - 1), exits
    assert exits['speedc_token_exit_loop_total{loop="1"}'] >= NEW_TOKENS  # exit_at_step 1 and loops 2


def test_streamed_under_a_rule_is_the_whole_text(server):
    whole = complete(server, exit_threshold=0.5).json()["choices"][0]["text"]
    pieces = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": "ouro", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True, "exit_threshold": 0.5}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == whole


def test_rule_the_artifact_cannot_run_is_a_400(server):
    response = complete(server, loops=9)
    assert response.status_code == 400
    assert "loops must be an integer in 1..4" in response.json()["error"]["message"]
    response = complete(server, exit_threshold="high")
    assert response.status_code == 400 and response.json()["error"]["param"] == "exit_threshold"


def test_grammar_under_a_rule(ouro_artifact):
    """A grammar masks the rule's logits at the exit loop and the drafts behind it: SPEED == plain, and the text
    follows the grammar (greedy and seeded)."""
    import re

    from llguidance import grammar_from

    engine = Engine.load(ouro_artifact, threads=1)
    grammar = grammar_from("regex", r"[a-z ]{5,20}\.")
    for rule in ({"exit_threshold": 0.5}, {"exit_at_step": 1}):
        for sampling in ({}, {"temperature": 0.8, "seed": 3}):
            runs = [engine.generate("hello", max_new_tokens=24, mode=mode, grammar=grammar, **sampling, **rule)
                    for mode in ("speed-always", "autoregressive")]
            assert runs[0].ids == runs[1].ids, (rule, sampling)
            text = engine.decode_text(runs[0].ids[:-1])  # before the end-of-text id the grammar ends with
            assert re.fullmatch(r"[a-z ]{5,20}\.", text) and runs[0].stats.stop_reason == "eos", runs[0]
