"""The build streams weights: the graphs never hold them, weights.bin is the checkpoint's bytes, and
the build's memory does not grow with the checkpoint (multi-GB builds are a benchmark; see README).

    checkpoint shards --(headers only)--> passes (shapes, dtypes) --(row blocks)--> weights.bin
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from looped_checkpoints import write_nanbeige, write_ouro
from speedc.format.artifact import GRAPH_FILES, read_manifest, read_weight
from speedc.build import build
from speedc.models.checkpoint.torch_io import open_checkpoint
from speedc.passes.base import BuildOptions

EXTERNAL_MIN_BYTES = 1024


@pytest.fixture(scope="module")
def nanbeige(tmp_path_factory) -> Path:
    return write_nanbeige(tmp_path_factory.mktemp("nanbeige") / "ckpt")  # bf16, two shards + index


def _inline_initializer_bytes(path: Path) -> int:
    """Bytes of initializers of EXTERNAL_MIN_BYTES or more stored inside the graph file itself."""
    model = onnx.load(str(path), load_external_data=False)
    return sum(len(t.raw_data) for t in model.graph.initializer
               if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= EXTERNAL_MIN_BYTES)


def test_graphs_reference_weights_bin_and_it_holds_the_checkpoint_bytes(nanbeige, tmp_path):
    progress = []
    art = build(nanbeige, tmp_path / "art", BuildOptions(), on_weight_bytes=lambda d, t: progress.append((d, t))).out
    manifest = read_manifest(art)
    assert manifest.dtype == "bf16"  # a bf16 checkpoint keeps its precision
    for name in manifest.graphs:
        assert _inline_initializer_bytes(art / GRAPH_FILES[name]) == 0, name
    _, sources = open_checkpoint(nanbeige)
    index = manifest.weights["index"]
    assert {n for n, e in index.items() if "parts" not in e and n.startswith(("model.", "lm_head."))} == set(sources)
    for name, source in sources.items():  # stacked q/k/v and gate/up parts included: byte ranges "within"
        stored, original = read_weight(art, manifest, name), source.read()
        if source.numel >= 1024:  # weights: the checkpoint's bytes
            assert stored.tobytes() == original.tobytes(), name
        else:  # norms are kept in fp32 (exactly the bf16 values)
            assert stored.dtype == np.float32 and np.array_equal(stored, original.astype(np.float32)), name
    done, total = progress[-1]
    assert done == total == manifest.weights["stored_bytes"]
    assert all(a[0] <= b[0] for a, b in zip(progress, progress[1:]))


def test_fp32_storage_converts_while_streaming(nanbeige, tmp_path):
    art = build(nanbeige, tmp_path / "art", BuildOptions(dtype="fp32")).out
    manifest = read_manifest(art)
    _, sources = open_checkpoint(nanbeige)
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight".replace("layers", "blocks")):
        stored = read_weight(art, manifest, name)
        assert stored.dtype == np.float32
        np.testing.assert_array_equal(stored, sources[name].read().astype(np.float32))


MEASURE = """
import json, resource, sys
from speedc.build import build
from speedc.passes.base import BuildOptions
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
build(sys.argv[1], sys.argv[3] + "/warm", BuildOptions())  # every import and code path, on a small vocabulary
baseline = max(rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
build(sys.argv[2], sys.argv[3] + "/art", BuildOptions())
print(json.dumps({"baseline_mb": baseline, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_build_memory_does_not_grow_with_the_checkpoint(tmp_path):
    """An Ouro-layout checkpoint whose embedding and LM head are 512 MB of bf16 (1 GB in fp32): the build
    holds a few row blocks at a time, never the weights (an in-memory build held several fp32 copies)."""
    from speedc.bench.random_checkpoint import write_random_checkpoint
    from speedc.bench.synthetic import Shape

    shape = Shape("ouro-wide-vocab", 512, 4, 4, 128, 1024, 2 ** 18, 1, 2, looped=True, sandwich_norms=True)
    checkpoint = write_random_checkpoint(shape, 1, tmp_path / "ckpt", max_positions=256)
    small = write_random_checkpoint(dataclasses.replace(shape, vocab=1024), 1, tmp_path / "small", max_positions=256)
    weight_mb = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")) / 2 ** 20
    assert weight_mb > 500
    try:
        result = subprocess.run([sys.executable, "-c", MEASURE, str(small), str(checkpoint), str(tmp_path)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        measured = json.loads(result.stdout.strip().splitlines()[-1])
        grown = measured["peak_mb"] - measured["baseline_mb"]
        assert grown < 0.2 * weight_mb, measured  # a few row blocks; the weights alone would be 512 (1024 as fp32)
        assert (tmp_path / "art" / "weights.bin").stat().st_size > 0.99 * weight_mb * 2 ** 20  # every weight written
    finally:  # 1 GB of checkpoint and artifact: the suite's largest files, not kept until pytest prunes them
        for large in ("ckpt", "art"):
            shutil.rmtree(tmp_path / large, ignore_errors=True)


def test_ouro_layout_written_by_the_streaming_writer_opens_as_ouro(tmp_path):
    """The bench's streaming writer produces the published layout: config, shards, index, gate tensors."""
    from speedc.bench.random_checkpoint import tensor_layout, write_random_checkpoint
    from speedc.bench.synthetic import SHAPES, Shape

    ouro = SHAPES["ouro-1.4b"]
    assert sum(int(np.prod(dims)) for _, dims in tensor_layout(ouro, ouro.layers)) == 1_434_652_673  # Ouro-1.4B
    tiny = Shape("ouro-tiny", 64, 4, 4, 16, 96, 128, 3, 4, looped=True, sandwich_norms=True)
    directory = write_random_checkpoint(tiny, 3, tmp_path / "ckpt", shard_bytes=40_000)
    assert (directory / "model.safetensors.index.json").exists() and len(list(directory.glob("*.safetensors"))) > 1
    cfg, sources = open_checkpoint(directory)
    assert cfg.architecture == "ouro" and cfg.num_hidden_layers == 12 and cfg.layer_map == [0, 1, 2] * 4
    assert not any("early_exit_gate" in name for name in sources)  # read and ignored
    reference = write_ouro(tmp_path / "ref", layers=3, hidden=64, heads=4, head_dim=16, intermediate=96, vocab=128)
    assert {n: s.shape for n, s in sources.items()} == {n: s.shape for n, s in open_checkpoint(reference)[1].items()}


def test_merged_equal_norms_are_listed_for_the_model(tmp_path):
    """Blocks whose norms happen to be equal (all ones here) share one stored tensor per role (input /
    post-attention norm) after the share pass; the weight index lists every model tensor still, so the model rebuilds from the artifact (the
    PyTorch backend, peers) with the checkpoint's values."""
    import torch

    from speedc.format.artifact import read_manifest
    from speedc.bench.synthetic import random_model_of, shape_config, zoo_shape
    from speedc.build import build
    from speedc.models.checkpoint.torch_io import save_checkpoint
    from speedc.runtimes.backends.torch_backend import load_model_from_artifact

    model = random_model_of(shape_config(zoo_shape(64, blocks=2, passes=2), 2))
    out = build(save_checkpoint(model, tmp_path / "ckpt"), tmp_path / "art", measure_step_cost=False).out
    manifest = read_manifest(out)
    index = manifest.weights["index"]
    norms = [name for name in index if name.endswith("layernorm.weight")]
    assert len(norms) == 4 and sum("within" in index[name] for name in norms) == 2  # one stored a role, one view each
    rebuilt = load_model_from_artifact(out, manifest).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(rebuilt[name], value, rtol=0, atol=0)
