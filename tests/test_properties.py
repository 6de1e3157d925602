"""Property tests: over random small models (with exit heads perturbed to force mispredictions) and
random prompts / lengths / sampling settings, SPEED's output equals plain decoding and the PyTorch
reference. 200 cases in CI; SPEEDC_PROPERTY_EXAMPLES raises it."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ZOO, build_artifact, random_config, randomize
from speedc import Engine
from speedc.runtimes.onnx_bound import OnnxBoundBackend
from speedc.models.checkpoint import load_model
from speedc.models.generate import generate as reference_generate
from speedc.models.llama import SharedLlama

EXAMPLES = int(os.environ.get("SPEEDC_PROPERTY_EXAMPLES", "200"))

SHAPES = [
    dict(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64),  # P=3, head_dim 16 (fused attention graphs)
    dict(blocks=2, layers=8, heads=4, kv_heads=1, tie=False),  # P=4, MQA, untied head, head_dim 8 (no fused graphs)
    dict(blocks=3, layers=6, heads=2, kv_heads=2, exit_layer=2),  # P=2, exit inside the stage
    dict(blocks=1, layers=5, heads=2, kv_heads=1, exit_norm="final"),  # P=5, one-layer stages
]


def _perturb_exit_head(model: SharedLlama, seed: int, strength: float) -> SharedLlama:
    """Noise on the exit norm: the exit head disagrees with the final head more often (forced
    mispredictions); the final head, and so the correct output, is untouched."""
    if model.cfg.exit_norm == "own":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = model.model.exit_norm.weight
            weight.mul_(1 + strength * torch.randn(weight.shape, generator=gen))
    return model


def _engines(art) -> tuple[Engine, dict[str, Engine]]:
    """The numpy-fed engine, and SPEED engines on every ONNX Runtime path: numpy-fed, IO binding as
    loaded (fused GroupQueryAttention writes the cache where head_dim allows it), IO binding with the
    cache-writer graphs."""
    plain = Engine.load(art, backend="onnx-numpy")
    writer = Engine.load(art)
    writer.backend = OnnxBoundBackend(writer.directory, writer.manifest, fused=False)
    return plain, {"onnx-numpy": plain, "onnx": Engine.load(art), "onnx writer graphs": writer}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("props")
    entries = []
    for i, shape in enumerate(SHAPES):
        model = _perturb_exit_head(randomize(SharedLlama(random_config(**shape)), seed=100 + i), seed=i, strength=0.5)
        entries.append((model, *_engines(build_artifact(model, root / f"random{i}"))))
    # A trained model speculates well; a perturbed copy mispredicts often: both paths get exercised.
    for strength in (0.0, 3.0):
        model = _perturb_exit_head(load_model(ZOO / "tiny"), seed=7, strength=strength)
        entries.append((model, *_engines(build_artifact(model, root / f"tiny-{strength}"))))
    return entries


sampling = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"temperature": st.floats(0.3, 1.5), "seed": st.integers(0, 2**31 - 1)},
                          optional={"top_k": st.integers(1, 50), "top_p": st.floats(0.3, 1.0),
                                    "repetition_penalty": st.floats(1.0, 1.5)}),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), which=st.integers(0, len(SHAPES) + 1), new_tokens=st.integers(1, 24),
       params=sampling, early_flush=st.booleans(), path=st.sampled_from(["onnx-numpy", "onnx", "onnx writer graphs"]))
def test_speed_equals_plain_decoding(pool, data, which, new_tokens, params, early_flush, path):
    """SPEED on every ONNX Runtime path (numpy-fed; IO binding with in-place cache writes and
    scratch-row bubbles, fused or not) equals plain decoding on the numpy-fed one, and the reference."""
    model, engine, speed_engines = pool[which]
    vocab = model.cfg.vocab_size
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12), label="prompt")
    speed = speed_engines[path].generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False,
                                         early_flush=early_flush, **params)
    plain = engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, mode="autoregressive", **params)
    assert speed.ids == plain.ids
    assert len(speed.ids) == new_tokens
    if not params:
        assert speed.ids == reference_generate(model, prompt, new_tokens)
    stats = speed.stats
    assert stats.accepted + stats.mispredicted <= new_tokens
    assert stats.steps <= new_tokens * engine.manifest.slots + engine.manifest.slots


def test_pool_really_mispredicts_and_accepts(pool):
    """Guard against a vacuous property: across the pool both flushes and acceptances happen."""
    accepted = mispredicted = 0
    for model, engine, _ in pool:
        result = engine.generate([1, 2, 3, 4], max_new_tokens=32, stop_at_eos=False)
        accepted += result.stats.accepted
        mispredicted += result.stats.mispredicted
    assert accepted > 20 and mispredicted > 20
