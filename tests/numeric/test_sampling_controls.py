"""Log-probabilities, echo (the prompt's own), penalties and logit_bias through the engine: the same in
SPEED and plain decoding (bitwise, on a model whose exit head is perturbed to mispredict, and a zoo one),
and equal to transformers' logits on the same checkpoint (float64 log-softmax, the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import ZOO, build_artifact, random_config, randomize
from speedc import Engine
from speedc.errors import GenerationError
from speedc.models.checkpoint.torch_io import load_model, save_unrolled_hf
from speedc.models.llama import SharedLlama

MODES = ("speed-always", "autoregressive")  # speed-always: every step speculates


def _perturbed(model: SharedLlama, strength: float = 3.0) -> SharedLlama:
    """Noise on the exit norm: the exit head mispredicts often, the final head is untouched."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        weight = model.model.exit_norm.weight
        weight.mul_(1 + strength * torch.randn(weight.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(torch model, engine) pairs: a random P=4 model that mispredicts, and zoo:tiny."""
    root = tmp_path_factory.mktemp("controls")
    random = _perturbed(randomize(SharedLlama(random_config(blocks=2, layers=8, heads=4, kv_heads=2, hidden=64)), seed=3))
    return [(random, Engine.load(build_artifact(random, root / "random"), threads=1)),
            (load_model(ZOO / "tiny"), Engine.load(build_artifact(ZOO / "tiny", root / "tiny"), threads=1))]


@pytest.fixture(scope="module")
def tiny_oracle(models, tmp_path_factory):
    model, engine = models[1]
    hf = save_unrolled_hf(model, tmp_path_factory.mktemp("hf") / "hf")
    return LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32, attn_implementation="eager").eval(), engine


def _rows(logprobs):
    return [(p.token, p.logprob, p.top) for p in logprobs]


@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.9, seed=11, top_k=20),
                                      dict(temperature=0.7, seed=2, presence_penalty=0.8, frequency_penalty=0.5,
                                           repetition_penalty=1.2, logit_bias={3: 2.5, 4: -100})],
                         ids=["greedy", "seeded", "penalized"])
def test_logprobs_and_penalties_are_bitwise_the_same_in_both_modes(models, settings):
    for _, engine in models:
        prompt = [5, 9, 2, 7, 1, 8]
        runs = {mode: engine.generate(prompt, max_new_tokens=40, stop_at_eos=False, mode=mode, logprobs=3,
                                      prompt_logprobs=2, **settings) for mode in MODES}
        speed, plain = runs["speed-always"], runs["autoregressive"]
        assert speed.ids == plain.ids and len(speed.ids) == 40
        assert _rows(speed.logprobs) == _rows(plain.logprobs)  # floats compared exactly
        assert [p.token for p in speed.logprobs] == speed.ids and all(len(p.top) == 3 for p in speed.logprobs)
        assert _rows(speed.prompt_logprobs) == _rows(plain.prompt_logprobs)
        assert [p.token for p in speed.prompt_logprobs] == prompt[1:]
        if "logit_bias" in settings:
            assert 4 not in speed.ids
    assert models[0][1].generate([5, 9, 2], max_new_tokens=40, stop_at_eos=False, mode="speed-always").stats.mispredicted > 5


def test_asking_for_logprobs_changes_no_token(models):
    for _, engine in models:
        for mode in MODES:
            plain = engine.generate([4, 4, 8], max_new_tokens=30, stop_at_eos=False, mode=mode)
            logged = engine.generate([4, 4, 8], max_new_tokens=30, stop_at_eos=False, mode=mode, logprobs=0)
            assert logged.ids == plain.ids and all(p.top == () for p in logged.logprobs)


def test_logprobs_equal_transformers_log_softmax(tiny_oracle):
    oracle, engine = tiny_oracle
    prompt = engine.encode("KING RICHARD:\nWhat news")
    result = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False, logprobs=5, prompt_logprobs=5)
    ids = prompt + result.ids
    with torch.no_grad():
        logits = oracle(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1).numpy()  # row i: the distribution of token i + 1
    ours = result.prompt_logprobs + result.logprobs
    assert len(ours) == len(ids) - 1
    for i, entry in enumerate(ours):
        assert entry.token == ids[i + 1]
        assert abs(entry.logprob - expected[i, ids[i + 1]]) < 1e-4, i
        top_ids = [t for t, _ in entry.top]
        np.testing.assert_allclose([v for _, v in entry.top], expected[i, top_ids], atol=1e-4)
        assert sorted(expected[i], reverse=True)[4] <= entry.top[-1][1] + 1e-4  # they are the top 5
    assert result.ids == [int(np.argmax(expected[len(prompt) - 1 + j])) for j in range(len(result.ids))]


def test_penalties_follow_openai_formula(tiny_oracle):
    """Frequency and presence penalties subtract count * frequency + presence from the logits of tokens
    the output already holds (not the prompt's), logit_bias adds to a token's logit: checked against
    transformers' logits with the rule written out here."""
    oracle, engine = tiny_oracle
    prompt = engine.encode("ROMEO:\n")
    settings = dict(presence_penalty=1.5, frequency_penalty=0.75, logit_bias={engine.encode(" the")[0]: 3.0})
    out = []
    for _ in range(16):
        with torch.no_grad():
            scores = oracle(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        for token, bias in settings["logit_bias"].items():
            scores[token] += bias
        for token in set(out):
            scores[token] -= out.count(token) * settings["frequency_penalty"] + settings["presence_penalty"]
        out.append(int(np.argmax(scores)))
    for mode in MODES:
        assert engine.generate(prompt, max_new_tokens=16, stop_at_eos=False, mode=mode, **settings).ids == out
    assert engine.generate(prompt, max_new_tokens=16, stop_at_eos=False).ids != out  # the settings did something


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence penalty must be in"), (dict(frequency_penalty="x"), "frequency penalty must be"),
    (dict(logit_bias={5000: 1.0}), "outside the vocabulary"), (dict(logit_bias={1: 500}), "bias in \\[-100, 100\\]"),
    (dict(logit_bias={"a": 1.0}), "keys must be token ids"), (dict(logprobs=21), "logprobs must be in 0..20"),
    (dict(prompt_logprobs=-1), "prompt logprobs must be in"), (dict(stop_token_ids=[5000]), "not a token id")])
def test_bad_settings_are_refused(models, bad, message):
    with pytest.raises(GenerationError, match=message):
        models[1][1].generate([1, 2], max_new_tokens=2, **bad)
