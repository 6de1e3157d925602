"""Artifacts built with --weights int4 / int8: SPEED stays lossless to the artifact it runs (equal to
plain decoding of the same quantized artifact, greedy and seeded sampling, every ONNX Runtime path,
batched too), each weight is stored once as codes + scales, and quality is measured, not assumed.

Two builds: a random model with a perturbed exit head (forced mispredictions; hidden 64 and an MLP of
48, so one projection's K is padded to whole blocks; an untied LM head) at int4, and zoo:tiny (tied) at int8."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ZOO, build_artifact, onnx_graphs, onnx_nodes, random_config, randomize, run_cli
from speedc import Engine
from speedc.format.artifact import GRAPH_FILES, dequantized_weights, is_weight_name, stored_entries
from speedc.models.checkpoint.torch_io import open_checkpoint
from speedc.models.llama import SharedLlama
from speedc.runtimes.kernels import native, ort_op
from test_properties import _engines, _perturb_exit_head

# Each ONNX Runtime path twice: the products on speedc's kernel (the native twin graphs, where the kernel
# loads here) and on ONNX Runtime's MatMulNBits (the fallback, SPEEDC_NATIVE_KERNEL=0).
NATIVE = ort_op.custom_ops_library() is not None
PATHS = ("onnx-numpy", "onnx", "onnx-numpy/MatMulNBits", "onnx/MatMulNBits")
KERNEL_PATHS = native.load().paths if NATIVE else []


def _engines_on_both_kernels(art) -> dict[str, Engine]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPEEDC_NATIVE_KERNEL", "1")  # these models' products are small: asked for, not chosen
        engines = _engines(art)
        env.setenv("SPEEDC_NATIVE_KERNEL", "0")
        engines.update({f"{path}/MatMulNBits": engine for path, engine in _engines(art).items()})
    for path, engine in engines.items():
        expected = "speedc kernel" if NATIVE and "MatMulNBits" not in path else "MatMulNBits"
        assert engine.backend.session.speedc_products.startswith(expected), (path, engine.backend.session.speedc_products)
    return engines


@pytest.fixture(scope="module")
def quantized_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    model = _perturb_exit_head(randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64, tie=False)),
                                         seed=100), seed=0, strength=0.5)
    return {"random-int4": (model, build_artifact(model, root / "random-int4", dtype="int4")),
            "tiny-int8": (None, build_artifact(ZOO / "tiny", root / "tiny-int8", dtype="int8"))}


@pytest.fixture(scope="module")
def quantized(quantized_artifacts):
    return {which: (model, _engines_on_both_kernels(art)) for which, (model, art) in quantized_artifacts.items()}


sampling = st.one_of(st.just({}), st.fixed_dictionaries(
    {"temperature": st.floats(0.3, 1.5), "seed": st.integers(0, 2**31 - 1)}, optional={"top_k": st.integers(1, 50)}))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), which=st.sampled_from(["random-int4", "tiny-int8"]), path=st.sampled_from(PATHS),
       new_tokens=st.integers(1, 20), params=sampling, early_flush=st.booleans())
def test_speed_equals_plain_decoding_of_the_same_quantized_artifact(quantized, data, which, path, new_tokens, params,
                                                                   early_flush):
    _, engines = quantized[which]
    engine = engines[path]
    prompt = data.draw(st.lists(st.integers(0, engine.manifest.model["vocab_size"] - 1), min_size=1, max_size=10))
    speed = engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, early_flush=early_flush, **params)
    plain = engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, mode="autoregressive", **params)
    assert speed.ids == plain.ids and len(speed.ids) == new_tokens


def test_both_outcomes_happen_and_logits_are_bitwise_plain_logits(quantized, sampled_logits):
    """Speculations are both accepted and refused (the property above is not vacuous), and every logits
    row SPEED samples from is bitwise plain decoding's row for that position (int4's zero row at work)."""
    seen, decoding_as = sampled_logits
    accepted = mispredicted = 0
    for which in quantized:
        for path in PATHS:
            engine = quantized[which][1][path]
            for mode in ("speed", "autoregressive"):
                decoding_as(mode)
                result = engine.generate([5, 9, 2], max_new_tokens=30, stop_at_eos=False, temperature=0.8, seed=3,
                                         mode="speed-always" if mode == "speed" else mode)
                if mode == "speed":
                    accepted, mispredicted = accepted + result.stats.accepted, mispredicted + result.stats.mispredicted
            assert seen["speed"].keys() == seen["autoregressive"].keys() and len(seen["speed"]) == 30
            for position, row in seen["speed"].items():
                assert np.array_equal(row, seen["autoregressive"][position]), (which, path, position)
            seen.clear()
    assert accepted > 10 and mispredicted > 10


@pytest.mark.skipif(not NATIVE, reason="the native kernel or onnxruntime-extensions is not available here")
@pytest.mark.parametrize("kernel_path", KERNEL_PATHS)
def test_every_kernel_path_keeps_speed_equal_to_plain_decoding(quantized_artifacts, kernel_path):
    """Each path of speedc's kernel this CPU runs (SPEEDC_NATIVE_KERNEL names it; avx-vnni-standin and
    amx-standin run those paths' logic on AVX2): SPEED == plain decoding of the same artifact, greedy and seeded,
    through accepted and refused speculations."""
    accepted = mispredicted = 0
    for which, (_, art) in quantized_artifacts.items():
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SPEEDC_NATIVE_KERNEL", kernel_path)
            engine = Engine.load(art)
        assert engine.backend.session.speedc_products.startswith(f"speedc kernel ({kernel_path}, "), which
        for params in ({}, {"temperature": 0.8, "seed": 3}):
            for prompt in ([5, 9, 2], [1, 40, 7, 7, 3, 12]):
                speed = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False, mode="speed-always", **params)
                plain = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False, mode="autoregressive", **params)
                assert speed.ids == plain.ids, (which, params, prompt)
                accepted, mispredicted = accepted + speed.stats.accepted, mispredicted + speed.stats.mispredicted
    assert accepted > 10 and mispredicted > 10


def test_a_kernel_path_this_cpu_lacks_falls_back_in_one_line(quantized_artifacts):
    """SPEEDC_NATIVE_KERNEL naming a path this CPU does not run, or no path at all: MatMulNBits, and why."""
    art = quantized_artifacts["random-int4"][1]
    missing = next(p for p in ("dotprod", "avx2") if p not in KERNEL_PATHS)
    for setting, why in ((missing, f"this CPU has no {missing} path"), ("avx3", "SPEEDC_NATIVE_KERNEL=avx3 is not 0, 1 or")):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SPEEDC_NATIVE_KERNEL", setting)
            engine = Engine.load(art)
        products = engine.backend.session.speedc_products
        assert products.startswith("MatMulNBits") and (why in products or not NATIVE), products


def test_batched_sequences_equal_plain_decoding_alone(quantized):
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import RowPolicy
    from speedc.runtimes.backends.onnx import BatchBackend

    for which, fused, kernel in (("random-int4", True, ""), ("tiny-int8", False, ""), ("random-int4", False, "/MatMulNBits")):
        engines = quantized[which][1]
        engine = engines["onnx"]
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SPEEDC_NATIVE_KERNEL", "0" if kernel else "1")
            backend = BatchBackend(engine.directory, engine.manifest, max_batch=3, capacity=40, fused=fused)
        scheduler = BatchScheduler(backend, policy=RowPolicy(row_budget=None), prefill_chunk=4)
        prompts = [[1, 2, 3], [7], [4, 4, 9, 11, 2], [30, 1]]
        sequences = [scheduler.submit(engine.request_from(p, dict(max_new_tokens=12, stop_at_eos=False, temperature=0.7,
                                                                  seed=i)), early_flush=bool(i % 2))
                     for i, p in enumerate(prompts)]
        while scheduler.busy:
            scheduler.step()
        alone = engines[("onnx" if fused else "onnx-numpy") + kernel]
        for i, (prompt, sequence) in enumerate(zip(prompts, sequences)):
            plain = alone.generate(prompt, max_new_tokens=12, stop_at_eos=False, mode="autoregressive", temperature=0.7, seed=i)
            assert sequence.out == plain.ids, (which, i)


def test_each_weight_is_stored_once_as_codes_and_scales(quantized):
    engine = quantized["tiny-int8"][1]["onnx"]
    directory, m = engine.directory, engine.manifest
    index = m.weights["index"]
    assert m.dtype == "int8" and m.weights["quantization"]["bits"] == 8 and m.weights["quantization"]["block_size"] == 32
    stored = stored_entries(index)
    assert m.weights["stored_bytes"] == sum(e["length"] for e in stored.values())
    assert 0 <= (directory / "weights.bin").stat().st_size - m.weights["stored_bytes"] < 64 * len(stored)  # alignment only
    _, checkpoint = open_checkpoint(ZOO / "tiny")
    matrices = {name for name, source in checkpoint.items() if len(source.shape) == 2}
    covered = []  # checkpoint matrices stored as codes: each exactly once
    for name, entry in stored.items():
        assert not is_weight_name(name) or len(entry["shape"]) == 1 or "quantized" in entry, name  # no float matrix left
        info = entry.get("quantized")
        if info and info["role"] == "codes":
            covered += [p[:-len(".q8")] for p in entry.get("parts", [name])]
            assert entry["length"] == math.prod(info["shape"][:1]) * math.ceil(info["shape"][1] / 32) * 32
            assert stored[name + "_scales"]["length"] == info["shape"][0] * math.ceil(info["shape"][1] / 32) * 4
    assert sorted(covered) == sorted(matrices)  # the tied embedding / LM head once
    views = {n: e for n, e in index.items() if n.endswith(".rows")}
    assert views and all(e["within"] in stored and e["offset"] == index[e["within"]]["offset"] for e in views.values())
    ops, referenced = set(), set()
    for graph_name, spec in m.graphs.items():
        model = onnx.load(str(directory / GRAPH_FILES[graph_name]), load_external_data=False)
        ops |= {node.op_type for node in onnx_nodes(model.graph)}
        referenced |= {t.name for part in onnx_graphs(model.graph) for t in part.initializer
                       if t.data_location == onnx.TensorProto.EXTERNAL}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops and "Gemm" not in ops and referenced <= set(index)
    unique = sum(checkpoint[n].numel for n in matrices)
    expected = unique * (1 + 4 / 32) + sum(e["length"] for e in stored.values() if "quantized" not in e) + 64 * len(stored)
    assert m.weights["stored_bytes"] <= expected and m.weights["unique_bytes_fp32"] >= unique * 4


def test_dequantized_weights_are_the_checkpoint_within_one_step(quantized):
    model, engines = quantized["random-int4"]
    engine = engines["onnx"]
    weights = dequantized_weights(engine.directory, engine.manifest)
    params = dict(model.named_parameters())
    assert set(weights) == {n for n, p in params.items() if p.dim() == 2}
    for name, values in weights.items():
        original = params[name].detach().numpy()
        k = original.shape[1]
        blocks = np.zeros((original.shape[0], -(-k // 32) * 32)); blocks[:, :k] = np.abs(original)
        step = np.repeat(blocks.reshape(original.shape[0], -1, 32).max(-1) / 8, 32, axis=1)[:, :k]  # int4: |max| / 8
        assert np.all(np.abs(values - original) <= step * 1.0001), name


def test_inspect_and_quality_report_the_precision(quantized, tiny_artifact):
    from speedc.inspect import describe
    from speedc.quality import compare

    int8 = quantized["tiny-int8"][1]["onnx"].directory
    info = describe(int8)
    assert info["dtype"] == "int8" and info["quantization"]["block_size"] == 32
    assert info["sizes"]["weights stored (int8, block 32: codes + scales)"] < info["sizes"]["unique weights (fp32)"] / 3
    assert info["kernel_here"] == ({"path": native.load().path, "paths": [p for p in KERNEL_PATHS if p not in native.STAND_INS]}
                                   if native.load() else {"path": None, "why": native.unavailable_reason()})
    shown = run_cli("inspect", int8)
    assert shown.returncode == 0 and (f"on this CPU: the kernel's {native.load().path} path" in shown.stdout or not native.load())
    rows = compare(tiny_artifact, [int8], prompts=["ROMEO:", "JULIET:"], new_tokens=16, val_tokens=64, threads=1)
    reference, q = rows
    assert (reference.top1_agreement, reference.greedy_agreement, reference.identical_continuations) == (1.0, 1.0, 2)
    assert 0.5 < q.top1_agreement <= 1 and 0 < q.greedy_agreement <= 1 and abs(q.val_loss - reference.val_loss) < 0.1
    assert q.stored_bytes < reference.stored_bytes / 3 and q.dtype == "int8"


def test_what_quantized_weights_cannot_do_is_refused_in_one_line(quantized, tmp_path):
    """Library errors (SpeedcError: one line from the CLI) before any work; the CLI's own option check."""
    from click.testing import CliRunner

    from speedc.build import build
    from speedc.cli import main
    from speedc.errors import BuildError, SpeedcError
    from speedc.passes.base import BuildOptions

    with pytest.raises(BuildError, match="TensorRT cannot run ONNX Runtime's MatMulNBits"):
        build(ZOO / "tiny", tmp_path / "x", BuildOptions(dtype="int4", target="trt"))
    with pytest.raises(BuildError, match="--block-size 24: MatMulNBits takes 16, 32"):
        build(ZOO / "tiny", tmp_path / "x", BuildOptions(dtype="int8", block_size=24))
    # zoo:tiny's rows are 128 long: block 256 padded each (1.00 MB stored against 0.59 MB at 32), silently
    with pytest.raises(BuildError, match="--block-size 256 is longer than the rows of .* \\(128 values\\).*--block-size 128 or less"):
        build(ZOO / "tiny", tmp_path / "x", BuildOptions(dtype="int8", block_size=256))
    with pytest.raises(SpeedcError, match="the PyTorch backend runs float artifacts; this one stores int4"):
        Engine.load(quantized["random-int4"][1]["onnx"].directory, backend="torch")
    result = CliRunner().invoke(main, ["build", "zoo:tiny", "-o", str(tmp_path / "x"), "--block-size", "64"])
    assert result.exit_code == 1 and result.output.strip() == "error: --block-size goes with --weights int8 or int4"
    assert not (tmp_path / "x").exists()
