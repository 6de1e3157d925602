"""Pass native_attention: the fused engine graph's native twin runs each layer's attention on speedc's kernel
(SpeedcAttention) over a float16 KV pool the runtime holds, instead of GroupQueryAttention over fp32 cache
buffers bound into ONNX Runtime. Before and after on the graphs; then, on the looped families' published
layouts (Ouro's sandwich blocks, Nanbeige's loops) built at their bf16, SPEED == plain decoding on that pool
(greedy and seeded, alone and batched, through accepted and refused drafts) and on an int8 pool, and the
ids against the published code run by transformers; SPEEDC_KV_CACHE is refused in one line where wrong."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest

from conftest import ZOO, build_artifact, onnx_nodes
from looped_checkpoints import assert_batch_lossless, perturb, seeded_prompt, write_nanbeige, write_ouro
from speedc import Engine
from speedc.format import contract
from speedc.format.artifact import GRAPH_FILES, read_manifest
from speedc.runtimes.kernels import ort_op

NATIVE = ort_op.custom_ops_library() is not None
needs_kernel = pytest.mark.skipif(not NATIVE, reason="the native kernel or onnxruntime-extensions is not available here")


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    return build_artifact(ZOO / "tiny", tmp_path_factory.mktemp("attention") / "tiny-int4", dtype="int4")


def _model(path):
    return onnx.load(str(path), load_external_data=False).graph


def test_before_and_after(tiny_int4):
    """Before (the fused graph): a GroupQueryAttention per layer of each program, reading and writing the
    cache inputs in place. After (its twin): as many SpeedcAttentions naming those caches, none of their
    inputs or outputs left, the step's scatter into pool rows gone; the manifest records the float16 pool.
    The standard graph's twin keeps its caches (its attention is ONNX Runtime's)."""
    manifest = read_manifest(tiny_int4)
    fused = contract.fused(contract.ENGINE)
    spec = manifest.graphs[fused]
    assert spec[contract.NATIVE_CACHE] == "float16" and contract.NATIVE_CACHE not in manifest.graphs[contract.ENGINE]
    before, after = _model(tiny_int4 / GRAPH_FILES[fused]), _model(tiny_int4 / spec["native_file"])
    gqa = [n for n in onnx_nodes(before) if n.op_type == "GroupQueryAttention"]
    native = [n for n in onnx_nodes(after) if n.op_type == contract.NATIVE_ATTENTION]
    layers, stage_layers = manifest.model["num_layers"], manifest.stage_layers
    assert len(gqa) == len(native) == layers + stage_layers  # the prefill's logical layers, the step's stage layers
    ops = collections.Counter(n.op_type for n in onnx_nodes(after))
    assert ops["GroupQueryAttention"] == ops["ScatterND"] == 0
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in native]
    caches = {(n.input[3], n.input[4]) for n in gqa}
    assert {(a["key"].decode(), a["value"].decode()) for a in attrs} == caches
    assert sorted(a["slots"] for a in attrs) == [1] * layers + [manifest.slots] * stage_layers
    assert {a["artifact"].decode() for a in attrs} == {manifest.weights["native_artifact"]}
    assert {(a["heads"], a["kv_heads"], a["head_dim"]) for a in attrs} == {
        (manifest.model["hidden_size"] // manifest.model["head_dim"], manifest.model["num_kv_heads"], manifest.model["head_dim"])}
    names = {v.name for v in [*after.input, *after.output]}
    assert not {name for name in names if contract.is_cache_input(name)}
    assert {v.name for v in before.input if not contract.is_cache_input(v.name)} == {v.name for v in after.input}
    standard = _model(tiny_int4 / manifest.graphs[contract.ENGINE]["native_file"])
    assert any(contract.is_cache_input(v.name) for v in standard.input)
    from speedc.inspect import describe

    assert describe(tiny_int4)["graphs"][fused]["native_cache"] == "float16"


@needs_kernel
def test_onnx_runtime_keeps_one_thread_where_the_kernel_attends(tiny_int4):
    """Where the twin's products and attention both run on the kernel's threads, ONNX Runtime runs the rest
    on the calling thread; where it still attends itself (the standard graph's twin), it keeps the threads
    asked for."""
    from speedc.runtimes.backends.onnx_session import open_session

    manifest = read_manifest(tiny_int4)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPEEDC_NATIVE_KERNEL", "1")
        fused = open_session(tiny_int4, manifest, contract.fused(contract.ENGINE), ["CPUExecutionProvider"], 2)
        standard = open_session(tiny_int4, manifest, contract.ENGINE, ["CPUExecutionProvider"], 2)
    assert fused.speedc_native_cache == "float16" and standard.speedc_native_cache is None
    assert fused.speedc_products.startswith("speedc kernel") and standard.speedc_products.startswith("speedc kernel")
    assert fused.get_session_options().intra_op_num_threads == 1
    assert standard.get_session_options().intra_op_num_threads == 2


@needs_kernel
def test_an_unbound_cache_is_an_exception_not_an_abort(tiny_int4):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPEEDC_NATIVE_KERNEL", "1")
        engine = Engine.load(tiny_int4)
    assert engine.backend.cache_dtype == np.float16
    with pytest.MonkeyPatch.context() as patch:  # a run that binds no pool
        patch.setattr(ort_op.WeightMap, "caches_bound", lambda self, caches: ort_op._CachesBound(self.artifact_id, {}))
        with pytest.raises(RuntimeError, match="no KV cache is bound under cache.key"):
            engine.generate([1, 2, 3], max_new_tokens=2)
    assert engine.generate([1, 2, 3], max_new_tokens=2).ids


CACHES = ("float16", "int8")
FAMILIES = {  # name: (writer, options, perturbed): the published layouts at their bf16
    "ouro": (write_ouro, dict(layers=2, loops=4, seed=1, residual_scale=0.05, head_dim=32), False),
    "ouro-perturbed": (write_ouro, dict(layers=1, loops=3, seed=1, residual_scale=0.05, head_dim=32), True),
    "nanbeige": (write_nanbeige, dict(layers=2, loops=2, seed=2, residual_scale=0.05, head_dim=32), False),
}


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("attention-families"), {}
    for name, (write, options, perturbed) in FAMILIES.items():
        checkpoint = write(root / name, **options)
        if perturbed:
            perturb(checkpoint, factor=20.0)
        art = build_artifact(checkpoint, root / f"{name}-art")
        for cache in CACHES:
            with pytest.MonkeyPatch.context() as env:
                env.setenv("SPEEDC_NATIVE_KERNEL", "1")
                env.setenv("SPEEDC_KV_CACHE", cache)
                engine = Engine.load(art)
                assert engine.backend.kv_cache == cache  # (opened here, under these settings)
            built[name, cache] = (checkpoint, engine)
    return built


@needs_kernel
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_speed_equals_plain_decoding_on_the_kernels_pool(family_engines, family, cache):
    """SPEED == plain decoding on the float16 pool and on the int8 one (SPEEDC_KV_CACHE=int8)."""
    checkpoint, engine = family_engines[family, cache]
    assert engine.backend.cache_dtype == {"float16": np.float16, "int8": np.uint8}[cache]
    assert engine.backend.products.startswith("speedc kernel")
    vocab = engine.manifest.dims.vocab_size
    prompts = [seeded_prompt(seed, 6, vocab) for seed in (0, 1, 2)]
    expected = [engine.generate(p, max_new_tokens=20, stop_at_eos=False, mode="autoregressive").ids for p in prompts]
    for mode in ("speed-always", "speed"):
        assert [engine.generate(p, max_new_tokens=20, stop_at_eos=False, mode=mode).ids for p in prompts] == expected
    for seed in (11, 12):
        runs = [engine.generate(prompts[0], max_new_tokens=20, stop_at_eos=False, mode=mode, temperature=0.9, seed=seed).ids
                for mode in ("speed-always", "autoregressive")]
        assert runs[0] == runs[1]
    accepted, mispredicted = assert_batch_lossless(engine, prompts, expected, 20)
    if FAMILIES[family][2]:
        assert mispredicted > 5, "the perturbed weights must refuse drafts"
    else:
        assert accepted > 5, "the scaled weights must accept drafts"


@needs_kernel
def test_ids_follow_the_published_code(family_engines):
    """The float16 pool against transformers running the published Ouro loop at fp32: the greedy ids agree
    (these weights' top logits lie far enough apart for 11-bit keys and values)."""
    from test_looped_checkpoints import OuroOracle, oracle_greedy

    checkpoint, engine = family_engines["ouro", "float16"]
    oracle = OuroOracle(checkpoint)
    for seed in (0, 1):
        prompt = seeded_prompt(seed, 6, engine.manifest.dims.vocab_size)
        assert engine.generate(prompt, max_new_tokens=16, stop_at_eos=False, mode="speed-always").ids == oracle_greedy(oracle, prompt, 16)


@needs_kernel
def test_the_pool_type_is_chosen_and_refused_in_one_line(tiny_int4, tiny_artifact, monkeypatch):
    from speedc.errors import GenerationError
    from speedc.runtimes.backends.onnx import BatchBackend

    monkeypatch.setenv("SPEEDC_NATIVE_KERNEL", "1")
    engine = Engine.load(tiny_int4)
    manifest = engine.manifest
    for cache, dtype, width in (("float32", np.float32, 32), ("float16", np.float16, 32), ("int8", np.uint8, 36)):
        backend = BatchBackend(tiny_int4, manifest, 1, 64, session=engine.backend.session, kv_cache=cache)
        backend.reserve(8, 1)
        assert backend.cache_dtype == dtype and backend.pool.key.shape[-1] == width == backend.cache_width
    monkeypatch.setenv("SPEEDC_KV_CACHE", "int4")
    with pytest.raises(GenerationError, match="SPEEDC_KV_CACHE 'int4': choose from float32, float16, int8"):
        BatchBackend(tiny_int4, manifest, 1, 64, session=engine.backend.session)
    monkeypatch.setenv("SPEEDC_KV_CACHE", "int8")  # a session without the kernel's attention keeps float32
    plain = Engine.load(tiny_artifact)
    assert plain.backend.kv_cache == "float32"
    with pytest.raises(GenerationError, match="int8 KV values need speedc's attention"):
        BatchBackend(tiny_artifact, plain.manifest, 1, 64, session=plain.backend.session, kv_cache="int8")


@needs_kernel
def test_the_pool_type_is_an_option_of_the_engine_and_the_cli(tiny_int4, tiny_artifact, monkeypatch):
    """Engine.load(kv_cache=...) and `--kv-cache`: the engine's pool and a batch scheduler's (on its session or
    on one of its own) hold that type, the CLI's ids are the engine's, SPEED == plain decoding on it; where
    the session does not attend on the kernel, one line and a non-zero exit."""
    from conftest import assert_one_line_error, run_cli

    monkeypatch.setenv("SPEEDC_NATIVE_KERNEL", "1")
    monkeypatch.delenv("SPEEDC_KV_CACHE", raising=False)
    engine = Engine.load(tiny_int4, kv_cache="int8")
    assert engine.backend.kv_cache == "int8" and engine.backend.cache_dtype == np.uint8
    assert engine.batch_scheduler(max_batch=2).backend.kv_cache == "int8"
    assert engine.batch_scheduler(max_batch=2, threads=1).backend.kv_cache == "int8"
    prompt = [5, 17, 3, 99, 42, 7]
    plain = engine.generate(prompt, max_new_tokens=12, stop_at_eos=False, mode="autoregressive").ids
    assert engine.generate(prompt, max_new_tokens=12, stop_at_eos=False, mode="speed-always").ids == plain
    assert [r.ids for r in engine.generate_batch([prompt, prompt[:3]], max_new_tokens=12, stop_at_eos=False,
                                                 per_sequence=False, max_batch=2)][0] == plain
    env = {"SPEEDC_NATIVE_KERNEL": "1"}
    done = run_cli("generate", tiny_int4, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12",
                   "--ignore-eos", "--kv-cache", "int8", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ids"] == plain
    assert_one_line_error(run_cli("generate", tiny_artifact, "--prompt-ids", "1,2", "--kv-cache", "int8", env=env),
                          "int8 KV values need speedc's attention")


@needs_kernel
def test_an_int8_pool_needs_whole_blocks(tmp_path, monkeypatch):
    from speedc.errors import GenerationError

    monkeypatch.setenv("SPEEDC_NATIVE_KERNEL", "1")
    monkeypatch.setenv("SPEEDC_KV_CACHE", "int8")
    art = build_artifact(write_ouro(tmp_path / "ouro16", layers=1, loops=2, head_dim=16), tmp_path / "art")
    with pytest.raises(GenerationError, match="int8 KV cache needs head_dim a multiple of 32 .this model's is 16"):
        Engine.load(art).backend


@needs_kernel
def test_a_plain_engine_attends_natively_too(tmp_path, monkeypatch):
    """P = 1: the fused engine graph is the prefill program itself (no If); its twin attends on the kernel."""
    art = build_artifact(ZOO / "tiny", tmp_path / "p1", dtype="int4", slots=1)
    spec = read_manifest(art).graphs[contract.fused(contract.ENGINE)]
    twin = _model(art / spec["native_file"])
    assert spec[contract.NATIVE_CACHE] == "float16" and not any(contract.is_cache_input(v.name) for v in twin.input)
    assert collections.Counter(n.op_type for n in onnx_nodes(twin))[contract.NATIVE_ATTENTION] == 8
    monkeypatch.setenv("SPEEDC_NATIVE_KERNEL", "1")
    engine = Engine.load(art)
    assert engine.backend.kv_cache == "float16"
    assert len(engine.generate([1, 2, 3, 4], max_new_tokens=12, stop_at_eos=False).ids) == 12
