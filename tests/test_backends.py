"""Every backend runs the same schedule and gives the same ids: ONNX Runtime with IO binding (fused
attention, or the cache-writer graphs; here on the CPU device), ONNX Runtime fed numpy views, PyTorch."""

from __future__ import annotations

import pytest

from conftest import ZOO_MODELS
from speedc import Engine
from speedc.runtimes.onnx_bound import OnnxBoundBackend


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_backends_agree(name, zoo_artifacts):
    art = zoo_artifacts[name]
    writer = Engine.load(art)
    writer.backend = OnnxBoundBackend(writer.directory, writer.manifest, fused=False)
    engines = [Engine.load(art, backend="onnx-numpy"), Engine.load(art), writer, Engine.load(art, backend="torch")]
    assert engines[1].backend.fused and not writer.backend.fused
    for prompt in ("ROMEO:\n", "First Citizen:\nWe are accounted poor citizens", "O"):
        for mode in ("speed", "autoregressive"):
            ids = [e.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode=mode).ids for e in engines]
            assert all(other == ids[0] for other in ids[1:]), (prompt, mode)
        sampled = [e.generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=5).ids
                   for e in engines]
        assert all(other == sampled[0] for other in sampled[1:])
    assert all(e.generate("ROMEO:", max_new_tokens=16).stats.accepted > 0 for e in engines)


@pytest.mark.parametrize("fused", [True, False])
def test_bound_backend_writes_the_cache_in_place(zoo_artifacts, fused):
    """After a request, the device cache holds exactly the rows the numpy-fed backend wrote, whether
    GroupQueryAttention (fused) or the ScatterND cache writers put them there."""
    import numpy as np

    art = zoo_artifacts["tiny"]
    numpy_engine, bound_engine = Engine.load(art, backend="onnx-numpy"), Engine.load(art)
    bound_engine.backend = OnnxBoundBackend(bound_engine.directory, bound_engine.manifest, fused=fused)
    for engine in (numpy_engine, bound_engine):
        engine.generate("ROMEO:\n", max_new_tokens=40, stop_at_eos=False)
    written = len(numpy_engine.encode("ROMEO:\n")) + 40 - 1  # the last token is never fed back
    for kind in ("key", "value"):
        expected = getattr(numpy_engine.backend, kind)[:, :, :, :written]
        got = getattr(bound_engine.backend, kind).numpy()[:, :, :, :written]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_unknown_cuda_provider_is_a_clear_error(zoo_artifacts):
    import onnxruntime

    from speedc.errors import SpeedcError

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA provider")
    with pytest.raises(SpeedcError, match="no CUDA provider"):
        Engine.load(zoo_artifacts["tiny"], device="cuda")


def test_artifact_without_io_binding_graphs_runs_numpy_fed(zoo_artifacts, tmp_path):
    """An artifact built before the IO-binding graphs existed still loads with the default backend."""
    import json
    import shutil

    art = shutil.copytree(zoo_artifacts["tiny"], tmp_path / "old")
    manifest = json.loads((art / "manifest.json").read_text())
    for name in [n for n in manifest["graphs"] if n.startswith("cache_write") or n.endswith(".gqa")]:
        (art / manifest["graphs"].pop(name)["file"]).unlink()
    manifest["files"] = {f: h for f, h in manifest["files"].items() if (art / f).exists()}
    (art / "manifest.json").write_text(json.dumps(manifest))
    old, current = Engine.load(art), Engine.load(zoo_artifacts["tiny"])
    assert old.backend.name == "onnx-numpy" and current.backend.name == "onnx"
    assert old.generate("ROMEO:", max_new_tokens=24).ids == current.generate("ROMEO:", max_new_tokens=24).ids
