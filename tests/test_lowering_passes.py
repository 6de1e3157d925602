"""Before/after tests of the lowering passes exit_heads, kv_cache and cache_writer, each on its own.

Each test runs the pipeline up to just before the pass, snapshots (or runs) the graphs, runs the single
pass with run_passes(state, [name]) and compares. Graphs are executed with ONNX Runtime on random
inputs and checked against the PyTorch reference (SharedLlama) or a numpy reference.

Model: hidden 32, 4 heads (head_dim 8), 2 kv heads, vocab 97, N = 6 logical layers over M = 2 blocks
-> P = 3 slots, S = 2 stage layers per slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch

from conftest import random_config, randomize
from speedc.build import PASS_ORDER
from speedc.errors import BuildError
from speedc.models.llama import SharedLlama
from speedc.models.checkpoint import sources_from_state
from speedc.passes.base import BuildOptions, CompileState, run_passes

P, S, N = 3, 2, 6  # slots, stage layers, logical layers
KVH, HD, H, V = 2, 8, 32, 97  # kv heads, head dim, hidden, vocab
T = 8  # cache rows fed to the programs (the 'context' dim)
LOGITS_ATOL = LOGITS_RTOL = 1e-4  # ONNX Runtime vs PyTorch, fp32, different summation order
HIDDEN_ATOL = 1e-6  # the same subgraph before and after a pass that did not touch it


# ---- helpers ---------------------------------------------------------------------------------------

def _state(model: SharedLlama, **options) -> CompileState:
    return CompileState(model.cfg, sources_from_state(model.state_dict()), BuildOptions(**options))


def _before(analysed: CompileState, name: str) -> CompileState:
    """The state the pipeline hands to pass NAME (every pass before it has run), continued from a fork of
    ANALYSED, the state after the passes up to and including `share` (tracing is the slow part: once per model)."""
    first = PASS_ORDER.index("share") + 1
    assert PASS_ORDER.index(name) >= first, name
    return run_passes(_fork(analysed), PASS_ORDER[first:PASS_ORDER.index(name)])[0]


def _fork(state: CompileState) -> CompileState:
    """An independent copy (graphs copied; passes mutate them in place). Tensors are shared, read-only."""
    return dataclasses.replace(state, graphs={n: g.copy() for n, g in state.graphs.items()}, facts=set(state.facts),
                               consumed_by=dict(state.consumed_by), notes=list(state.notes),
                               weight_parts=dict(state.weight_parts))


def _run(graph: gs.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of GRAPH, executed by ONNX Runtime (fed only the inputs it has), unoptimized: a
    subgraph a pass did not touch must compute the same numbers before and after it, and ONNX Runtime's
    fusions depend on the graph around it (a traced head reading the rows a layer norm reads stops that
    norm's fusion; measured: 1e-6 differences in an untouched layer's K/V)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(gs.export_onnx(graph.copy()).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _io(tensors) -> dict[str, list]:
    return {t.name: t.shape for t in tensors}


def _ops(graph: gs.Graph, op: str) -> int:
    return sum(1 for n in graph.nodes if n.op == op)


def _lm_head_name(model: SharedLlama) -> str:
    return "model.embed_tokens.weight" if model.cfg.tie_word_embeddings else "lm_head.weight"


def _step_feeds(seed: int, prefix: str = "past") -> dict[str, np.ndarray]:
    """Step inputs: slot s holds position pos - s; random cache rows (rows > a slot's position are masked)."""
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, V, size=(1, 1)),  # [1, 1]
             "positions": np.array([6, 5, 4], dtype=np.int64),  # [P]
             "hidden_in": rng.standard_normal((P - 1, 1, H)).astype(np.float32)}  # [P-1, 1, H]
    for j in range(S):
        for kind in ("key", "value"):
            feeds[f"{prefix}.{kind}.{j}"] = rng.standard_normal((P, KVH, T, HD)).astype(np.float32)  # [P, kvh, T, hd]
    return feeds


def _prefill_feeds(seed: int, length: int, start: int, prefix: str = "past", zero_cache: bool = False):
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, V, size=(1, length)),  # [1, L]
             "positions": np.array([start], dtype=np.int64),  # [1]: the chunk's first position
             "chunk_lengths": np.array([length], dtype=np.int64)}  # [1]: no padding (graphs before exit_heads lack it)
    for layer in range(N):
        for kind in ("key", "value"):
            cache = rng.standard_normal((1, KVH, T, HD)).astype(np.float32)  # [1, kvh, T, hd]
            feeds[f"{prefix}.{kind}.{layer}"] = np.zeros_like(cache) if zero_cache else cache
    return feeds


