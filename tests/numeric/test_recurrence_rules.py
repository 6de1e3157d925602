"""A recurrent core's loops per request (runtimes/exit_rule.py): Huginn's num_steps and Parcae's recurrence,
run on an artifact built for more, against oracles written from the published code with that recurrence.

    huginn-random   prelude 2, core 2 x 4, coda 2, random weights: drafts mostly flushed; P = 4 and P = 2
    huginn-settled  prelude 1, core 2 x 4, coda 1, the adapter near [I | 0]: drafts mostly hold; P = 4
    parcae-settled  prelude 2, core 2 x 8, coda 2, small weights: drafts mostly hold; P = 4 (two repeats a slot)
    parcae-random   the published decay, larger weights: P = 8

For every loop count up to the built one (where a slot runs several repeats, counts that end inside a slot
too): greedy ids of SPEED == plain decoding with that count == the oracle's (the whole sequence recomputed a token with that recurrence,
the prompt's too); seeded sampling SPEED == plain; sequences of different counts and of the full depth decode
together as each alone (one prefill and one step read out at different depths); a random start state
follows the rule too. The prefill reads out at the request's depth (contract.READOUT_REPEATS): without it the
coda K/V of the prompt are the full depth's and the ids differ (a test shows it); prompt log-probabilities
under a count are that depth's. Then the refusals by name.
"""

from __future__ import annotations

import json

import pytest
import torch

import huginn_checkpoints as huginn
import parcae_checkpoints as parcae
from conftest import assert_one_line_error, run_cli
from speedc.build import build
from speedc.errors import GenerationError
from speedc.passes.base import BuildOptions
from speedc.runtimes.engine import Engine

NEW_TOKENS = 10
PROMPTS = ([5, 7, 9, 11, 3, 40], [8, 1, 4])
MODELS = {  # name -> (oracle module, checkpoint options, slots built, whether its drafts mostly hold)
    "huginn-random": (huginn, dict(seed=5, prelude=2, coda=2), (4, 2), False),
    "huginn-settled": (huginn, dict(seed=6, layer_scale=0.03, adapter_identity=1.0), (4,), True),
    "parcae-settled": (parcae, dict(seed=6, layer_scale=0.03, decay=0.2, weights_file="model.safetensors"), (4,), True),
    "parcae-random": (parcae, dict(seed=5, weights_file="model.safetensors"), (8,), False),
}


class Model:
    def __init__(self, root, name: str) -> None:
        self.module, options, slots, self.settles = MODELS[name]
        self.checkpoint = self.module.write_checkpoint(root / "ckpt", **options)
        self.tensors = self.module.load_tensors(self.checkpoint)
        self.config = json.loads((self.checkpoint / "config.json").read_text())
        self.repeats = self.config["mean_recurrence"]
        self.artifacts = {p: build(self.checkpoint, root / f"art{p}", BuildOptions(slots=p)).out for p in slots}
        self.engines = {p: Engine.load(path, lazy=True) for p, path in self.artifacts.items()}

    def oracle(self, prompt: list[int], loops: int, new_tokens: int = NEW_TOKENS, seed: int | None = None) -> list[int]:
        return [int(t) for t in self.module.oracle_greedy(self.tensors, {**self.config, "mean_recurrence": loops},
                                                          prompt, new_tokens, seed=seed)]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory) -> Model:
    return Model(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_speed_equals_plain_equals_oracle(model):
    accepted = flushed = 0
    for slots, engine in model.engines.items():
        for loops in range(1, model.repeats + 1):
            for prompt in PROMPTS:
                expected = model.oracle(prompt, loops)
                runs = {mode: engine.generate(prompt, max_new_tokens=NEW_TOKENS, mode=mode, stop_at_eos=False, loops=loops)
                        for mode in ("speed-always", "speed", "autoregressive")}
                for mode, result in runs.items():
                    assert result.ids == expected, (slots, loops, mode)
                    assert result.stats.depth_rule == f"{loops} loop{'s' * (loops > 1)}, last loop"
                    assert result.stats.exit_loops == {loops - 1: NEW_TOKENS}
                accepted += runs["speed-always"].stats.accepted
                flushed += runs["speed-always"].stats.mispredicted
                plain = runs["autoregressive"].stats  # the prefill, then the plain program, read out after LOOPS
                assert plain.plain_steps == plain.steps == NEW_TOKENS - 1 and plain.speed_steps == 0
    assert (accepted if model.settles else flushed) > 0, (accepted, flushed)  # the path its weights are for ran


def test_fewer_loops_change_the_continuation(model):
    """The guard of the test above: the oracle's ids at the shallowest count differ from the full depth's."""
    shallowest = model.repeats // max(model.engines)
    assert any(model.oracle(p, shallowest) != model.oracle(p, model.repeats) for p in PROMPTS)


def test_seeded_sampling_speed_equals_plain(model):
    engine, loops = model.engines[min(model.engines)], model.repeats - 1
    for seed in (11, 12):
        runs = [engine.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, mode=mode, temperature=0.9, top_p=0.95, seed=seed,
                                stop_at_eos=False, loops=loops) for mode in ("speed-always", "autoregressive")]
        assert runs[0].ids == runs[1].ids, seed


