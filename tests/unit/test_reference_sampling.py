"""The PyTorch reference decoder's sampling and stopping rules."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_config, randomize
from speedc.errors import GenerationError
from speedc.models.generate import generate
from speedc.models.sampling import SamplingParams as Sampling
from speedc.models.sampling import TokenPicker
from speedc.models.llama import SharedLlama


@pytest.fixture(scope="module")
def model():
    return randomize(SharedLlama(random_config(blocks=2, layers=4)), seed=9)


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    a = generate(model, [1, 2, 3], 30, Sampling(temperature=1.0, seed=7))
    assert a == generate(model, [1, 2, 3], 30, Sampling(temperature=1.0, seed=7))
    assert a != generate(model, [1, 2, 3], 30, Sampling(temperature=1.0, seed=8))


def test_degenerate_sampling_equals_greedy(model):
    greedy = generate(model, [4, 5], 20)
    assert generate(model, [4, 5], 20, Sampling(temperature=1.0, top_k=1, seed=1)) == greedy
    assert generate(model, [4, 5], 20, Sampling(temperature=1.0, top_p=1e-6, seed=1)) == greedy


def test_repetition_penalty_changes_greedy_output(model):
    assert generate(model, [4, 5], 30, Sampling(repetition_penalty=3.0)) != generate(model, [4, 5], 30)


def test_stops_at_eos_and_validates(model):
    first = generate(model, [1, 2], 1)[0]
    assert generate(model, [1, 2], 10, eos_token_id=first) == [first]
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(model, [], 3)
    with pytest.raises(GenerationError, match="prompt ids"):
        generate(model, [model.cfg.vocab_size], 3)
    with pytest.raises(GenerationError, match="exceeds the context"):
        generate(model, [1] * 100, 40)


def test_a_tiny_temperature_picks_the_argmax_and_non_finite_settings_are_refused():
    """Before: at temperature 1e-320 the scores overflowed to inf, softmax gave nan and the last id was
    picked every time. The scores are shifted by their maximum before dividing now."""
    logits = np.array([0.5, 2.0, -1.0, 2.0 - 1e-9, 1.0])
    for temperature in (1e-320, 1e-300, 1e-12):
        picker = TokenPicker(Sampling(temperature=temperature, seed=0))
        assert [picker.pick(logits, 0, []) for _ in range(8)] == [1] * 8
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(repetition_penalty=float("nan")),
                dict(top_p=float("nan")), dict(seed=-1)):
        with pytest.raises(GenerationError):
            TokenPicker(Sampling(**bad))
