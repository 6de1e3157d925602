"""Family `iquest_loop` (models/families/iquest_loop.py): IQuest-Coder-V1-Loop, checked against an oracle
written from the published modeling code (tests/iquest_checkpoints.py), on a tiny random checkpoint in
the published layout whose loop window (3) is shorter than the sequences, so the window matters.

    reference logits (final and draft) == the oracle's
    the artifact pipelines one loop per slot (P = 2), standard graphs only (no fused variant); P = 1 too
    greedy: batched SPEED ids == batched plain ids == the oracle's, on every backend (ONNX Runtime's two,
            PyTorch); the run both accepts and flushes speculations, so the equalities cover both paths
    seeded sampling: SPEED == plain
    refused options: one line each
"""

from __future__ import annotations

import json

import pytest
import torch

from iquest_checkpoints import IQuestOracle, write_iquest
from looped_checkpoints import batch_plain_and_speed, seeded_prompt
from speedc import Engine
from speedc.build import build
from speedc.errors import CheckpointError
from speedc.format import contract
from speedc.format.artifact import read_manifest
from speedc.models.checkpoint.torch_io import load_model, open_checkpoint
from speedc.models.families import load_config
from speedc.format.depth_plan import DepthPlan
from speedc.passes.base import BuildOptions

LAYERS, VOCAB, WINDOW = 2, 96, 3
PROMPT_LEN, NEW_TOKENS, PROMPT_SEEDS = 6, 12, (0, 1, 2)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = write_iquest(tmp_path_factory.mktemp("iquest") / "ckpt", layers=LAYERS, vocab=VOCAB, window=WINDOW)
    artifact = build(directory, directory.parent / "art", BuildOptions()).out
    return directory, IQuestOracle(directory), artifact


def prompts() -> list[list[int]]:
    return [seeded_prompt(seed, PROMPT_LEN, VOCAB) for seed in PROMPT_SEEDS]


def test_family_reads_the_published_config(case):
    directory, _, _ = case
    cfg = load_config(directory / "config.json")
    assert cfg.architecture == "iquest_loop"
    assert cfg.depth_plan == DepthPlan((), tuple(range(LAYERS)), 2, cross_window=WINDOW)
    assert cfg.layer_map == [0, 1, 0, 1] and cfg.exit_layer == LAYERS and cfg.exit_norm == "final"
    assert cfg.depth_plan.cross_source(LAYERS + 1) == 1 and cfg.depth_plan.cross_source(1) is None


def test_reference_matches_oracle(case):
    directory, oracle, _ = case
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = load_model(directory)(ids, with_exit=True)
    final, draft = oracle.logits(ids[0].tolist()), oracle.logits(ids[0].tolist(), loops_run=1)
    torch.testing.assert_close(ours.logits[0], final, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.exit_logits[0], draft, atol=1e-4, rtol=1e-4)
    assert (final.max(-1).values - final.min(-1).values).min() > 0.5  # not near-constant logits
    oracle.config["loop_window_size"] = 64  # the window matters at this length: wider, other logits
    try:
        assert (oracle.logits(ids[0].tolist()) - final).abs().max() > 1e-2
    finally:
        oracle.config["loop_window_size"] = WINDOW


def test_artifact_pipelines_one_loop_a_slot(case):
    _, _, artifact = case
    manifest = read_manifest(artifact)
    assert manifest.slots == 2
    assert manifest.depth_plan.cross_window == WINDOW
    assert contract.fused(contract.ENGINE) not in manifest.graphs  # two gated attentions: standard graphs only


@pytest.mark.parametrize("backend", ["onnx", "onnx-numpy"])
def test_greedy_and_sampled_ids(case, backend):
    _, oracle, artifact = case
    engine = Engine.load(artifact, backend=backend, lazy=True)
    expected = [oracle.greedy(p, NEW_TOKENS) for p in prompts()]
    plain, speed = batch_plain_and_speed(engine, prompts(), NEW_TOKENS)
    assert [r.ids for r in plain] == expected
    chunked = engine.generate_batch(prompts(), max_new_tokens=NEW_TOKENS, stop_at_eos=False, row_budget=0, max_batch=3,
                                    prefill_chunk=4)  # a second prompt chunk reads the cache and its own rows
    assert [r.ids for r in chunked] == expected
    adaptive = engine.generate_batch(prompts(), max_new_tokens=NEW_TOKENS, stop_at_eos=False, max_batch=3)
    assert [r.ids for r in adaptive] == expected  # the default policy: a sequence may switch between SPEED and plain
    assert {r.stats.mode for r in speed} == {"batch speed"}
    assert [r.ids for r in speed] == expected
    accepted, mispredicted = sum(r.stats.accepted for r in speed), sum(r.stats.mispredicted for r in speed)
    assert accepted > 0 and mispredicted > 0, (accepted, mispredicted)  # kept work and flushes both checked
    settings = [{"temperature": 0.9, "top_p": 0.95, "seed": s} for s in (11, 12, 13)]
    runs = [engine.generate_batch(prompts(), max_new_tokens=NEW_TOKENS, stop_at_eos=False, settings=settings, max_batch=3,
                                  **extra) for extra in ({"row_budget": None, "per_sequence": False}, {"row_budget": 0})]
    assert {r.stats.mode for r in runs[0]} == {"batch speed"}
    assert [r.ids for r in runs[0]] == [r.ids for r in runs[1]]