def test_batch_mixes_loop_counts_and_full_depth(model):
    """Different counts in one prefill and one step (each sequence's readout its own, inside a slot where a
    slot runs several repeats), beside the full depth, one prompt a single token: each as the oracle says."""
    engine = model.engines[min(model.engines)]
    counts = [1, None, model.repeats - 1]
    prompts = [PROMPTS[0], PROMPTS[1], [7]]
    settings = [{} if loops is None else {"loops": loops} for loops in counts]
    together = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, settings=settings, max_batch=3)
    for prompt, loops, result in zip(prompts, counts, together):
        assert result.ids == model.oracle(prompt, model.repeats if loops is None else loops), loops


def test_plain_batch_mixes_loop_counts(model):
    """Plain decoding of different counts in one plain step (each row's readout its own), beside the full depth."""
    engine = model.engines[min(model.engines)]
    counts = [1, None, model.repeats - 1]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][::-1]]
    settings = [{} if loops is None else {"loops": loops} for loops in counts]
    together = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, settings=settings, max_batch=3,
                                     row_budget=0)
    for prompt, loops, result in zip(prompts, counts, together):
        assert result.ids == model.oracle(prompt, model.repeats if loops is None else loops), loops
        assert result.stats.speed_steps == 0


def test_a_counts_own_failure_ends_it_alone(model):
    """One request's own failure (its picker: a stand-in for a grammar's) in a batch mixing counts and the full
    depth, speculating and not (speed steps, plain steps, and the pick after the prefill): it alone ends with its
    error; the others equal the oracle."""
    from conftest import FailsAtPick
    from speedc.runtimes.sequence import DONE

    engine = model.engines[min(model.engines)]
    counts, fails_at = [1, None, model.repeats - 1], {0: 1, 2: 4}  # pick 1: the prefill's; pick 4: a step's
    for row_budget in (None, 0):
        scheduler = engine.batch_scheduler(max_batch=3, row_budget=row_budget)
        requests = [engine.request_from(PROMPTS[0], dict(max_new_tokens=NEW_TOKENS, stop_at_eos=False,
                                                         **({} if loops is None else {"loops": loops})))
                    for loops in counts]
        for i, k in fails_at.items():
            requests[i].picker = FailsAtPick(requests[i].picker, k)
        sequences = [scheduler.submit(request) for request in requests]
        scheduler.run()
        for i, (loops, sequence) in enumerate(zip(counts, sequences)):
            expected = model.oracle(PROMPTS[0], model.repeats if loops is None else loops)
            if i in fails_at:
                assert sequence.state == DONE and str(sequence.error) == f"scripted failure at pick {fails_at[i]}"
                assert sequence.out == expected[:fails_at[i] - 1], (row_budget, loops)
            else:
                assert sequence.error is None and sequence.out == expected, (row_budget, loops)
        assert not scheduler.occupied and not scheduler.waiting


def test_prompt_logprobs_at_the_requests_depth(model):
    """Prompt log-probabilities under a count are its depth's (the prefill reads out after LOOPS), the oracle's."""
    engine, loops = model.engines[min(model.engines)], model.repeats - 1
    result = engine.generate(PROMPTS[0], max_new_tokens=2, stop_at_eos=False, loops=loops, prompt_logprobs=1)
    logits = model.module.oracle_logits(model.tensors, {**model.config, "mean_recurrence": loops}, PROMPTS[0])
    expected = torch.log_softmax(logits, dim=-1)  # [L, V] float64
    got = [entry.logprob for entry in result.prompt_logprobs]
    want = [float(expected[i, token]) for i, token in enumerate(PROMPTS[0][1:])]
    assert got == pytest.approx(want, abs=1e-3)
    assert result.ids == model.oracle(PROMPTS[0], loops, new_tokens=2)


