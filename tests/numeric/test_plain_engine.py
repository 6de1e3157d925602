"""Sharing maps with no weight-sharing pipeline build the plain engine, which still runs (P=1). (A middle
cycle pipelines on its depth plan: tests/unit/test_depth_plan.py, tests/numeric/test_family_looped_llama.py.)"""

from __future__ import annotations

import pytest

from conftest import build_artifact, random_config, randomize
from speedc import Engine
from speedc.format.artifact import read_manifest
from speedc.models.generate import generate as reference_generate
from speedc.models.llama import SharedLlama


@pytest.mark.parametrize("shape, reason", [
    (dict(layer_map=list(range(4)), layers=4, blocks=4), "unshared"),
    (dict(layer_map={"pattern": "sequence", "num_blocks": 2}, layers=6, blocks=2, exit_layer=3), "plain engine"),
])
def test_plain_engine(shape, reason, tmp_path):
    model = randomize(SharedLlama(random_config(**shape)), seed=4)
    art = build_artifact(model, tmp_path / "art")
    manifest = read_manifest(art)
    assert manifest.slots == 1 and reason in manifest.schedule["reason"]
    assert not (art / "batch_step.onnx").exists()
    engine = Engine.load(art)
    result = engine.generate([3, 1, 4], max_new_tokens=10, stop_at_eos=False)
    assert result.ids == reference_generate(model, [3, 1, 4], 10)
    assert result.stats.mode.startswith("speed (plain engine")
