"""Each pass, before and after, on small random models."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch

from conftest import random_config, randomize
from speedc.build import PASS_ORDER
from speedc.errors import BuildError
from speedc.models.checkpoint.torch_io import open_checkpoint, save_unrolled_hf, sources_from_state
from speedc.format.depth_plan import derive_plan
from speedc.models.llama import SharedLlama
from speedc.passes.base import BuildOptions, CompileState, run_passes
from speedc.cost_model import make_schedule
from speedc.passes.share import merge_identical_constants
from speedc.passes.trt_lint import lint_graph


def _state(model, **options) -> CompileState:
    return CompileState(model.cfg, sources_from_state(model.state_dict()), BuildOptions(**options))


def _through(state, last: str) -> CompileState:
    return run_passes(state, PASS_ORDER[:PASS_ORDER.index(last) + 1])[0]


def _ops(graph: gs.Graph, op: str) -> int:
    return sum(1 for n in graph.nodes if n.op == op)


@pytest.fixture(scope="module")
def model():
    return randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2)), seed=11)


def test_trace_decode_graph_matches_reference(model):
    state = _through(_state(model), "trace")
    graph = state.graphs["decode"]
    assert _ops(graph, "Gemm") == 6 * 7 + 2  # 7 projections per layer, final + exit heads
    assert _ops(graph, "Transpose") < 6 * 7  # weights are read as stored, never transposed
    session = ort.InferenceSession(gs.export_onnx(graph).SerializeToString())
    cfg = model.cfg
    feeds = {"input_ids": np.array([[3, 7, 1, 9]]), "positions": np.array([0])}
    for layer in range(cfg.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past.{kind}.{layer}"] = np.zeros((1, cfg.num_key_value_heads, 8, cfg.head_dim), np.float32)
    logits = session.run(["logits"], feeds)[0]
    expected = model(torch.tensor(feeds["input_ids"])).logits.detach().numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)


def test_share_merges_duplicates_and_derives_the_map(tmp_path, model):
    # Before: a Hugging Face checkpoint stores all 6 layers.
    cfg, weights = open_checkpoint(save_unrolled_hf(model, tmp_path / "hf"))
    assert cfg.layer_map == list(range(6)) and sum(".blocks." in n for n in weights) == 6 * 9
    state = _through(CompileState(cfg, weights, has_speedc_section=False), "share")
    # After: the cycle is recognised and the blocks carry native names.
    assert state.layer_map == [0, 1, 0, 1, 0, 1]
    assert state.exit_layer == 2 and state.exit_norm == "model.norm.weight"
    names = {t.name for t in state.graphs["decode"].tensors().values() if isinstance(t, gs.Constant)}
    assert "model.blocks.1.mlp.up_proj.weight" in names and not any("blocks.2." in n for n in names)


def test_merge_identical_constants_before_after():
    x = gs.Variable("x", np.float32, [2, 3])
    w1 = gs.Constant("w1", np.arange(9, dtype=np.float32).reshape(3, 3))
    w2 = gs.Constant("w2", np.arange(9, dtype=np.float32).reshape(3, 3))  # same values, other name
    w3 = gs.Constant("w3", np.ones((3, 3), np.float32))
    y1, y2, y3 = (gs.Variable(n, np.float32, [2, 3]) for n in ("y1", "y2", "y3"))
    nodes = [gs.Node("MatMul", inputs=[x, w], outputs=[y]) for w, y in ((w1, y1), (w2, y2), (w3, y3))]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[y1, y2, y3])
    assert merge_identical_constants(graph) == 1
    assert [n.inputs[1].name for n in graph.nodes] == ["w1", "w1", "w3"]


def test_only_weights_of_one_role_merge():
    """Before: block 0's k_proj equal to its v_proj (both zero, or copied) merged under one name, and
    gqa_attention failed with "internal: ... q/k/v groups". Now the same role merges across blocks only."""
    x = gs.Variable("x", np.float32, [2, 3])
    values = np.arange(9, dtype=np.float32).reshape(3, 3)
    names = ["model.blocks.0.self_attn.k_proj.weight", "model.blocks.0.self_attn.v_proj.weight",
             "model.blocks.1.self_attn.k_proj.weight", "model.embed_tokens.weight", "lm_head.weight"]
    outputs = [gs.Variable(f"y{i}", np.float32, [2, 3]) for i in range(len(names))]
    nodes = [gs.Node("MatMul", inputs=[x, gs.Constant(name, values.copy())], outputs=[y]) for name, y in zip(names, outputs)]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=outputs)
    assert merge_identical_constants(graph) == 2
    assert [n.inputs[1].name for n in graph.nodes] == [names[0], names[1], names[0], names[4], names[4]]


def test_projections_equal_across_roles_build_and_stay_lossless(tmp_path):
    from conftest import build_artifact
    from speedc import Engine
    from speedc.models.generate import generate as reference_generate

    model = randomize(SharedLlama(random_config(blocks=2, layers=4, heads=4, kv_heads=2, hidden=64)), seed=5)
    with torch.no_grad():
        attention = model.model.blocks[0].self_attn
        attention.v_proj.weight.copy_(attention.k_proj.weight)
    engine = Engine.load(build_artifact(model, tmp_path / "art"))
    prompt = [3, 1, 4, 1, 5]
    speed = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    assert speed.ids == engine.generate(prompt, max_new_tokens=24, stop_at_eos=False, mode="autoregressive").ids
    assert speed.ids == reference_generate(model, prompt, 24)


def test_schedule_valid_slots_and_choice():
    cycle = [0, 1, 2, 3] * 4
    assert derive_plan(cycle).valid_slots(4) == [1, 2, 4]
    assert derive_plan(cycle).valid_slots(5) == [1, 2]  # the exit must lie in the first stage
    assert derive_plan([0, 0, 1, 1]).valid_slots(1) == [1]
    assert make_schedule(derive_plan(cycle), 4, alpha=0.8, requested=None).slots == 4
    assert make_schedule(derive_plan(cycle), 4, alpha=0.05, requested=None).slots == 1  # speculation would not pay
    plain = make_schedule(derive_plan(list(range(6))), 6, alpha=0.9, requested=None)
    assert plain.slots == 1 and "unshared" in plain.reason
    with pytest.raises(BuildError, match="--slots 3 does not divide the schedule"):
        make_schedule(derive_plan(cycle), 4, alpha=0.8, requested=3)


def test_batch_step_graph_before_after(model):
    before = _through(_state(model), "schedule")
    decode_gemms = _ops(before.graphs["decode"], "Gemm")
    after = run_passes(before, ["batch_step_graph"])[0]
    assert set(after.graphs) == {"batch_step", "prefill"} and "decode_program" not in after.facts
    step = after.graphs["batch_step"]
    # After: one stage (S=2 layers) over P=3 slots of n sequences; layers 2..5 are gone, each weight read
    # once per step; one LM-head Gemm serves the final and exit rows (the prefill's head: exit_heads).
    assert _ops(step, "Gemm") == 2 * 7 + 1 and decode_gemms == 6 * 7 + 2
    inputs = {t.name: t.shape for t in step.inputs}
    assert inputs["input_ids"] == ["sequences", 1] and inputs["positions"] == ["rows"] and inputs["hidden_in"] == ["rows_behind", 1, 32]
    assert sorted(n for n in inputs if n.startswith("cache.")) == [
        f"cache.{kind}.{j}.{s}" for kind in ("key", "value") for j in range(2) for s in range(3)]
    gemm_weights = [n.inputs[1].name for n in step.nodes if n.op == "Gemm"]
    assert len(gemm_weights) == len(set(gemm_weights))  # no weight loaded twice in a step


def test_exit_heads_and_kv_cache_outputs(model):
    state = _through(_state(model), "kv_cache")
    expected = {"final_token": ["final_rows"], "final_logits": ["final_rows", 97], "exit_tokens": ["exit_rows"],
                "exit_candidates": ["exit_rows", 8], "check_tokens": ["check_rows"], "hidden_out": ["rows", 1, 32],
                "new_key": [2, "rows", 2, 1, 8], "new_value": [2, "rows", 2, 1, 8]}
    assert {t.name: t.shape for t in state.graphs["batch_step"].outputs} == expected
    # One LM-head Gemm in the batch step serves the final and the exit rows.
    heads = [n for n in state.graphs["batch_step"].nodes if n.op == "Gemm" and n.inputs[1].name == "model.embed_tokens.weight"]
    assert len(heads) == 1
    prefill = {t.name: t.shape for t in state.graphs["prefill"].outputs}
    assert prefill == {"next_token": ["batch"], "logits": ["batch", 97], "new_key": [6, "batch", 2, "chunk", 8],
                       "new_value": [6, "batch", 2, "chunk", 8]}  # one row per sequence (batched plain decoding)
    assert all(t.name.startswith("cache.") or t.name in ("input_ids", "positions", "hidden_in", "final_rows", "exit_rows")
               or (t.name, name) == ("chunk_lengths", "prefill")
               or (name == "batch_step" and t.name in ("check_rows", "check_candidates"))
               for name, g in state.graphs.items() for t in g.inputs)


def _step_feeds(graph: gs.Graph, slots: int = 3, context: int = 6) -> dict[str, np.ndarray]:
    """Feeds of a batch step graph (standard or fused) for one sequence with every slot filled: the
    oldest slot's final head, every slot's exit head, no early-flush check."""
    rng = np.random.default_rng(0)
    shapes = {t.name: t.shape for t in graph.inputs}
    hidden, width = shapes["hidden_in"][-1], shapes["check_candidates"][-1]
    feeds = {"input_ids": rng.integers(0, 97, size=(1, 1)), "positions": rng.choice(np.arange(1, context - 1), slots, replace=False),
             "hidden_in": rng.standard_normal((slots - 1, 1, hidden)).astype(np.float32), "final_rows": np.array([slots - 1]),
             "exit_rows": np.arange(slots), "check_rows": np.zeros(0, np.int64), "check_candidates": np.zeros((0, width), np.int64)}
    if "computed_rows" in shapes:  # fused: every row holds a token; the pool [P*W, ...] with W = 1
        feeds["computed_rows"] = np.arange(slots)
    for name, shape in shapes.items():
        if name.startswith(("cache.", "pool.")):
            rows = slots if "computed_rows" in shapes else 1  # fused pool rows, else one slab's sequences
            feeds[name] = rng.standard_normal((rows, shape[1], context, shape[3])).astype(np.float32)
    return {name: value for name, value in feeds.items() if name in shapes}


def test_fuse_projections_before_after(model):
    before = _through(_state(model), "kv_cache")
    step = before.graphs["batch_step"]
    feeds = _step_feeds(step)
    names = [t.name for t in step.outputs]
    expected = ort.InferenceSession(gs.export_onnx(step.copy()).SerializeToString()).run(names, feeds)
    assert _ops(step, "Gemm") == 2 * 7 + 1  # before: 7 projections x 2 layers + the shared LM head
    after = run_passes(before, ["fuse_projections"])[0]
    step = after.graphs["batch_step"]
    # After: q/k/v and gate/up read their input once each: 4 Gemms a layer (qkv, o, gate+up, down) + head.
    assert _ops(step, "Gemm") == 2 * 4 + 1 and _ops(step, "Split") >= 2 * 2
    weights = [n.inputs[1].name for n in step.nodes if n.op == "Gemm"]
    assert "model.blocks.0.self_attn.q_proj.weight+model.blocks.0.self_attn.k_proj.weight+model.blocks.0.self_attn.v_proj.weight" in weights
    assert "model.blocks.1.mlp.gate_proj.weight+model.blocks.1.mlp.up_proj.weight" in weights
    assert len(weights) == len(set(weights))  # still no weight loaded twice in a step
    parts = after.weight_parts["model.blocks.1.mlp.gate_proj.weight+model.blocks.1.mlp.up_proj.weight"]
    assert [(name.split(".")[-2], first, rows) for name, first, rows in parts] == [("gate_proj", 0, 48), ("up_proj", 48, 48)]
    got = ort.InferenceSession(gs.export_onnx(step.copy()).SerializeToString()).run(names, feeds)
    for name, want, have in zip(names, expected, got):
        np.testing.assert_allclose(have, want, atol=1e-5, rtol=1e-5, err_msg=name)
    # The prefill graph runs every block several times: each stacked weight is built once and reused.
    prefill_weights = {n.inputs[1].name for n in after.graphs["prefill"].nodes if n.op == "Gemm"}
    assert set(weights) <= prefill_weights and len(prefill_weights) == len(set(weights))


def test_fuse_projections_feeds_packed_qkv_to_attention():
    """gqa_attention packs q|k|v with a Concat; fuse_projections stacks the three Gemms and drops the
    Split + Concat: each layer's GroupQueryAttention reads the stacked projection, reshaped, and its key
    and value inputs stay empty (the packed form). (Its numbers: the engine tests against the oracle.)"""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)), seed=12)
    before = _through(_state(model), "gqa_attention")
    fused_before = before.graphs["batch_step.gqa"]
    assert _ops(fused_before, "Concat") >= 2  # the packing, before the Gemms are stacked
    after = run_passes(before, ["fuse_projections"])[0]
    for name in ("prefill.gqa", "batch_step.gqa"):
        graph = after.graphs[name]
        for node in (n for n in graph.nodes if n.op == "GroupQueryAttention"):
            assert node.inputs[1].name == "" and node.inputs[2].name == ""  # packed: no key / value input
            source = node.inputs[0]
            while source.inputs[0].op in ("Reshape", "ScatterND"):  # the batch step scatters its rows into the pool
                node = source.inputs[0]
                source = node.inputs[2] if node.op == "ScatterND" else node.inputs[0]
            producer = source.inputs[0]
            assert producer.op == "Gemm" and producer.inputs[1].name.count("+") == 2, name  # the stacked q|k|v weight
    fused = after.graphs["prefill.gqa"]
    assert _ops(fused, "Split") == 6  # gate|up only; the q|k|v Split fell away with the Concat


def test_gqa_attention_before_after():
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)), seed=12)  # head_dim 16
    before = _through(_state(model), "kv_cache")
    assert set(before.graphs) == {"prefill", "batch_step"}
    assert _ops(before.graphs["batch_step"], "Softmax") == 2  # standard attention: one softmax per stage layer
    after = run_passes(before, ["gqa_attention"])[0]
    assert set(after.graphs) == {"prefill", "batch_step", "prefill.gqa", "batch_step.gqa"}
    for name, layers in (("prefill", 6),):
        fused, standard = after.graphs[f"{name}.gqa"], after.graphs[name]
        assert _ops(fused, "GroupQueryAttention") == layers and _ops(fused, "Softmax") == 0
        assert len(fused.nodes) < len(standard.nodes) / 2  # rotary, masks, split softmax: gone
        outputs = {t.name for t in fused.outputs}
        assert "new_key" not in outputs and {f"cache.key.{i}.out" for i in range(layers)} <= outputs
        assert {t.name for t in fused.inputs} == {t.name for t in standard.inputs}  # same feeds, same buffers
    # The batch step: one attention per stage layer over the pool (every slot's and pool row's rows,
    # the free ones padded in), not one per slot group; its P slabs per layer become one pool buffer.
    fused, standard = after.graphs["batch_step.gqa"], after.graphs["batch_step"]
    assert _ops(fused, "GroupQueryAttention") == 2 and _ops(fused, "Softmax") == 0
    slabs = {t.name for t in standard.inputs if t.name.startswith("cache.")}
    assert len(slabs) == 2 * 2 * 3  # key/value x stage layers x slots
    assert {t.name for t in fused.inputs} == ({t.name for t in standard.inputs} - slabs) | {
        f"pool.{kind}.{j}" for kind in ("key", "value") for j in range(2)} | {"computed_rows"}
    # Only the computed rows run the stage layers: one Gather of the slot inputs, every Gemm after it.
    assert [n.inputs[1].name for n in fused.nodes if n.op == "Gather" and n.inputs[0].name == "slot_inputs.every_row"] == [
        "computed_rows"]
    # The standard graphs are untouched (TensorRT and the numpy-fed backend use them).
    assert _ops(after.graphs["batch_step"], "GroupQueryAttention") == 0
    trt = run_passes(_through(_state(model, target="trt"), "kv_cache"), ["gqa_attention"])[0]
    assert not any(name.endswith(".gqa") for name in trt.graphs)  # TensorRT has no such op
    narrow = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2)), seed=12)  # head_dim 8
    skipped = run_passes(_through(_state(narrow), "kv_cache"), ["gqa_attention"])[0]
    assert not any(name.endswith(".gqa") for name in skipped.graphs) and "head_dim % 16" in skipped.notes[-1]


def test_cleanup_folds_and_fp16_halves_weights(model):
    before = _through(_state(model, dtype="fp16"), "kv_cache")
    nodes_before = {k: len(g.nodes) for k, g in before.graphs.items()}
    after = run_passes(before, ["cleanup"])[0]
    for name, graph in after.graphs.items():
        assert len(graph.nodes) < nodes_before[name]
        weights = [t for t in graph.tensors().values() if isinstance(t, gs.Constant) and t.values.size >= 1024]
        assert weights and all(t.values.dtype == np.float16 for t in weights)
        assert _ops(graph, "Cast") >= len(weights)


def test_trt_lint_passes_our_graphs_and_fails_unsupported_ops(model):
    state = _through(_state(model, target="trt"), "cleanup")
    assert all(lint_graph(g) == [] for g in state.graphs.values())
    step = state.graphs["batch_step"]
    bad_out = gs.Variable("nz", np.int64)
    step.nodes.append(gs.Node("NonZero", "inject/NonZero", inputs=[step.inputs[1]], outputs=[bad_out]))
    step.outputs.append(bad_out)
    with pytest.raises(BuildError, match="NonZero .* not supported by the TensorRT ONNX parser"):
        run_passes(state, ["trt_lint"])


def _run_graph(graph: gs.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(gs.export_onnx(graph.copy()).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def test_fuse_skip_norm_before_after():
    """Every layer norm of the ONNX Runtime graphs becomes SkipSimplifiedLayerNormalization (its residual Add
    inside where one feeds it, else a zero skip); head norms stay; the numbers stay within float rounding,
    and a row computes the same bits alone (prefill, one row) as among a step's P rows."""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)), seed=12)
    before = _through(_state(model), "cleanup")
    plain_graphs = {name: before.graphs[name].copy() for name in ("batch_step.gqa", "prefill.gqa")}  # the pass edits in place
    after = run_passes(before, ["fuse_skip_norm"])[0]
    for name, layers in (("batch_step.gqa", 2), ("prefill.gqa", 6)):
        fused, plain = after.graphs[name], plain_graphs[name]
        assert _ops(plain, "SkipSimplifiedLayerNormalization") == 0
        assert _ops(fused, "SkipSimplifiedLayerNormalization") == 2 * layers  # input + post-attention norm a layer
        # the first layer's input norm: no Add before it, a zero skip (the batch step has one already: the pool's rows)
        assert _ops(fused, "ConstantOfShape") - _ops(plain, "ConstantOfShape") == 1
        # gone: every residual Add but the stage's last, and each layer norm's Add(eps)
        assert _ops(plain, "Add") - _ops(fused, "Add") == (2 * layers - 1) + 2 * layers
        assert _ops(fused, "Pow") == _ops(plain, "Pow") - 2 * layers  # head norms kept as they were
        feeds = _step_feeds(plain) if name == "batch_step.gqa" else _decode_rows_feeds(plain, 2)
        want, got = _run_graph(plain, feeds), _run_graph(fused, feeds)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=1e-5, err_msg=f"{name} {key}")
    assert not any(_ops(g, "SkipSimplifiedLayerNormalization") for n, g in after.graphs.items() if not n.endswith(".gqa"))
    # Row invariance of the kernel in place: one row's output equals that row's among four.
    prefill = after.graphs["prefill.gqa"]
    rows = _decode_rows_feeds(prefill, 4)
    one = {k: v[:1] for k, v in rows.items()}
    assert np.array_equal(_run_graph(prefill, one)["logits"], _run_graph(prefill, rows)["logits"][:1])


def _decode_rows_feeds(prefill: gs.Graph, rows: int, context: int = 6) -> dict[str, np.ndarray]:
    """Batched plain decoding feeds for the prefill graph: ROWS sequences, one token each."""
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 97, size=(rows, 1)), "positions": rng.integers(1, context - 1, size=rows),
             "chunk_lengths": np.ones(rows, np.int64)}
    for t in prefill.inputs:
        if t.name.startswith("cache."):
            feeds[t.name] = rng.standard_normal((rows, t.shape[1], context, t.shape[3])).astype(np.float32)
    return feeds
