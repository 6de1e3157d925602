"""The PyTorch backend runs the same schedule as the compiled graphs and gives the same ids."""

from __future__ import annotations

import pytest

from conftest import ZOO_MODELS
from speedc import Engine


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_torch_and_onnx_backends_agree(name, zoo_artifacts):
    art = zoo_artifacts[name]
    onnx_engine, torch_engine = Engine.load(art), Engine.load(art, backend="torch")
    for prompt in ("ROMEO:\n", "First Citizen:\nWe are accounted poor citizens", "O"):
        for mode in ("speed", "autoregressive"):
            a = onnx_engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode=mode)
            b = torch_engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode=mode)
            assert a.ids == b.ids, (prompt, mode)
        sampled = [e.generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=5).ids
                   for e in (onnx_engine, torch_engine)]
        assert sampled[0] == sampled[1]
    assert torch_engine.generate("ROMEO:", max_new_tokens=16).stats.accepted > 0