def test_int4_speed_logprobs_are_plain_decodings_bit_for_bit(tmp_path):
    """At int4 the products round their activations to int8, so logits that differ in their last bits (two
    programs summing the cross-repeat attention apart) come out 1e-2 apart and flip near-tied greedy ids.
    SPEED's log-probabilities must be plain decoding's exactly, on a window wider than the sequences."""
    directory = write_iquest(tmp_path / "ckpt", layers=2, hidden=128, heads=8, kv_heads=2, intermediate=256, vocab=VOCAB,
                             window=64, residual_scale=0.3)
    engine = Engine.load(build(directory, tmp_path / "art", BuildOptions(dtype="int4")).out)
    for seed in PROMPT_SEEDS:
        prompt = seeded_prompt(seed, 8, VOCAB)
        plain, speed = (engine.generate(prompt, max_new_tokens=24, mode=mode, stop_at_eos=False, logprobs=1)
                        for mode in ("autoregressive", "speed-always"))
        assert speed.ids == plain.ids and speed.stats.accepted > 0 and speed.stats.mispredicted > 0
        assert [t.logprob for t in speed.logprobs] == [t.logprob for t in plain.logprobs], seed


def _scheduled(backend, params, speculate: bool) -> list:
    """PROMPTS decoded together on BACKEND by the batch scheduler: speculating at every step, or plain."""
    from speedc.models.sampling import TokenPicker
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import RowPolicy
    from speedc.runtimes.decode import Request

    scheduler = BatchScheduler(backend, policy=RowPolicy(row_budget=None if speculate else 0))
    sequences = [scheduler.submit(Request(list(p), NEW_TOKENS, TokenPicker(params), stop=lambda ids: None))
                 for p in prompts()]
    while scheduler.busy:
        scheduler.step()
    return sequences


def test_torch_backend(case):
    """The PyTorch backend (the CUDA path) runs the same cross read: greedy SPEED == plain == the oracle's,
    with both accepted and flushed speculations; seeded sampling SPEED == plain."""
    from speedc.models.sampling import SamplingParams
    from speedc.runtimes.backends.torch_backend import TorchBackend

    _, oracle, artifact = case
    backend = TorchBackend(artifact, read_manifest(artifact), max_batch=3)
    expected = [oracle.greedy(p, NEW_TOKENS) for p in prompts()]
    speed, plain = (_scheduled(backend, SamplingParams(), speculate) for speculate in (True, False))
    assert [s.out for s in speed] == [s.out for s in plain] == expected
    assert sum(s.stats.accepted for s in speed) > 0 and sum(s.stats.mispredicted for s in speed) > 0
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=11)
    assert [s.out for s in _scheduled(backend, seeded, True)] == [s.out for s in _scheduled(backend, seeded, False)]


def test_plain_engine_at_p1(case, tmp_path):
    """The other valid depth, P = 1: the prefill program alone, its greedy ids the oracle's."""
    directory, oracle, _ = case
    artifact = build(directory, tmp_path / "plain", BuildOptions(slots=1)).out
    assert read_manifest(artifact).slots == 1
    engine = Engine.load(artifact, backend="onnx-numpy", lazy=True)
    results = engine.generate_batch(prompts(), max_new_tokens=NEW_TOKENS, stop_at_eos=False, max_batch=3)
    assert [r.ids for r in results] == [oracle.greedy(p, NEW_TOKENS) for p in prompts()]


@pytest.mark.parametrize("key, value, named", [
    ("loop_num", 3, "loop_num=3"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("dual_chunk_attention_config", {"chunk_size": 8}, "dual_chunk_attention_config"),
    ("head_dim", 8, "head_dim=8 differs"),
    ("loop_window_size", 0, "loop_window_size must be a positive integer"),
])
def test_refused_options_are_one_line(tmp_path, key, value, named):
    directory = write_iquest(tmp_path / "ckpt", layers=1, vocab=VOCAB, extra_config={key: value})
    with pytest.raises(CheckpointError) as error:
        load_config(directory / "config.json")
    assert "\n" not in str(error.value) and named in str(error.value)


@pytest.mark.parametrize("change, named", [
    ("drop", "missing tensor model.gate_projections.0.bias"),
    ("reshape", "model.gate_projections.0.weight has shape [4, 8] but config.json implies [4, 16]"),
])
def test_bad_gate_tensor_is_one_line(tmp_path, change, named):
    """A gate missing (and left out of the index), or of the wrong shape: one line naming it."""
    from safetensors.torch import load_file, save_file

    directory = write_iquest(tmp_path / "ckpt", layers=1, vocab=VOCAB)
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = directory / data["weight_map"]["model.gate_projections.0.bias"]
    tensors = load_file(str(shard))
    if change == "drop":
        del tensors["model.gate_projections.0.bias"], data["weight_map"]["model.gate_projections.0.bias"]
        index.write_text(json.dumps(data))
    else:
        tensors["model.gate_projections.0.weight"] = tensors["model.gate_projections.0.weight"][:, :8].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        open_checkpoint(directory)
    assert "\n" not in str(error.value) and named in str(error.value)


def test_memory_bound_shape_in_the_published_layout():
    """`speedc bench memory-bound --shape iquest-loop` at a tiny size: the random checkpoint is written in
    the published layout (gates included), built, and SPEED's ids equal plain decoding's at P = 2; the
    published shape counts the 40B model's parameters."""
    from speedc.bench.synthetic import SHAPES, Shape, pipeline_depths, synthetic_step_costs

    tiny = Shape("iquest-tiny", 64, 4, 2, 16, 96, 128, 2, 2, looped=False, cross_window=4)
    assert pipeline_depths(tiny, 2) == [2]
    report = synthetic_step_costs(shape=tiny, context=64, repeats=3, end_to_end=True, new_tokens=10, prompts=2)
    assert [row["slots"] for row in report["rows"]] == [2] and report["rows"][0]["ids_identical"]
    assert report["end_to_end"]["identical_ids"]
    shape = SHAPES["iquest-loop"]
    assert 39e9 < shape.layers * shape.block_params() + shape.fixed_params() < 41e9
