"""Before/after tests of the pass merge_programs: the programs of each variant become one engine graph
(an If over prefill and the batch step) that computes, branch by branch, exactly what each program did,
and an artifact's engine graph holds each weight once, in its outer scope."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from conftest import random_config, randomize, run_engine_program
from speedc.build import PASS_ORDER
from speedc.format import contract
from speedc.models.checkpoint.torch_io import sources_from_state
from speedc.models.llama import SharedLlama
from speedc.passes.base import BuildOptions, CompileState, run_passes

P, S, N = 3, 2, 6  # slots, stage layers, logical layers
KVH, HD, H, V = 2, 16, 64, 97  # kv heads, head dim (fused attention wants a multiple of 16), hidden, vocab
T = 8  # cache rows fed


@pytest.fixture(scope="module")
def before() -> CompileState:
    """Every pass before merge_programs, fp16 storage (so the programs Cast each weight to fp32)."""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=H)), seed=31)
    state = CompileState(model.cfg, sources_from_state(model.state_dict()), BuildOptions(slots=P, dtype="fp16"))
    return run_passes(state, PASS_ORDER[:PASS_ORDER.index("merge_programs")])[0]


@pytest.fixture(scope="module")
def after(before) -> CompileState:
    fork = dataclasses.replace(before, graphs={n: g.copy() for n, g in before.graphs.items()}, facts=set(before.facts),
                               consumed_by=dict(before.consumed_by))
    return run_passes(fork, ["merge_programs"])[0]


def _session(graph: gs.Graph) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the same kernels on both sides
    return ort.InferenceSession(gs.export_onnx(graph.copy()).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _prefill_feeds(rng) -> dict[str, np.ndarray]:
    feeds = {"input_ids": rng.integers(0, V, size=(2, 3)), "positions": np.array([2, 4]),  # [B, L], [B]
             "chunk_lengths": np.array([3, 2])}  # [B]: row 1 right-padded
    for layer in range(N):
        for kind in contract.KV_KINDS:
            feeds[contract.cache_input(kind, layer)] = rng.standard_normal((2, KVH, T, HD)).astype(np.float32)
    return feeds


def _step_feeds(rng) -> dict[str, np.ndarray]:
    feeds = {"input_ids": rng.integers(0, V, size=(1, 1)), "positions": np.array([6, 5, 4]),  # [n, 1], [P]
             "hidden_in": rng.standard_normal((P - 1, 1, H)).astype(np.float32),  # [(P-1) n, 1, H]
             "final_rows": np.array([P - 1]), "exit_rows": np.array([0]), "check_rows": np.array([1]),
             "check_candidates": rng.integers(0, V, size=(1, contract.candidate_count(V)))}
    for j in range(S):
        for s in range(P):
            for kind in contract.KV_KINDS:
                feeds[contract.batch_cache_input(kind, j, s)] = rng.standard_normal((1, KVH, T, HD)).astype(np.float32)
    return feeds


def test_programs_become_one_engine_graph_per_variant(before, after):
    assert set(before.graphs) == {"prefill", "batch_step", "prefill.gqa", "batch_step.gqa"}
    assert set(after.graphs) == {"engine", "engine.gqa"} and "engine_graph" in after.facts and "programs" not in after.facts
    dims = contract.Dims(P, S, N, KVH, HD, H, V)
    for name, graph in after.graphs.items():
        inputs, outputs = contract.expected_io(name, dims)
        assert graph.inputs[0].name == contract.RUN_STEP and graph.inputs[0].dtype == np.bool_
        assert sorted(t.name for t in graph.inputs) == sorted(spec[0] for spec in inputs), name
        assert sorted(t.name for t in graph.outputs) == sorted(spec[0] for spec in outputs), name
        branch = next(node for node in graph.nodes if node.op == "If")
        assert branch.inputs[0].name == contract.RUN_STEP and branch.outputs == graph.outputs
        for attr, program in (("then_branch", contract.BATCH_STEP), ("else_branch", contract.PREFILL)):
            body = branch.attrs[attr]
            assert body.inputs == [] and len(body.outputs) == len(graph.outputs)
            assert all(node.name.startswith(program + "/") for node in body.nodes), (name, attr)
            # every 16-bit weight's Cast left the branches: one Cast per weight in the outer scope, read by both
            assert not [n for n in body.nodes if n.op == "Cast" and isinstance(n.inputs[0], gs.Constant)
                        and n.inputs[0].name.startswith("model.")]
        program_casts = {n.inputs[0].name for p in (contract.PREFILL, contract.BATCH_STEP)
                         for n in before.graphs[p + contract.variant(name)].nodes
                         if n.op == "Cast" and isinstance(n.inputs[0], gs.Constant) and n.inputs[0].name.startswith("model.")}
        outer_casts = [n.inputs[0].name for n in graph.nodes if n.op == "Cast"]
        assert program_casts and sorted(outer_casts) == sorted(program_casts), name


def test_each_branch_computes_what_its_program_did(before, after):
    """The standard engine graph run with run_step false / true gives the prefill / batch step program's
    outputs bitwise (the same kernels); the other program's outputs come back empty, and its inputs may be
    any small tensor."""
    engine = _session(after.graphs["engine"])
    rng = np.random.default_rng(5)
    for program, feeds in ((contract.PREFILL, _prefill_feeds(rng)), (contract.BATCH_STEP, _step_feeds(rng))):
        alone = _session(before.graphs[program])
        own = [o.name for o in alone.get_outputs()]
        expected = dict(zip(own, alone.run(own, feeds)))
        got = run_engine_program(engine, program, feeds)
        for name in got:
            if name in expected:
                np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{program}: {name}")
            else:
                assert got[name].size == 0, (program, name)


def test_artifact_engine_graph_holds_each_weight_once(tiny_artifact):
    """The writer lifts the branches' weights.bin initializers into the engine graph's outer scope: one
    initializer per weight, none inside a branch (ONNX Runtime loads each once for both)."""
    for name in contract.GRAPHS:
        model = onnx.load(str(tiny_artifact / f"{name}.onnx"), load_external_data=False)
        top = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert len(top) == len(set(top)) and any(t.startswith("model.") for t in top)
        branch = next(node for node in model.graph.node if node.op_type == "If")
        for attribute in branch.attribute:
            assert not [t.name for t in attribute.g.initializer if t.data_location == onnx.TensorProto.EXTERNAL], name