def _torch(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


def _assert_argmax(tokens: np.ndarray, logits: np.ndarray, what: str) -> None:
    """TOKENS [R] == argmax of LOGITS [R, V]; the top-2 gap must exceed twice the logits tolerance, or an
    argmax comparison between ONNX Runtime and PyTorch would not be meaningful (pick another seed)."""
    assert tokens.dtype == np.int64, what
    np.testing.assert_array_equal(tokens, logits.argmax(-1), err_msg=what)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    margin = 2 * (LOGITS_ATOL + LOGITS_RTOL * np.abs(top2[:, 1]))
    assert (top2[:, 1] - top2[:, 0] > margin).all(), f"{what}: near-tie, argmax check is meaningless"


# ---- models and pre-pass states ----------------------------------------------------------------------

# exit at the end of the first stage (exit tap == stage output), own exit norm, tied LM head
STAGE_END_EXIT = dict(blocks=2, layers=6, heads=4, kv_heads=2)
# exit inside the stage (after layer 0), exit head reuses the final norm, separate lm_head.weight
INNER_EXIT = dict(blocks=2, layers=6, heads=4, kv_heads=2, exit_layer=1, exit_norm="final", tie=False)


@pytest.fixture(scope="module")
def model() -> SharedLlama:
    return randomize(SharedLlama(random_config(**STAGE_END_EXIT)), seed=21)


@pytest.fixture(scope="module")
def inner_exit_model() -> SharedLlama:
    return randomize(SharedLlama(random_config(**INNER_EXIT)), seed=22)


def _next_state(previous_pass: str, after_previous: CompileState, name: str) -> CompileState:
    """The state pass NAME receives when it directly follows PREVIOUS_PASS in the pipeline."""
    assert PASS_ORDER[PASS_ORDER.index(name) - 1] == previous_pass, PASS_ORDER
    return after_previous


@pytest.fixture(scope="module")
def analysed(model) -> CompileState:
    """After trace and share (P = 3 requested; the schedule pass has not run)."""
    return run_passes(_state(model, slots=P), PASS_ORDER[:PASS_ORDER.index("share") + 1])[0]


@pytest.fixture(scope="module")
def inner_exit_analysed(inner_exit_model) -> CompileState:
    return run_passes(_state(inner_exit_model, slots=P), PASS_ORDER[:PASS_ORDER.index("share") + 1])[0]


def _run_one(state: CompileState, name: str) -> CompileState:
    return run_passes(_fork(state), [name])[0]


def _module_state(name: str, make) -> object:
    """A module-scoped fixture NAME computed by MAKE (its parameters are the fixtures it needs)."""
    return pytest.fixture(scope="module", name=name)(make)


# Module-wide before/after states (tests never mutate them: they _fork before running any pass).
# kv_cache directly follows exit_heads and cache_writer follows kv_cache (_next_state checks it), so
# each one's state before is the state after the one before it.
before_exit_heads = _module_state("before_exit_heads", lambda analysed: _before(analysed, "exit_heads"))
after_exit_heads = _module_state("after_exit_heads", lambda before_exit_heads: _run_one(before_exit_heads, "exit_heads"))
inner_before_exit_heads = _module_state("inner_before_exit_heads",
                                        lambda inner_exit_analysed: _before(inner_exit_analysed, "exit_heads"))
inner_after_exit_heads = _module_state("inner_after_exit_heads",
                                       lambda inner_before_exit_heads: _run_one(inner_before_exit_heads, "exit_heads"))
before_kv_cache = _module_state("before_kv_cache",
                                lambda after_exit_heads: _next_state("exit_heads", after_exit_heads, "kv_cache"))
after_kv_cache = _module_state("after_kv_cache", lambda before_kv_cache: _run_one(before_kv_cache, "kv_cache"))
before_cache_writer = _module_state("before_cache_writer",
                                    lambda after_kv_cache: _next_state("kv_cache", after_kv_cache, "cache_writer"))
after_cache_writer = _module_state("after_cache_writer",
                                   lambda before_cache_writer: _run_one(before_cache_writer, "cache_writer"))


# ---- exit_heads --------------------------------------------------------------------------------------

def test_exit_heads_outputs_before_after(model, before_exit_heads, after_exit_heads):
    before, after = before_exit_heads, after_exit_heads
    presents = [f"present.{kind}.{j}" for j in range(S) for kind in ("key", "value")]
    # Before: the step graph outputs the stage's hidden state (the exit tap hidden.1 is the same tensor) and
    # per-layer presents; the prefill graph still has the traced heads and every layer's hidden state.
    assert set(before.graphs) == {"step", "prefill", "batch_step"}
    assert [t.name for t in before.graphs["step"].outputs] == ["hidden.1", *presents]
    prefill_before = [t.name for t in before.graphs["prefill"].outputs]
    assert {"logits", "exit_logits"} <= set(prefill_before)
    assert {f"hidden.{layer}" for layer in range(N)} <= set(prefill_before)
    assert {f"present.{kind}.{layer}" for layer in range(N) for kind in ("key", "value")} <= set(prefill_before)
    lm_head = _lm_head_name(model)
    step_heads_before = [n for n in before.graphs["step"].nodes if n.op == "Gemm" and n.inputs[1].name == lm_head]
    assert step_heads_before == []  # the traced heads sat after layer N-1: dead in the one-stage step graph

    assert set(after.graphs) == {"step", "step_flush", "prefill", "batch_step"} and "heads" in after.facts
    step_out = {"final_token": [1], "final_logits": [1, V], "exit_tokens": [1], "hidden_out": [P, 1, H]}
    assert {k: v for k, v in _io(after.graphs["step"].outputs).items() if not k.startswith("present.")} == step_out
    assert [t.name for t in after.graphs["step"].outputs][4:] == presents
    flush = _io(after.graphs["step_flush"].outputs)
    assert flush["exit_tokens"] == [P] and [t.name for t in after.graphs["step_flush"].outputs][4:] == presents
    prefill = _io(after.graphs["prefill"].outputs)  # traced heads and per-layer hidden states are gone
    assert list(prefill) == ["next_token", "logits", *(n for n in prefill_before if n.startswith("present."))]
    assert prefill["next_token"] == ["batch"] and prefill["logits"] == ["batch", V]  # a row per sequence
    # The inputs are untouched.
    assert _io(after.graphs["step"].inputs) == _io(before_exit_heads.graphs["step"].inputs)
    # One LM-head Gemm per program: in a step it serves the final row and the exit row(s) at once.
    for name in ("step", "step_flush", "prefill"):
        readers = [n for n in after.graphs[name].nodes if any(i.name == lm_head for i in n.inputs)]
        assert [n.op for n in readers if n.op != "Gather"] == ["Gemm"], name  # (Gather: the tied embedding)


def test_exit_heads_lm_head_read_once_untied(inner_after_exit_heads):
    after = inner_after_exit_heads
    for name in ("step", "step_flush", "prefill"):
        readers = [n.op for n in after.graphs[name].nodes if any(i.name == "lm_head.weight" for i in n.inputs)]
        assert readers == ["Gemm"], name


@pytest.mark.parametrize("which", ["stage_end_exit", "inner_exit"])
def test_exit_heads_step_numerics(which, request):
    prefix = "" if which == "stage_end_exit" else "inner_"
    reference = request.getfixturevalue("model" if which == "stage_end_exit" else "inner_exit_model")
    state = request.getfixturevalue(f"{prefix}before_exit_heads")
    after_state = request.getfixturevalue(f"{prefix}after_exit_heads")
    exit_layer = reference.cfg.exit_layer
    assert state.exit_layer == exit_layer and state.schedule.slots == P
    feeds = _step_feeds(seed=5)
    # Before: the hidden states the graph computes: the stage output and the exit tap.
    before = _run(state.graphs["step"], feeds)
    stage_out = before[f"hidden.{S - 1}"]  # [P, H]: token rows
    exit_tap = before[f"hidden.{exit_layer - 1}"]  # [P, H]
    assert stage_out.shape == exit_tap.shape == (P, H)

    step = _run(after_state.graphs["step"], feeds)
    flush = _run(after_state.graphs["step_flush"], feeds)
    with torch.no_grad():
        final_logits = reference.final_head(_torch(stage_out[P - 1:])).numpy()  # [1, V]: the oldest slot
        exit_logits = reference.exit_head(_torch(exit_tap)).numpy()  # [P, V]: every slot's exit

    for outputs, exits in ((step, 1), (flush, P)):
        np.testing.assert_allclose(outputs["hidden_out"], stage_out[:, None], atol=HIDDEN_ATOL, rtol=0)  # [P, 1, H]
        assert outputs["final_logits"].shape == (1, V)
        np.testing.assert_allclose(outputs["final_logits"], final_logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
        _assert_argmax(outputs["final_token"], outputs["final_logits"], "final_token vs graph logits")
        _assert_argmax(outputs["final_token"], final_logits, "final_token vs PyTorch final_head")
        assert outputs["exit_tokens"].shape == (exits,)
        _assert_argmax(outputs["exit_tokens"], exit_logits[:exits], "exit_tokens vs PyTorch exit_head")
        for key in (k for k in before if k.startswith("present.")):
            np.testing.assert_allclose(outputs[key], before[key], atol=HIDDEN_ATOL, rtol=0, err_msg=key)


def test_exit_heads_prefill_numerics(model, before_exit_heads, after_exit_heads):
    state, after_state = before_exit_heads, after_exit_heads
    chunk = 5
    feeds = _prefill_feeds(seed=6, length=chunk, start=2)  # rows 0, 1 of the random cache are the context
    before = _run(state.graphs["prefill"], feeds)
    last_hidden = before[f"hidden.{N - 1}"][-1:]  # [1, H]: the last token row (one sequence) after all N layers

    after = _run(after_state.graphs["prefill"], feeds)
    with torch.no_grad():
        final_logits = model.final_head(_torch(last_hidden)).numpy()  # [1, V]
    assert after["logits"].shape == (1, V) and after["next_token"].shape == (1,)
    np.testing.assert_allclose(after["logits"], final_logits, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    np.testing.assert_allclose(after["logits"], before["logits"][:, -1], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)  # traced head
    _assert_argmax(after["next_token"], after["logits"], "next_token vs graph logits")
    _assert_argmax(after["next_token"], final_logits, "next_token vs PyTorch final_head")
    for key in (k for k in before if k.startswith("present.")):
        np.testing.assert_allclose(after[key], before[key], atol=HIDDEN_ATOL, rtol=0, err_msg=key)

    # End to end from an empty cache: the prefill head is the model's last-position logits.
    fresh = _run(after_state.graphs["prefill"], _prefill_feeds(seed=7, length=chunk, start=0, zero_cache=True))
    with torch.no_grad():
        ids = _prefill_feeds(seed=7, length=chunk, start=0)["input_ids"]
        expected = model(torch.from_numpy(ids)).logits[:, -1].numpy()  # [1, V]
    np.testing.assert_allclose(fresh["logits"], expected, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    _assert_argmax(fresh["next_token"], expected, "next_token vs PyTorch forward")


def test_exit_heads_prefill_reads_each_rows_last_real_token(model, after_exit_heads):
    """Prompts of different lengths in one prefill run, right padded (chunk_lengths): each row's logits are
    its own prompt's, as PyTorch computes it alone; a padded row's cache rows up to its length too."""
    lengths = [5, 3, 1]
    feeds = _prefill_feeds(seed=8, length=max(lengths), start=0, zero_cache=True)
    rng = np.random.default_rng(8)
    feeds["input_ids"] = rng.integers(0, V, size=(len(lengths), max(lengths)))  # [B, L]
    feeds["positions"] = np.zeros(len(lengths), np.int64)
    feeds["chunk_lengths"] = np.array(lengths, np.int64)
    for name in [k for k in feeds if k.startswith("past.")]:
        feeds[name] = np.zeros((len(lengths), KVH, T, HD), np.float32)
    batched = _run(after_exit_heads.graphs["prefill"], feeds)
    assert batched["logits"].shape == (len(lengths), V)
    for row, length in enumerate(lengths):
        ids = feeds["input_ids"][row:row + 1, :length]
        with torch.no_grad():
            expected = model(torch.from_numpy(ids)).logits[:, -1].numpy()  # [1, V]
        np.testing.assert_allclose(batched["logits"][row:row + 1], expected, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
        alone = dict(feeds, input_ids=ids, positions=np.zeros(1, np.int64), chunk_lengths=np.array([length]),
                     **{k: v[:1] for k, v in feeds.items() if k.startswith("past.")})
        single = _run(after_exit_heads.graphs["prefill"], alone)
        np.testing.assert_allclose(batched["logits"][row], single["logits"][0], atol=HIDDEN_ATOL, rtol=0)
        for key in (k for k in single if k.startswith("present.")):
            np.testing.assert_allclose(batched[key][row, :, :length], single[key][0, :, :length], atol=HIDDEN_ATOL, rtol=0,
                                       err_msg=key)


@pytest.mark.parametrize("which", ["stage_end_exit", "inner_exit"])
def test_batch_step_checks_score_only_their_candidates(which, request):
    """The batch step's heads (pass batch_step_graph): exit rows give the argmax and top K of the exit
    head; a check row scores only the K candidate ids it is given, and returns the best of them, as
    PyTorch's exit head ranks them (a candidate list without the row's overall argmax proves the
    restriction: the full argmax would be outside it)."""
    prefix = "" if which == "stage_end_exit" else "inner_"
    reference = request.getfixturevalue("model" if which == "stage_end_exit" else "inner_exit_model")
    state = request.getfixturevalue(f"{prefix}after_exit_heads")
    graph = state.graphs["batch_step"].copy()
    exit_tap = graph.tensors()[f"hidden.{reference.cfg.exit_layer - 1}"]
    graph.outputs.append(exit_tap)  # [R, H]: what the reference heads read
    n, k = 2, 8
    rng = np.random.default_rng(31)
    feeds = {"input_ids": rng.integers(0, V, size=(n, 1)), "positions": np.array([6, 5, 5, 4, 4, 3], np.int64),  # [P*n]
             "hidden_in": rng.standard_normal(((P - 1) * n, 1, H)).astype(np.float32),
             "final_rows": np.array([4, 5], np.int64), "exit_rows": np.array([0, 1], np.int64),
             "check_rows": np.array([2, 3, 5], np.int64), "check_candidates": np.zeros((3, 8), np.int64)}
    for j in range(S):
        for kind in ("key", "value"):
            for s in range(P):
                feeds[f"cache.{kind}.{j}.{s}"] = rng.standard_normal((n, KVH, T, HD)).astype(np.float32)
    out = _run(graph, feeds)
    with torch.no_grad():
        logits = reference.exit_head(_torch(out[exit_tap.name])).numpy()  # [R, V]
    exits = logits[feeds["exit_rows"]]
    _assert_argmax(out["exit_tokens"], exits, "exit_tokens vs PyTorch exit_head")
    np.testing.assert_array_equal(out["exit_candidates"], np.argsort(-exits, axis=-1)[:, :k])
    top = np.sort(exits, axis=-1)[:, ::-1][:, :k + 1]
    assert (np.diff(-top, axis=-1) > 2 * LOGITS_ATOL * (1 + np.abs(top[:, 1:]))).all(), "near-tie in the top K"
    # Candidates: ranks 2..9 of each check row's own logits (its argmax left out) in a shuffled order.
    ranked = np.argsort(-logits[feeds["check_rows"]], axis=-1)
    candidates = np.stack([rng.permutation(row[1:k + 1]) for row in ranked])
    out = _run(graph, dict(feeds, check_candidates=candidates))
    np.testing.assert_array_equal(out["check_tokens"], ranked[:, 1])  # the best candidate: each row's second best
    assert all(best not in row for best, row in zip(ranked[:, 0], candidates))
    second, third = (np.take_along_axis(logits[feeds["check_rows"]], ranked[:, i:i + 1], -1) for i in (1, 2))
    assert (second - third > 2 * LOGITS_ATOL * (1 + np.abs(second))).all(), "near-tie among the candidates"


def test_exit_heads_refuses_a_state_without_programs(analysed):
    state = _before(analysed, "step_graph")  # schedule done, no step/prefill programs yet
    with pytest.raises(BuildError) as error:
        run_passes(state, ["exit_heads"])
    message = str(error.value)
    assert "\n" not in message and "pass exit_heads" in message and "step_graph" in message
    assert "decode" in state.graphs and "step_flush" not in state.graphs  # nothing ran


def test_exit_heads_refuses_to_run_after_kv_cache(before_exit_heads):
    state = run_passes(_fork(before_exit_heads), ["kv_cache"])[0]
    with pytest.raises(BuildError) as error:
        run_passes(state, ["exit_heads"])
    message = str(error.value)
    assert "\n" not in message and "pass exit_heads" in message and "kv_cache ran before it" in message
    assert "step_flush" not in state.graphs


# ---- kv_cache ----------------------------------------------------------------------------------------

def test_kv_cache_io_before_after(before_kv_cache, after_kv_cache):
    state, after = before_kv_cache, after_kv_cache
    # Before: per-layer past.* inputs, per-layer present.* outputs.
    for name, layers in (("step", S), ("step_flush", S), ("prefill", N)):
        inputs = _io(state.graphs[name].inputs)
        assert {f"past.{kind}.{i}" for i in range(layers) for kind in ("key", "value")} <= set(inputs), name
        assert not any(n.startswith("cache.") for n in inputs), name
    before_heads = {name: [(t.name, t.shape) for t in state.graphs[name].outputs if not t.name.startswith("present.")]
                    for name in ("step", "step_flush", "prefill")}

    assert "cache_io" in after.facts and "layer_presents" not in after.facts
    for name in ("step", "step_flush"):
        inputs = _io(after.graphs[name].inputs)
        caches = {n: s for n, s in inputs.items() if n.startswith("cache.")}
        assert caches == {f"cache.{kind}.{j}": [P, KVH, "context", HD] for j in range(S) for kind in ("key", "value")}
        assert not any(n.startswith("past.") for n in inputs)
        outputs = _io(after.graphs[name].outputs)
        assert outputs["new_key"] == outputs["new_value"] == [S, P, KVH, 1, HD]
        assert not any(n.startswith("present.") for n in outputs)
    prefill_inputs = _io(after.graphs["prefill"].inputs)
    prefill_caches = {n: s for n, s in prefill_inputs.items() if n.startswith("cache.")}
    assert sorted(prefill_caches) == sorted(f"cache.{kind}.{layer}" for layer in range(N) for kind in ("key", "value"))
    for name, shape in prefill_caches.items():  # [1, kvh, T, hd]; the leading dim is left symbolic (contract: *)
        assert shape[0] in (1, "batch") and shape[1:] == [KVH, "context", HD], (name, shape)
    prefill_out = _io(after.graphs["prefill"].outputs)
    assert prefill_out["new_key"] == prefill_out["new_value"] == [N, "batch", KVH, "chunk", HD]
    # The head outputs come first and are unchanged.
    for name, heads in before_heads.items():
        assert [(t.name, t.shape) for t in after.graphs[name].outputs][:len(heads)] == heads, name


def test_kv_cache_is_a_pure_rewiring(before_kv_cache, after_kv_cache):
    state, after_state = before_kv_cache, after_kv_cache
    step_feeds = _step_feeds(seed=8)
    prefill_feeds = _prefill_feeds(seed=9, length=4, start=3)
    before = {name: _run(state.graphs[name], step_feeds) for name in ("step", "step_flush")}
    before["prefill"] = _run(state.graphs["prefill"], prefill_feeds)

    renamed = lambda feeds: {k.replace("past.", "cache.", 1): v for k, v in feeds.items()}  # noqa: E731
    after = {name: _run(after_state.graphs[name], renamed(step_feeds)) for name in ("step", "step_flush")}
    after["prefill"] = _run(after_state.graphs["prefill"], renamed(prefill_feeds))

    for name, layers, rows_shape in (("step", S, (S, P, KVH, 1, HD)), ("step_flush", S, (S, P, KVH, 1, HD)),
                                     ("prefill", N, (N, 1, KVH, 4, HD))):
        for kind in ("key", "value"):
            stacked = after[name][f"new_{kind}"]
            assert stacked.shape == rows_shape, (name, kind)
            for j in range(layers):
                present = before[name][f"present.{kind}.{j}"]  # [rows, kvh, L, hd]
                for row in range(rows_shape[1]):  # slot s (step) / the one batch row (prefill)
                    np.testing.assert_array_equal(stacked[j, row], present[row], err_msg=f"{name} new_{kind}[{j}, {row}]")
        for key, value in before[name].items():  # every other output: the same values
            if not key.startswith("present."):
                np.testing.assert_array_equal(after[name][key], value, err_msg=f"{name} {key}")
        assert set(after[name]) == {k for k in before[name] if not k.startswith("present.")} | {"new_key", "new_value"}


def test_kv_cache_refuses_without_programs_and_twice(analysed, after_kv_cache):
    with pytest.raises(BuildError) as error:
        run_passes(_before(analysed, "step_graph"), ["kv_cache"])
    message = str(error.value)
    assert "\n" not in message and "pass kv_cache" in message and "step_graph" in message
    with pytest.raises(BuildError) as error:
        run_passes(_fork(after_kv_cache), ["kv_cache"])  # its presents are gone: a second run would stack nothing
    message = str(error.value)
    assert "\n" not in message and "pass kv_cache" in message and "kv_cache ran before it" in message


# ---- cache_writer ------------------------------------------------------------------------------------

def _scatter_reference(cache: np.ndarray, new: np.ndarray, write_start: np.ndarray) -> np.ndarray:
    """cache [S, P, kvh, T, hd]; new [S, P, kvh, L, hd] (stage-major): rows write_start[p] .. +L-1 of (j, p)."""
    out = cache.copy()
    length = new.shape[3]
    for j in range(cache.shape[0]):
        for p in range(cache.shape[1]):
            out[j, p, :, write_start[p]:write_start[p] + length] = new[j, p]
    return out


def _written_mask(capacity: int, length: int, write_start: np.ndarray) -> np.ndarray:
    """[S, P, kvh, T, hd] bool: the rows the writer may change."""
    mask = np.zeros((S, P, KVH, capacity, HD), bool)
    for p, start in enumerate(write_start):
        mask[:, p, :, start:start + length] = True
    return mask


def _run_writer(graph: gs.Graph, cache: dict, new: dict, write_start: np.ndarray) -> dict[str, np.ndarray]:
    feeds = {"cache.key": cache["key"], "cache.value": cache["value"], "new_key": new["key"], "new_value": new["value"],
             "write_start": write_start}
    return _run(graph, feeds)


def test_cache_writer_adds_the_writer_graphs(before_cache_writer, after_cache_writer):
    programs = {name: (len(g.nodes), _io(g.inputs), _io(g.outputs)) for name, g in before_cache_writer.graphs.items()}
    after = after_cache_writer
    assert set(after.graphs) == set(programs) | {"cache_write_step", "cache_write_prefill"}
    assert "cache_writers" in after.facts
    for name, (nodes, inputs, outputs) in programs.items():  # the programs are untouched
        graph = after.graphs[name]
        assert (len(graph.nodes), _io(graph.inputs), _io(graph.outputs)) == (nodes, inputs, outputs), name
    full = [S, P, KVH, "capacity", HD]
    for name, rows in (("cache_write_step", [S, P, KVH, "chunk", HD]), ("cache_write_prefill", [P, S, KVH, "chunk", HD])):
        graph = after.graphs[name]
        assert _io(graph.inputs) == {"cache.key": full, "cache.value": full, "new_key": rows, "new_value": rows,
                                     "write_start": [P]}, name
        assert _io(graph.outputs) == {"cache.key.out": full, "cache.value.out": full}, name
        assert _ops(graph, "ScatterND") == 2, name  # in place: no Concat / copy of the cache


def test_cache_writer_does_not_depend_on_the_programs(analysed):
    # It needs only the schedule: run straight after it (no step graph yet), it still writes both graphs.
    state = run_passes(_before(analysed, "step_graph"), ["cache_writer"])[0]
    assert {"cache_write_step", "cache_write_prefill"} <= set(state.graphs)


def test_cache_writer_refuses_without_a_schedule(analysed):
    state = _before(analysed, "schedule")  # trace and share only
    with pytest.raises(BuildError) as error:
        run_passes(state, ["cache_writer"])
    message = str(error.value)
    assert "\n" not in message and "pass cache_writer" in message and "schedule" in message


@pytest.mark.parametrize("length", [1, 3])
def test_cache_write_step_scatters_only_the_new_rows(after_cache_writer, length):
    graph = after_cache_writer.graphs["cache_write_step"]
    capacity = 10  # T + 1: the runtime's scratch row is the last
    rng = np.random.default_rng(10 + length)
    cache = {k: rng.standard_normal((S, P, KVH, capacity, HD)).astype(np.float32) for k in ("key", "value")}
    new = {k: rng.standard_normal((S, P, KVH, length, HD)).astype(np.float32) for k in ("key", "value")}  # [S, P, kvh, L, hd]
    write_start = np.array([6, 5, 2], dtype=np.int64)  # [P]: a different row per slot
    out = _run_writer(graph, cache, new, write_start)
    mask = _written_mask(capacity, length, write_start)
    for kind in ("key", "value"):
        got = out[f"cache.{kind}.out"]
        np.testing.assert_array_equal(got, _scatter_reference(cache[kind], new[kind], write_start), err_msg=kind)
        np.testing.assert_array_equal(got[~mask], cache[kind][~mask], err_msg=f"{kind}: rows outside the window")
        assert (got[mask] != cache[kind][mask]).all(), kind  # every row in the window was written


def test_cache_write_step_bubble_writes_only_the_scratch_row(after_cache_writer):
    graph = after_cache_writer.graphs["cache_write_step"]
    capacity = 10
    scratch = capacity - 1
    rng = np.random.default_rng(12)
    cache = {k: rng.standard_normal((S, P, KVH, capacity, HD)).astype(np.float32) for k in ("key", "value")}
    new = {k: rng.standard_normal((S, P, KVH, 1, HD)).astype(np.float32) for k in ("key", "value")}
    write_start = np.array([3, scratch, scratch], dtype=np.int64)  # slot 0 valid; slots 1, 2 are bubbles
    out = _run_writer(graph, cache, new, write_start)
    for kind in ("key", "value"):
        got, old = out[f"cache.{kind}.out"], cache[kind]
        for p in (1, 2):
            np.testing.assert_array_equal(got[:, p, :, :scratch], old[:, p, :, :scratch], err_msg=f"{kind} bubble {p}")
            np.testing.assert_array_equal(got[:, p, :, scratch], new[kind][:, p, :, 0], err_msg=f"{kind} scratch {p}")
        np.testing.assert_array_equal(got[:, 0, :, 3], new[kind][:, 0, :, 0])
        np.testing.assert_array_equal(np.delete(got[:, 0], 3, axis=2), np.delete(old[:, 0], 3, axis=2))


def test_cache_write_prefill_maps_layers_slot_major(after_cache_writer):
    graph = after_cache_writer.graphs["cache_write_prefill"]
    capacity, length = 10, 3
    rng = np.random.default_rng(13)
    cache = {k: rng.standard_normal((S, P, KVH, capacity, HD)).astype(np.float32) for k in ("key", "value")}
    # What the prefill graph returns: [N, 1, kvh, L, hd], logical layer l on axis 0.
    prefill_rows = {k: rng.standard_normal((N, 1, KVH, length, HD)).astype(np.float32) for k in ("key", "value")}
    # The runtime binds the same memory as [P, S, kvh, L, hd]: layer l = slot * S + j.
    slot_major = {k: v.reshape(P, S, KVH, length, HD) for k, v in prefill_rows.items()}
    for start in (np.array([4, 4, 4]), np.array([0, 2, 7])):  # the runtime's np.full(P, start); per-slot starts
        write_start = start.astype(np.int64)
        out = _run_writer(graph, cache, slot_major, write_start)
        mask = _written_mask(capacity, length, write_start)
        for kind in ("key", "value"):
            got, old = out[f"cache.{kind}.out"], cache[kind]
            for p in range(P):
                for j in range(S):
                    layer = p * S + j  # logical layer run by slot p at stage layer j
                    rows = got[j, p, :, write_start[p]:write_start[p] + length]  # [kvh, L, hd]
                    np.testing.assert_array_equal(rows, prefill_rows[kind][layer, 0], err_msg=f"{kind} layer {layer}")
            np.testing.assert_array_equal(got[~mask], old[~mask], err_msg=f"{kind}: rows outside the window")
            stage_major = prefill_rows[kind].reshape(P, S, KVH, length, HD).transpose(1, 0, 2, 3, 4)
            np.testing.assert_array_equal(got, _scatter_reference(old, stage_major, write_start))


def test_untie_head_gives_a_tied_head_its_own_view():
    """Before: the embedding's Gather and the head's Gemm read one initializer (ONNX Runtime then
    cannot prepack the head); after: the Gemm reads a view of the same bytes. Weights that only Gemms
    share (the plain graph's loops) stay as they are."""
    from speedc.passes.source_weights import SameBytes
    from speedc.passes.untie_head import untie_graph

    embedding = gs.Constant("model.embed_tokens.weight", np.arange(12, dtype=np.float32).reshape(6, 2))
    block = gs.Constant("model.blocks.0.mlp.down_proj.weight", np.ones((2, 2), np.float32))
    ids, rows = gs.Variable("ids", np.int64, [1]), gs.Variable("rows", np.float32, ["r", 2])
    embedded, looped, again, logits = (gs.Variable(n, np.float32) for n in ("embedded", "looped", "again", "logits"))
    nodes = [gs.Node("Gather", inputs=[embedding, ids], outputs=[embedded]),
             gs.Node("Gemm", inputs=[rows, block], outputs=[looped], attrs={"transB": 1}),
             gs.Node("Gemm", inputs=[looped, block], outputs=[again], attrs={"transB": 1}),
             gs.Node("Gemm", inputs=[again, embedding], outputs=[logits], attrs={"transB": 1})]
    graph = gs.Graph(nodes=nodes, inputs=[ids, rows], outputs=[embedded, logits])
    assert untie_graph(graph) == 1
    head = nodes[3].inputs[1]
    assert head.name == "tied_head.model.embed_tokens.weight" and isinstance(head._values, SameBytes)
    assert head._values.view_of == embedding.name and np.array_equal(head.values, embedding.values)
    assert nodes[0].inputs[0] is embedding and nodes[1].inputs[1] is nodes[2].inputs[1] is block


def test_untie_head_in_an_artifact_stores_no_bytes_twice(tiny_artifact):
    import onnx

    from speedc.artifact import read_manifest

    index = read_manifest(tiny_artifact).weights["index"]
    view, embedding = index["tied_head.model.embed_tokens.weight"], index["model.embed_tokens.weight"]
    assert view["within"] == "model.embed_tokens.weight" and view["offset"] == embedding["offset"]
    step = onnx.load(str(tiny_artifact / "step.gqa.onnx"), load_external_data=False)
    readers = {node.op_type: list(node.input) for node in step.graph.node if node.op_type in ("Gather", "Gemm")
               and "embed_tokens" in " ".join(node.input)}
    assert readers == {"Gather": ["model.embed_tokens.weight", "input_ids"],
                       "Gemm": ["head_rows", "tied_head.model.embed_tokens.weight"]}
