"""Ouro's own depth rules per request (runtimes/exit_rule.py) against an oracle of the published forward.

The oracle is OuroForCausalLM.forward's logits choice, written here from the published code over the
Ouro oracle's loop states (test_looped_checkpoints.OuroOracle, itself transformers' Llama parts):

    gate_i = early_exit_gate(h_i); lambda_i = sigmoid(gate_i)
    p_i = lambda_i * remaining, remaining *= (1 - lambda_i)   (i < n-1);   p_{n-1} = remaining
    exit_at_step k      lm_head(h_k)
    exit_threshold t    exit_steps = argmax(cumsum(p) >= t) (the last loop where none is), lm_head(gather(h, exit_steps))
    use_weighted_exit   sum_i lm_head(h_i) * p_i
    total_ut_steps n    the loops run (the rules over loops 0..n-1)

Checked, on the ONNX and PyTorch backends: greedy ids of SPEED == plain decoding with the same rule == the
oracle's greedy continuation (whole sequence recomputed a token, no cache), and seeded sampling SPEED == plain,
for every rule and loop count, on a checkpoint whose gate is scaled so that exits happen at every loop (a
guard asserts they do) and whose loops disagree (drafts are flushed: a guard asserts that too). Then the
refusals by name: a family without the rule, a loop count above the build, a rule out of range, two rules.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_one_line_error, run_cli
from looped_checkpoints import rewrite_tensors, write_nanbeige, write_ouro
from speedc.build import build
from speedc.errors import GenerationError
from speedc.passes.base import BuildOptions
from speedc.runtimes.engine import Engine
from test_looped_checkpoints import NanbeigeOracle, OuroOracle

LOOPS, VOCAB, PROMPT_LEN, NEW_TOKENS = 4, 128, 6, 16
PROMPT_SEEDS = (0, 1)
GATE_SCALE, GATE_BIAS = 1.0, -1.0  # spreads lambda over (0, 1): a threshold of 0.5 exits at every loop
RULES = [dict(exit_at_step=0), dict(exit_at_step=2), dict(exit_threshold=0.5), dict(weighted_exit=True),
         dict(loops=2), dict(loops=3, exit_threshold=0.4), dict(loops=1)]
BACKENDS = ("onnx", "onnx-numpy", "torch")  # fused graphs, standard graphs, PyTorch


def oracle_logits(oracle: OuroOracle, ids: torch.Tensor, *, loops: int = LOOPS, exit_at_step: int | None = None,
                  exit_threshold: float | None = None, weighted_exit: bool = False) -> torch.Tensor:
    """[1, L, V]: the published OuroForCausalLM.forward's logits with these settings."""
    oracle.loops = loops
    try:
        states = oracle.loop_states(ids)  # total_ut_steps loops, each normed
    finally:
        oracle.loops = LOOPS
    with torch.no_grad():
        gates = [oracle.model.early_exit_gate(h) for h in states]
        pdf, remaining = [], torch.ones_like(gates[0].squeeze(-1))
        for i, gate in enumerate(gates):
            lam = torch.sigmoid(gate.squeeze(-1))
            if i < len(gates) - 1:
                pdf.append(lam * remaining)
                remaining = remaining * (1.0 - lam)
            else:
                pdf.append(remaining)
        pdf = torch.stack(pdf, dim=2)  # [1, L, n]
        head = oracle.lm_head
        if exit_at_step is not None:
            return head(states[exit_at_step])
        if exit_threshold is not None:
            mask = torch.cumsum(pdf, dim=2) >= exit_threshold
            steps = torch.argmax(mask.float(), dim=2)
            steps[~mask.any(dim=2)] = len(states) - 1
            stacked = torch.stack(states, dim=2)  # [1, L, n, H]
            index = steps[..., None, None].expand(-1, -1, 1, stacked.size(-1))
            return head(torch.gather(stacked, 2, index).squeeze(2))
        if weighted_exit:
            expected = None
            for i, h in enumerate(states):
                term = head(h) * pdf[..., i:i + 1]
                expected = term if expected is None else expected + term
            return expected
        return head(states[-1])


def oracle_greedy(oracle: OuroOracle, prompt: list[int], rule: dict) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        ids.append(int(oracle_logits(oracle, torch.tensor([ids]), **rule)[0, -1].argmax()))
    return ids[len(prompt):]