def test_prefill_reads_out_at_the_requests_depth(model, monkeypatch):
    """Without the prefill's readout depth (every row read out after all repeats) the prompt's coda K/V are
    the full depth's, and the continuation at fewer loops is no longer the oracle's."""
    from speedc.runtimes.backends.onnx import BatchBackend

    if model.settles:
        pytest.skip("a settled core's coda reads nearly the same K/V at every depth")
    slots = max(model.engines)
    loops = model.repeats // slots
    prefill = BatchBackend.prefill  # without its readout_repeats: every row read out after all repeats
    monkeypatch.setattr(BatchBackend, "prefill", lambda self, first, chunks, start, want, readout_repeats=None:
                        prefill(self, first, chunks, start, want))
    results = [model.engines[slots].generate(p, max_new_tokens=NEW_TOKENS, stop_at_eos=False, loops=loops).ids
               for p in PROMPTS]
    assert results != [model.oracle(p, loops) for p in PROMPTS]


def test_random_start_state_follows_the_rule(tmp_path):
    """Huginn built with --state-init random: each position's drawn start state, then LOOPS repeats."""
    directory = huginn.write_checkpoint(tmp_path / "ckpt", seed=5)
    tensors, config = huginn.load_tensors(directory), json.loads((directory / "config.json").read_text())
    built = run_cli("build", directory, "-o", tmp_path / "art", "--slots", "4", "--state-init", "random", "--seed", "3",
                    "--no-measure")
    assert built.returncode == 0, built.stderr
    engine = Engine.load(tmp_path / "art", lazy=True)
    expected = [int(t) for t in huginn.oracle_greedy(tensors, {**config, "mean_recurrence": 2}, PROMPTS[0], 8, seed=3)]
    for mode in ("speed-always", "autoregressive"):
        assert engine.generate(PROMPTS[0], max_new_tokens=8, mode=mode, stop_at_eos=False, loops=2).ids == expected


@pytest.fixture(scope="module")
def huginn_p2(tmp_path_factory):
    root = tmp_path_factory.mktemp("huginn-p2")
    directory = huginn.write_checkpoint(root / "ckpt", seed=7)
    return {p: build(directory, root / f"art{p}", BuildOptions(slots=p)).out for p in (2, 1)}


@pytest.mark.parametrize("rule, message", [
    (dict(loops=5), r"loops must be an integer in 1..4 \(the artifact was built for 4\)"),
    (dict(loops=0), "loops must be an integer in 1..4"),
    (dict(loops=2.5), "loops must be an integer in 1..4"),
    (dict(loops=2, exit_at_step=0), "huginn has no exit rules"),
    (dict(exit_threshold=0.5), "huginn has no exit rules"),
    (dict(weighted_exit=True), "huginn has no exit rules"),
])
def test_refusals(huginn_p2, rule, message):
    with pytest.raises(GenerationError, match=message):
        Engine.load(huginn_p2[2], lazy=True).generate(PROMPTS[0], max_new_tokens=4, **rule)


def test_a_plain_build_refuses_loops(huginn_p2):
    with pytest.raises(GenerationError, match=r"artifact is plain \(P = 1\) .*: rebuild it with --slots P"):
        Engine.load(huginn_p2[1], lazy=True).generate(PROMPTS[0], max_new_tokens=4, loops=2)


def test_cli_and_inspect(huginn_p2):
    shown = run_cli("inspect", huginn_p2[2], env={"COLUMNS": "400"})
    assert "depth rules per request: loops 1..4 (the core's repeats, Huginn's num_steps; 2 a pipeline slot)" in shown.stdout
    result = run_cli("generate", huginn_p2[2], "--prompt-ids", "5,7,9", "--max-new-tokens", "6", "--ignore-eos",
                     "--loops", "3", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["depth_rule"] == "3 loops, last loop"
    assert_one_line_error(run_cli("generate", huginn_p2[2], "--prompt-ids", "1,2", "--loops", "5"),
                          "loops must be an integer in 1..4")
