"""Pass native_products: an int8/int4 artifact's engine graphs each get a native twin whose weight
products run speedc's kernel (ai.onnx.contrib SpeedcBlockProduct) instead of MatMulNBits, without the
zero rows; a bf16 / fp16 artifact's twin runs SpeedcHalfProduct on the 16-bit weights instead of Gemm
over their fp32 Casts. The twin takes and returns what its graph does, stores no product weight, and
runs; the runtime uses it where the kernel loads and says in one line when it falls back."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from conftest import ZOO, build_artifact, onnx_graphs, onnx_nodes, run_engine_program
from speedc import Engine
from speedc.format import contract
from speedc.format.artifact import GRAPH_FILES, native_file, read_manifest
from speedc.runtimes.backends.onnx import BatchBackend
from speedc.runtimes.backends.onnx_session import open_session
from speedc.runtimes.kernels import ort_op

NATIVE = ort_op.custom_ops_library() is not None


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    return build_artifact(ZOO / "tiny", tmp_path_factory.mktemp("native") / "tiny-int4", dtype="int4")


def _ops(path) -> collections.Counter:
    model = onnx.load(str(path), load_external_data=False)
    return collections.Counter(node.op_type for node in onnx_nodes(model.graph))


def _zero_row_concats(path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    zero_rows = {t.name for part in onnx_graphs(model.graph) for t in part.initializer if "zero_row" in t.name}
    zero_rows |= {node.output[0] for node in onnx_nodes(model.graph) if node.op_type == "Constant" and "zero_row" in node.output[0]}
    return sum(1 for node in onnx_nodes(model.graph) if node.op_type == "Concat" and set(node.input) & zero_rows)


def test_before_and_after(tiny_int4):
    """Before (the engine graph): MatMulNBits, the int4 ones padded with a zero row. After (its twin):
    as many SpeedcBlockProducts naming their codes and scales, no MatMulNBits, no zero row, the same I/O,
    and none of the products' weights among its initializers."""
    manifest = read_manifest(tiny_int4)
    artifact_id = manifest.weights["native_artifact"]
    assert len(artifact_id) == 32
    for name, spec in manifest.graphs.items():
        graph_file, twin_file = tiny_int4 / GRAPH_FILES[name], tiny_int4 / spec["native_file"]
        assert spec["native_file"] == native_file(name) == GRAPH_FILES[name].replace(".onnx", ".native.onnx")
        before, after = _ops(graph_file), _ops(twin_file)
        assert before["MatMulNBits"] > 0 and before[contract.NATIVE_PRODUCT] == 0
        assert after["MatMulNBits"] == 0 and after[contract.NATIVE_PRODUCT] == before["MatMulNBits"]
        assert after["GatherBlockQuantized"] == before["GatherBlockQuantized"] > 0
        assert _zero_row_concats(graph_file) > 0 and _zero_row_concats(twin_file) == 0
        graph, twin = (onnx.load(str(f), load_external_data=False).graph for f in (graph_file, twin_file))
        # the fused graph's twin attends over the runtime's own pool (passes/native_attention.py): less its caches
        kept = (lambda v: not contract.is_cache_input(v.name)) if contract.NATIVE_CACHE in spec else (lambda v: True)
        assert [(v.name, v.type) for v in graph.input if kept(v)] == [(v.name, v.type) for v in twin.input]
        assert [(v.name, v.type) for v in graph.output if kept(v)] == [(v.name, v.type) for v in twin.output]
        products = [n for n in onnx_nodes(twin) if n.op_type == contract.NATIVE_PRODUCT]
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in products]
        assert {a["artifact"].decode() for a in attrs} == {artifact_id}
        assert {a["bits"] for a in attrs} == {4} and {a["block_size"] for a in attrs} == {32}
        named = {a["codes"].decode() for a in attrs} | {a["scales"].decode() for a in attrs}
        index = manifest.weights["index"]
        assert named <= set(index) and all(".q4" in n for n in named)
        for a in attrs:  # each names a weight of the shape it computes
            codes = index[a["codes"].decode()]
            assert codes["quantized"]["shape"] == [a["n"], a["k"]] and codes["quantized"]["role"] == "codes"
        initializers = {t.name for part in onnx_graphs(twin) for t in part.initializer}
        lookups = {i for n in onnx_nodes(twin) if n.op_type == "GatherBlockQuantized" for i in n.input}
        assert initializers & named <= lookups  # ONNX Runtime loads no product's weights (a tied table: its lookup's)