def prompt(seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


class Gated:
    """A 2-layer Ouro checkpoint whose loops disagree and whose gate spreads exits over every loop."""

    def __init__(self, root) -> None:
        self.checkpoint = write_ouro(root / "ckpt", layers=2, loops=LOOPS, seed=5, residual_scale=0.3)

        def gate(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if name == "model.early_exit_gate.weight":
                return (tensor.float() * GATE_SCALE).to(tensor.dtype)
            if name == "model.early_exit_gate.bias":
                return torch.full_like(tensor, GATE_BIAS)
            return tensor

        rewrite_tensors(self.checkpoint, gate)
        self.artifact = build(self.checkpoint, root / "art", BuildOptions()).out
        self.oracle = OuroOracle(self.checkpoint)
        self.engines: dict[str, Engine] = {}
        self.greedy: dict = {}

    def engine(self, backend: str) -> Engine:
        if backend not in self.engines:
            self.engines[backend] = Engine.load(self.artifact, backend=backend)
        return self.engines[backend]

    def expected(self, seed: int, rule: dict) -> list[int]:
        key = (seed, tuple(sorted(rule.items())))
        if key not in self.greedy:
            self.greedy[key] = oracle_greedy(self.oracle, prompt(seed), rule)
        return self.greedy[key]


@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> Gated:
    return Gated(tmp_path_factory.mktemp("gated"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_speed_equals_plain_equals_oracle(gated, backend):
    engine = gated.engine(backend)
    exits: dict[int, int] = {}
    flushed = 0
    for rule in RULES:
        for seed in PROMPT_SEEDS:
            expected = gated.expected(seed, rule)
            speed = engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode="speed-always", stop_at_eos=False, **rule)
            plain = engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode="autoregressive", stop_at_eos=False,
                                    **rule)
            assert plain.ids == expected, f"{rule}, prompt seed {seed}: plain decoding differs from the oracle"
            assert speed.ids == expected, f"{rule}, prompt seed {seed}: SPEED differs from the oracle ({speed.stats})"
            assert speed.stats.exit_loops == plain.stats.exit_loops
            assert sum(speed.stats.exit_loops.values()) == NEW_TOKENS
            loops = rule.get("loops", LOOPS)
            assert all(0 <= loop < loops for loop in speed.stats.exit_loops)
            if "exit_at_step" in rule:
                assert speed.stats.exit_loops == {rule["exit_at_step"]: NEW_TOKENS}
            if "exit_threshold" in rule and loops == LOOPS:
                for loop, count in speed.stats.exit_loops.items():
                    exits[loop] = exits.get(loop, 0) + count
            flushed += speed.stats.mispredicted
            assert plain.stats.mispredicted == 0 and plain.stats.accepted == 0  # plain decoding never speculates
    assert sorted(exits) == list(range(LOOPS)), f"the threshold's exits did not reach every loop: {exits}"
    assert flushed > 0, "no draft was ever flushed: the verification at the exit loop went untested"


def test_exit_at_first_loop_never_flushes(gated):
    """Every token is final after loop 0, in the step it enters: its successor enters next, verified (a step a
    token, nothing flushed), and no deeper loop runs."""
    result = gated.engine("onnx").generate(prompt(0), max_new_tokens=NEW_TOKENS, mode="speed-always",
                                           stop_at_eos=False, exit_at_step=0)
    stats = result.stats
    assert stats.mispredicted == stats.flushed_tokens == 0 and stats.steps == NEW_TOKENS  # (the first from the last prompt token)
    assert stats.mode == "speed-always"  # no early-flush checks under a rule
    assert stats.policy == "depth rule: a draft behind every token, verified at its exit"


@pytest.mark.parametrize("rule", [dict(exit_threshold=0.5), dict(weighted_exit=True), dict(loops=3)])
def test_seeded_sampling_speed_equals_plain(gated, rule):
    engine = gated.engine("onnx")
    for seed in (11, 12):
        runs = [engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode=mode, temperature=0.9, top_p=0.95, seed=seed,
                                stop_at_eos=False, **rule) for mode in ("speed-always", "autoregressive")]
        assert runs[0].ids == runs[1].ids, f"{rule}, sampling seed {seed}"


def test_batch_mixes_rules_and_full_depth(gated):
    """Sequences with and without a rule decoded together: each as it decodes alone."""
    engine = gated.engine("onnx")
    settings = [{}, dict(exit_threshold=0.5), dict(exit_at_step=1), dict(loops=2, temperature=0.8, seed=3)]
    prompts = [prompt(seed) for seed in range(len(settings))]
    together = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, settings=settings)
    for text, one, result in zip(prompts, settings, together):
        alone = engine.generate(text, max_new_tokens=NEW_TOKENS, mode="autoregressive", stop_at_eos=False, **one)
        assert result.ids == alone.ids, one


def test_one_token_prompt(gated):
    engine = gated.engine("onnx")
    runs = [engine.generate([7], max_new_tokens=5, mode=mode, stop_at_eos=False, exit_threshold=0.5)
            for mode in ("speed-always", "autoregressive")]
    assert runs[0].ids == runs[1].ids == oracle_greedy(gated.oracle, [7], dict(exit_threshold=0.5))[:5]


@pytest.mark.parametrize("rule, message", [
    (dict(loops=LOOPS + 1), "loops must be an integer in 1..4"),
    (dict(loops=0), "loops must be an integer in 1..4"),
    (dict(exit_at_step=3, loops=3), "exit_at_step must be an integer in 0..2"),
    (dict(exit_threshold=1.5), "exit_threshold must be a number in 0..1"),
    (dict(exit_threshold=0.5, weighted_exit=True), "give one exit rule"),
    (dict(weighted_exit="yes"), "weighted_exit must be True or False"),
    (dict(loops=2, prompt_logprobs=1), "prompt logprobs are the full depth's: they cannot be asked with an exit rule"),
])
def test_refusals(gated, rule, message):
    with pytest.raises(GenerationError, match=message):
        gated.engine("onnx").generate(prompt(0), max_new_tokens=4, **rule)


