"""Before/after tests of the lowering passes exit_heads and kv_cache (and the batch step's heads), each on its own.

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
from speedc.models.checkpoint.torch_io import sources_from_state
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


def _step_feeds(seed: int) -> dict[str, np.ndarray]:
    """Batch step inputs of one sequence (n = 1, row s = slot s): slot s holds position pos - s; random cache
    rows (rows above a slot's position are masked); the oldest slot's final head, slot 0's exit head."""
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, V, size=(1, 1)),  # [1, 1]
             "positions": np.array([6, 5, 4], dtype=np.int64),  # [P]
             "hidden_in": rng.standard_normal((P - 1, 1, H)).astype(np.float32),  # [P-1, 1, H]
             "final_rows": np.array([P - 1]), "exit_rows": np.array([0]),
             "check_rows": np.zeros(0, np.int64), "check_candidates": np.zeros((0, 8), np.int64)}
    for j in range(S):
        for kind in ("key", "value"):
            for s in range(P):
                feeds[f"cache.{kind}.{j}.{s}"] = rng.standard_normal((1, KVH, T, HD)).astype(np.float32)  # [n, kvh, T, hd]
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
# kv_cache directly follows exit_heads (_next_state checks it), so its state before is the state after exit_heads.
before_exit_heads = _module_state("before_exit_heads", lambda analysed: _before(analysed, "exit_heads"))
after_exit_heads = _module_state("after_exit_heads", lambda before_exit_heads: _run_one(before_exit_heads, "exit_heads"))
inner_before_exit_heads = _module_state("inner_before_exit_heads",
                                        lambda inner_exit_analysed: _before(inner_exit_analysed, "exit_heads"))
inner_after_exit_heads = _module_state("inner_after_exit_heads",
                                       lambda inner_before_exit_heads: _run_one(inner_before_exit_heads, "exit_heads"))
before_kv_cache = _module_state("before_kv_cache",
                                lambda after_exit_heads: _next_state("exit_heads", after_exit_heads, "kv_cache"))
after_kv_cache = _module_state("after_kv_cache", lambda before_kv_cache: _run_one(before_kv_cache, "kv_cache"))


# ---- exit_heads --------------------------------------------------------------------------------------

def test_exit_heads_outputs_before_after(model, before_exit_heads, after_exit_heads):
    before, after = before_exit_heads, after_exit_heads
    # Before: the prefill graph still has the traced heads and every layer's hidden state; the batch step
    # (its own heads from batch_step_graph) is there too.
    assert set(before.graphs) == {"prefill", "batch_step"}
    prefill_before = [t.name for t in before.graphs["prefill"].outputs]
    assert {"logits", "exit_logits"} <= set(prefill_before)
    assert {f"hidden.{layer}" for layer in range(N)} <= set(prefill_before)
    assert {f"present.{kind}.{layer}" for layer in range(N) for kind in ("key", "value")} <= set(prefill_before)
    lm_head = _lm_head_name(model)

    assert set(after.graphs) == {"prefill", "batch_step"} and "heads" in after.facts
    prefill = _io(after.graphs["prefill"].outputs)  # traced heads and per-layer hidden states are gone
    assert list(prefill) == ["next_token", "logits", *(n for n in prefill_before if n.startswith("present."))]
    assert prefill["next_token"] == ["batch"] and prefill["logits"] == ["batch", V]  # a row per sequence
    # The batch step is untouched; the prefill gains chunk_lengths, nothing else.
    for side in ("inputs", "outputs"):
        assert _io(getattr(after.graphs["batch_step"], side)) == _io(getattr(before.graphs["batch_step"], side))
    assert set(_io(after.graphs["prefill"].inputs)) == set(_io(before.graphs["prefill"].inputs)) | {"chunk_lengths"}
    # One LM-head Gemm per program: in the batch step it serves the final and the exit rows at once.
    for name in ("batch_step", "prefill"):
        readers = [n for n in after.graphs[name].nodes if any(i.name == lm_head for i in n.inputs)]
        assert [n.op for n in readers if n.op != "Gather"] == ["Gemm"], name  # (Gather: the tied embedding, check rows)


def test_exit_heads_lm_head_read_once_untied(inner_after_exit_heads):
    after = inner_after_exit_heads
    for name in ("batch_step", "prefill"):
        readers = [n.op for n in after.graphs[name].nodes if any(i.name == "lm_head.weight" for i in n.inputs)]
        assert [op for op in readers if op != "Gather"] == ["Gemm"], name  # (Gather: the check rows' candidates)


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
    state = _before(analysed, "batch_step_graph")  # schedule done, no prefill / batch step programs yet
    with pytest.raises(BuildError) as error:
        run_passes(state, ["exit_heads"])
    message = str(error.value)
    assert "\n" not in message and "pass exit_heads" in message and "batch_step_graph" in message
    assert set(state.graphs) == {"decode"}  # nothing ran


def test_exit_heads_refuses_to_run_after_kv_cache(before_exit_heads):
    state = run_passes(_fork(before_exit_heads), ["kv_cache"])[0]
    with pytest.raises(BuildError) as error:
        run_passes(state, ["exit_heads"])
    message = str(error.value)
    assert "\n" not in message and "pass exit_heads" in message and "kv_cache ran before it" in message


