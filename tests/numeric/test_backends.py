"""Every backend runs the same schedule and gives the same ids: ONNX Runtime with IO binding and fused
attention, ONNX Runtime fed numpy views (the standard graphs), PyTorch."""

from __future__ import annotations

import pytest

from conftest import ZOO_MODELS
from speedc import Engine


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_backends_agree(name, zoo_artifacts):
    art = zoo_artifacts[name]
    engines = [Engine.load(art, backend="onnx-numpy"), Engine.load(art), Engine.load(art, backend="torch")]
    assert engines[1].backend.fused and not engines[0].backend.fused
    for prompt in ("ROMEO:\n", "First Citizen:\nWe are accounted poor citizens", "O"):
        for mode in ("speed", "autoregressive"):
            ids = [e.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode=mode).ids for e in engines]
            assert all(other == ids[0] for other in ids[1:]), (prompt, mode)
        sampled = [e.generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=0.8, seed=5).ids
                   for e in engines]
        assert all(other == sampled[0] for other in sampled[1:])
    assert all(e.generate("ROMEO:", max_new_tokens=16, mode="speed-always").stats.accepted > 0 for e in engines)


def test_fused_attention_writes_the_cache_in_place(zoo_artifacts):
    """After a request, the pool GroupQueryAttention wrote in place (IO binding) holds exactly the rows
    the numpy-fed backend wrote from the standard graphs' new-row outputs."""
    import numpy as np

    art = zoo_artifacts["tiny"]
    numpy_engine, bound_engine = Engine.load(art, backend="onnx-numpy"), Engine.load(art)
    assert bound_engine.backend.fused and not numpy_engine.backend.fused
    for engine in (numpy_engine, bound_engine):
        engine.generate("ROMEO:\n", max_new_tokens=40, stop_at_eos=False)
    written = len(numpy_engine.encode("ROMEO:\n")) + 40 - 1  # the last token is never fed back
    for kind in ("key", "value"):  # pool [S, P, W, kvh, T + 1, hd]: pool row 0
        expected = getattr(numpy_engine.backend.pool, kind)[:, :, 0, :, :written]
        got = getattr(bound_engine.backend.pool, kind)[:, :, 0, :, :written]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_onnx_runtime_on_another_device_is_a_clear_error(zoo_artifacts):
    from speedc.errors import SpeedcError

    for backend in ("onnx", "onnx-numpy"):
        with pytest.raises(SpeedcError, match="device 'cuda': the ONNX Runtime backends run on the CPU"):
            Engine.load(zoo_artifacts["tiny"], backend=backend, device="cuda")


def test_artifact_without_fused_graphs_runs_the_standard_ones(zoo_artifacts, tmp_path):
    """An artifact built without the fused-attention graphs (a head_dim GroupQueryAttention refuses)
    loads with the default backend, on the standard graphs, with the same ids."""
    import json
    import shutil

    art = shutil.copytree(zoo_artifacts["tiny"], tmp_path / "standard")
    manifest = json.loads((art / "manifest.json").read_text())
    for name in [n for n in manifest["graphs"] if n.endswith(".gqa")]:
        (art / manifest["graphs"].pop(name)["file"]).unlink()
    manifest["files"] = {f: h for f, h in manifest["files"].items() if (art / f).exists()}
    (art / "manifest.json").write_text(json.dumps(manifest))
    standard, current = Engine.load(art), Engine.load(zoo_artifacts["tiny"])
    assert not standard.backend.fused and current.backend.fused
    assert standard.generate("ROMEO:", max_new_tokens=24).ids == current.generate("ROMEO:", max_new_tokens=24).ids