def test_family_without_the_rule_is_refused(tmp_path):
    """Nanbeige with skip_loop_final_norm: its loops' states are not normed, no loop is a readout."""
    checkpoint = write_nanbeige(tmp_path / "ckpt", layers=1, loops=2, seed=1, skip_loop_final_norm=True)
    artifact = build(checkpoint, tmp_path / "art", BuildOptions()).out
    with pytest.raises(GenerationError, match="nanbeige has no per-request depth rules"):
        Engine.load(artifact).generate([1, 2, 3], max_new_tokens=4, loops=1)


def test_nanbeige_loops_and_exit_step_match_its_oracle(tmp_path):
    """Nanbeige normed after every loop: fewer loops (its num_loops set lower) and an earlier loop read, greedy
    SPEED == plain == the published forward with that many loops; it has no exit gate."""
    checkpoint = write_nanbeige(tmp_path / "ckpt", layers=2, loops=3, seed=2, residual_scale=0.3)
    engine = Engine.load(build(checkpoint, tmp_path / "art", BuildOptions()).out)
    oracle = NanbeigeOracle(checkpoint)
    for rule, loops in ((dict(loops=1), 1), (dict(loops=2), 2), (dict(exit_at_step=1), 2)):
        ids = list(prompt(0))
        oracle.loops = loops
        for _ in range(NEW_TOKENS):
            ids.append(int(oracle(torch.tensor([ids]))[0, -1].argmax()))
        for mode in ("speed-always", "autoregressive"):
            result = engine.generate(prompt(0), max_new_tokens=NEW_TOKENS, mode=mode, stop_at_eos=False, **rule)
            assert result.ids == ids[PROMPT_LEN:], (rule, mode)
    with pytest.raises(GenerationError, match="does not hold"):
        engine.generate(prompt(0), max_new_tokens=4, exit_threshold=0.5)


def test_cli_rule_and_refusal(gated):
    result = run_cli("generate", gated.artifact, "--prompt-ids", ",".join(map(str, prompt(0))), "--max-new-tokens",
                     str(NEW_TOKENS), "--ignore-eos", "--exit-threshold", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    assert '"exit_loops"' in result.stdout
    shown = run_cli("inspect", gated.artifact, env={"COLUMNS": "400"})  # rich wraps at the terminal width
    assert "exit_threshold and weighted_exit (its exit gate is stored)" in " ".join(shown.stdout.split()), shown.stdout
    bad = run_cli("generate", gated.artifact, "--prompt-ids", "1,2", "--loops", "9")
    assert_one_line_error(bad, "loops must be an integer in 1..4")


def test_batch_takes_a_rule_for_every_prompt(gated):
    """generate_batch's keyword arguments (what `speedc generate --prompts-file` passes) carry the rule to
    every prompt: each as it decodes alone."""
    prompts = [prompt(0), prompt(1)]
    engine = gated.engine("onnx")
    together = engine.generate_batch(prompts, max_new_tokens=8, stop_at_eos=False, exit_at_step=1, max_batch=2)
    for ids, result in zip(prompts, together):
        alone = engine.generate(ids, max_new_tokens=8, stop_at_eos=False, exit_at_step=1)
        assert result.ids == alone.ids and result.stats.exit_loops == {1: 8}


def test_a_sequence_whose_own_work_fails_under_a_rule_ends_alone(gated):
    """One request's own failure (its picker: a stand-in for a grammar's) inside the shared step, with and
    without a rule beside it, speculating and not: it alone ends with its error; the others equal decoding alone."""
    from conftest import FailsAtPick
    from speedc.runtimes.sequence import DONE

    engine = gated.engine("onnx")
    for row_budget in (None, 0):
        scheduler = engine.batch_scheduler(max_batch=4, row_budget=row_budget)
        settings = [dict(exit_threshold=0.5), {}, dict(exit_at_step=1), dict(exit_threshold=0.5)]
        requests = [engine.request_from(prompt(seed), dict(max_new_tokens=12, stop_at_eos=False, **one))
                    for seed, one in enumerate(settings)]
        requests[2].picker = FailsAtPick(requests[2].picker, 3)  # a rule's sequence fails at its third pick
        requests[1].picker = FailsAtPick(requests[1].picker, 5)  # one without a rule at its fifth
        sequences = [scheduler.submit(request) for request in requests]
        scheduler.run()
        for seed, (one, sequence) in enumerate(zip(settings, sequences)):
            alone = engine.generate(prompt(seed), max_new_tokens=12, mode="autoregressive", stop_at_eos=False, **one).ids
            if seed in (1, 2):
                k = 5 if seed == 1 else 3
                assert sequence.state == DONE and str(sequence.error) == f"scripted failure at pick {k}"
                assert sequence.out == alone[:k - 1]
            else:
                assert sequence.error is None and sequence.out == alone, (row_budget, one)
        assert not scheduler.occupied and not scheduler.waiting