# ---- kv_cache ----------------------------------------------------------------------------------------

def test_kv_cache_io_before_after(before_kv_cache, after_kv_cache):
    state, after = before_kv_cache, after_kv_cache
    # Before: per-layer past.* inputs of the prefill (the batch step's slabs are named by batch_step_graph),
    # per-layer present.* outputs of both.
    inputs = _io(state.graphs["prefill"].inputs)
    assert {f"past.{kind}.{i}" for i in range(N) for kind in ("key", "value")} <= set(inputs)
    assert not any(n.startswith("cache.") for n in inputs)
    for name, layers in (("batch_step", S), ("prefill", N)):
        outputs = _io(state.graphs[name].outputs)
        assert {f"present.{kind}.{i}" for i in range(layers) for kind in ("key", "value")} <= set(outputs), name
    before_heads = {name: [(t.name, t.shape) for t in state.graphs[name].outputs if not t.name.startswith("present.")]
                    for name in ("batch_step", "prefill")}

    assert "cache_io" in after.facts and "layer_presents" not in after.facts
    assert _io(after.graphs["batch_step"].inputs) == _io(state.graphs["batch_step"].inputs)
    step_out = _io(after.graphs["batch_step"].outputs)
    assert step_out["new_key"] == step_out["new_value"] == [S, "rows", KVH, 1, HD]
    assert not any(n.startswith("present.") for n in step_out)
    prefill_inputs = _io(after.graphs["prefill"].inputs)
    assert not any(n.startswith("past.") for n in prefill_inputs)
    prefill_caches = {n: s for n, s in prefill_inputs.items() if n.startswith("cache.")}
    assert sorted(prefill_caches) == sorted(f"cache.{kind}.{layer}" for layer in range(N) for kind in ("key", "value"))
    for name, shape in prefill_caches.items():  # [B, kvh, T, hd]; the leading dim is left symbolic (contract: *)
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
    before = {"batch_step": _run(state.graphs["batch_step"], step_feeds), "prefill": _run(state.graphs["prefill"], prefill_feeds)}

    renamed = {k.replace("past.", "cache.", 1): v for k, v in prefill_feeds.items()}
    after = {"batch_step": _run(after_state.graphs["batch_step"], step_feeds), "prefill": _run(after_state.graphs["prefill"], renamed)}

    for name, layers, rows_shape in (("batch_step", S, (S, P, KVH, 1, HD)), ("prefill", N, (N, 1, KVH, 4, HD))):
        for kind in ("key", "value"):
            stacked = after[name][f"new_{kind}"]
            assert stacked.shape == rows_shape, (name, kind)
            for j in range(layers):
                present = before[name][f"present.{kind}.{j}"]  # [rows, kvh, L, hd]
                for row in range(rows_shape[1]):  # row s = slot s (batch step, n = 1) / the one batch row (prefill)
                    np.testing.assert_array_equal(stacked[j, row], present[row], err_msg=f"{name} new_{kind}[{j}, {row}]")
        for key, value in before[name].items():  # every other output: the same values
            if not key.startswith("present."):
                np.testing.assert_array_equal(after[name][key], value, err_msg=f"{name} {key}")
        assert set(after[name]) == {k for k in before[name] if not k.startswith("present.")} | {"new_key", "new_value"}


def test_kv_cache_refuses_without_programs_and_twice(analysed, after_kv_cache):
    with pytest.raises(BuildError) as error:
        run_passes(_before(analysed, "batch_step_graph"), ["kv_cache"])
    message = str(error.value)
    assert "\n" not in message and "pass kv_cache" in message and "batch_step_graph" in message
    with pytest.raises(BuildError) as error:
        run_passes(_fork(after_kv_cache), ["kv_cache"])  # its presents are gone: a second run would stack nothing
    message = str(error.value)
    assert "\n" not in message and "pass kv_cache" in message and "kv_cache ran before it" in message


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

    from speedc.format.artifact import read_manifest

    index = read_manifest(tiny_artifact).weights["index"]
    view, embedding = index["tied_head.model.embed_tokens.weight"], index["model.embed_tokens.weight"]
    assert view["within"] == "model.embed_tokens.weight" and view["offset"] == embedding["offset"]
    engine = onnx.load(str(tiny_artifact / "engine.gqa.onnx"), load_external_data=False)
    step = next(a.g for node in engine.graph.node if node.op_type == "If" for a in node.attribute if a.name == "then_branch")
    readers = sorted((node.op_type, list(node.input)) for node in step.node if node.op_type in ("Gather", "Gemm")
                     and "embed_tokens" in " ".join(node.input))
    assert readers == [("Gather", ["model.embed_tokens.weight", "check_candidates"]),  # the check rows' candidates
                       ("Gather", ["model.embed_tokens.weight", "input_ids"]),
                       ("Gemm", ["batch_step/batch_head_rows", "tied_head.model.embed_tokens.weight"])]