@pytest.mark.skipif(not NATIVE, reason="the native kernel or onnxruntime-extensions is not available here")
def test_the_twin_computes_what_the_graph_does(tiny_int4):
    """One prefill through each: the same logits within int8 rounding (two kernels: not bitwise), the
    same next tokens here."""
    manifest = read_manifest(tiny_int4)
    outputs = {}
    for setting in ("1", "0"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SPEEDC_NATIVE_KERNEL", setting)
            session = open_session(tiny_int4, manifest, "engine", ["CPUExecutionProvider"], 1)
        assert session.speedc_products.startswith("speedc kernel" if setting == "1" else "MatMulNBits")
        ids = np.array([[5, 17, 3, 99, 42, 7]], np.int64)
        cache = {f"cache.{kind}.{i}": np.zeros((1, manifest.model["num_kv_heads"], 0, manifest.model["head_dim"]), np.float32)
                 for kind in ("key", "value") for i in range(manifest.model["num_layers"])}
        outputs[setting] = run_engine_program(session, contract.PREFILL, {
            "input_ids": ids, "positions": np.zeros(1, np.int64), "chunk_lengths": np.array([6], np.int64), **cache})
    native, matmulnbits = outputs["1"], outputs["0"]
    scale = np.abs(matmulnbits["logits"]).max()
    assert np.abs(native["logits"] - matmulnbits["logits"]).max() < 0.02 * scale
    assert np.array_equal(native["next_token"], matmulnbits["next_token"])


@pytest.mark.skipif(not NATIVE, reason="the native kernel or onnxruntime-extensions is not available here")
def test_an_operator_error_is_an_exception_not_an_abort(tiny_int4):
    """A product that cannot find its weights fails the run with a Python exception (an exception
    leaving a Python operator would make ONNX Runtime abort the process)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPEEDC_NATIVE_KERNEL", "1")
        engine = Engine.load(tiny_int4)
    session = engine.backend.session
    assert session.speedc_products.startswith("speedc kernel")
    session.speedc_weight_map.products.clear()
    session.speedc_weight_map.index = {}
    with pytest.raises(RuntimeError, match="a native operator failed: .*has no .*q4"):
        engine.generate([1, 2, 3], max_new_tokens=2)


def test_without_the_kernel_the_runtime_falls_back_and_says_so_once(tiny_int4, tmp_path):
    """Asked for the kernel (SPEEDC_NATIVE_KERNEL=1) without a C compiler (and no cached build): `speedc
    generate` runs MatMulNBits, the same ids as SPEEDC_NATIVE_KERNEL=0, and says why in one line on
    standard error."""
    speedc = [sys.executable, "-m", "speedc.cli", "generate", str(tiny_int4), "--prompt", "ROMEO:", "--max-new-tokens", "12",
              "--json"]
    no_compiler = {**os.environ, "CC": "", "PATH": str(tmp_path), "SPEEDC_KERNEL_CACHE": str(tmp_path / "cache"),
                   "SPEEDC_NATIVE_KERNEL": "1"}
    fallback = subprocess.run(speedc, env=no_compiler, capture_output=True, text=True, timeout=300)
    chosen = subprocess.run(speedc, env={**os.environ, "SPEEDC_NATIVE_KERNEL": "0"}, capture_output=True, text=True,
                            timeout=300)
    assert fallback.returncode == 0 and chosen.returncode == 0, fallback.stderr + chosen.stderr
    said = [line for line in fallback.stderr.splitlines() if line.strip()]
    assert said == ["speedc: the native product kernel is unavailable (no C compiler found (cc, gcc or clang; or set CC)); "
                    "products run on MatMulNBits"]
    assert chosen.stderr.strip() == ""  # asked for: nothing to say
    import json

    assert json.loads(fallback.stdout)["ids"] == json.loads(chosen.stdout)["ids"]


def test_fp32_artifacts_have_no_twin(tiny_artifact):
    manifest = read_manifest(tiny_artifact)
    assert manifest.dtype == "fp32"
    assert "native_artifact" not in manifest.weights
    assert all("native_file" not in spec for spec in manifest.graphs.values())
    assert not list(tiny_artifact.glob("*.native.onnx"))


def test_small_products_choose_matmulnbits_unless_asked(tiny_int4):
    """Unset, SPEEDC_NATIVE_KERNEL lets the artifact's product size decide: zoo:tiny's are far below
    NATIVE_MIN_MEAN_PRODUCT_BYTES (the operator's per-call cost would dominate), so MatMulNBits runs,
    and says why; 1 asks for the kernel anyway."""
    from speedc.runtimes.backends.onnx_session import NATIVE_MIN_MEAN_PRODUCT_BYTES, mean_product_bytes

    manifest = read_manifest(tiny_int4)
    assert 0 < mean_product_bytes(manifest) < NATIVE_MIN_MEAN_PRODUCT_BYTES
    with pytest.MonkeyPatch.context() as env:
        env.delenv("SPEEDC_NATIVE_KERNEL", raising=False)
        chosen = open_session(tiny_int4, manifest, "engine", ["CPUExecutionProvider"], 1)
        env.setenv("SPEEDC_NATIVE_KERNEL", "1")
        asked = open_session(tiny_int4, manifest, "engine", ["CPUExecutionProvider"], 1)
    assert chosen.speedc_products.startswith("MatMulNBits (products of 0.") and "per-call cost" in chosen.speedc_products
    assert asked.speedc_products.startswith("speedc kernel" if NATIVE else "MatMulNBits")


@pytest.fixture(scope="module")
def random_16bit(tmp_path_factory):
    """A random model (drafts often wrong) built at bf16 and at fp16."""
    from conftest import random_config, randomize
    from speedc.models.llama import SharedLlama

    model = randomize(SharedLlama(random_config(hidden=64, heads=4, kv_heads=2, blocks=2, layers=8)), seed=5, scale=0.4)
    root = tmp_path_factory.mktemp("native16")
    return {dtype: build_artifact(model, root / dtype, dtype=dtype) for dtype in ("bf16", "fp16")}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_before_and_after(random_16bit, dtype):
    """Before: Gemm(x, Cast(W)^T) over each 16-bit weight. After: as many SpeedcHalfProducts naming their
    weight, its shape and dtype; no Gemm and no Cast of a product weight left, so ONNX Runtime loads no
    product's weight (the embedding: for its lookup alone, at 16 bits)."""
    art = random_16bit[dtype]
    manifest = read_manifest(art)
    index = manifest.weights["index"]
    for name, spec in manifest.graphs.items():
        graph, twin = (onnx.load(str(art / f), load_external_data=False).graph for f in (GRAPH_FILES[name], spec["native_file"]))
        cast_of = {n.output[0]: n.input[0] for n in onnx_nodes(graph) if n.op_type == "Cast"}
        products = [n for n in onnx_nodes(graph) if n.op_type == "Gemm" and n.input[1] in cast_of]
        assert products and all(n.op_type != "MatMulNBits" for n in onnx_nodes(graph))
        halves = [n for n in onnx_nodes(twin) if n.op_type == contract.NATIVE_HALF_PRODUCT]
        attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in halves]
        assert len(halves) == len(products) and not [n for n in onnx_nodes(twin) if n.op_type == "Gemm"]
        assert sorted(a["weight"].decode() for a in attrs) == sorted(cast_of[n.input[1]] for n in products)
        for a in attrs:
            entry = index[a["weight"].decode()]
            assert entry["shape"] == [a["n"], a["k"]] and a["dtype"].decode() == dtype
            assert entry["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[dtype]
        named = {a["weight"].decode() for a in attrs}
        initializers = {t.name for part in onnx_graphs(twin) for t in part.initializer}
        lookups = {n.input[0] for n in onnx_nodes(twin) if n.op_type == "Gather"}
        assert initializers & named <= lookups
        assert not {n.input[0] for n in onnx_nodes(twin) if n.op_type == "Cast"} & (named - lookups)


@pytest.mark.skipif(not NATIVE, reason="the native kernel or onnxruntime-extensions is not available here")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_twin_keeps_speed_equal_to_plain_decoding(random_16bit, dtype):
    """On the twin, SPEED == plain decoding (greedy and seeded) through accepted and refused drafts; its
    logits match the engine graph's fp32 products to float32 rounding (a different summation order)."""
    art = random_16bit[dtype]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPEEDC_NATIVE_KERNEL", "1")
        native = Engine.load(art)
        env.setenv("SPEEDC_NATIVE_KERNEL", "0")
        onnx_fp32 = Engine.load(art)
    assert native.backend.session.speedc_products.startswith("speedc kernel")
    assert onnx_fp32.backend.session.speedc_products == "ONNX Runtime (fp32 copies of the 16-bit weights) (SPEEDC_NATIVE_KERNEL=0)"
    accepted = mispredicted = 0
    for params in ({}, {"temperature": 0.9, "seed": 4}):
        for prompt in ([5, 9, 2], [1, 40, 7, 7, 3, 12, 30]):
            speed = native.generate(prompt, max_new_tokens=24, stop_at_eos=False, mode="speed-always", **params)
            plain = native.generate(prompt, max_new_tokens=24, stop_at_eos=False, mode="autoregressive", **params)
            assert speed.ids == plain.ids, (params, prompt)
            accepted, mispredicted = accepted + speed.stats.accepted, mispredicted + speed.stats.mispredicted
    assert accepted > 5 and mispredicted > 5
    assert native.backend.cache_dtype == np.float16 and onnx_fp32.backend.cache_dtype == np.float32
    logits = {}
    for name, engine, cache in (("native", native, None), ("native fp32 cache", native, "float32"), ("fp32", onnx_fp32, None)):
        backend = BatchBackend(art, engine.manifest, 1, 64, session=engine.backend.session, kv_cache=cache)
        backend.reserve(6, 1)
        logits[name] = backend.prefill(0, [[5, 17, 3, 9, 42, 7]], 0, True)[1]
    scale = np.abs(logits["fp32"]).max()
    # over the same fp32 cache the twin's products and attention are GroupQueryAttention's to float32 rounding;
    # its default float16 pool rounds keys and values to 11 bits (on these random weights 0.3% of the scale)
    assert np.abs(logits["native fp32 cache"] - logits["fp32"]).max() < 1e-4 * scale
    assert np.abs(logits["native"] - logits["fp32"]).max() < 1e-2 * scale
