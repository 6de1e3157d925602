"""SPEED that adapts to its host (runtimes/acceptance_policy.py deciding at runtimes/step_costs.py's measured
costs): whatever the policy decides, and whenever, the tokens are plain decoding's.

A scripted cost (a stand-in for the clock: the decisions' logic, not this host's timing) turns the pipeline
from its full depth to a shallower one (P = 4 run as 2 slots' spacing), to plain decoding and back every
few steps, asks for a timed plain step in the middle of speculation and for a few steps at a depth it
would not choose, so every switch (in-flight work dropped or merely spaced, the pipeline refilled from
the frontier) and every discarded measurement step happens many times per sequence; each family's greedy
and seeded-sampling outputs must equal plain decoding's. Then the real path: `mode="speed"` (the default) on an engine that
measures its own steps equals plain decoding, reports its decisions and costs, and the CLI shows them.
"""

from __future__ import annotations

import json

import pytest

from conftest import ZOO, build_artifact, run_cli
from speedc import Engine
from speedc.runtimes.step_costs import StepCosts

NEW_TOKENS = 40
PROMPTS = ([5, 7, 9, 11, 3, 40], [8, 1, 4])
SAMPLING = ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 11})


class ScriptedCosts(StepCosts):
    """c by decision, in phases of PHASE decisions: the full depth P cheap (shallower ones dear), then every
    depth dearer than its slots (no acceptance wins: plain decoding), then the shallowest depth cheap and P
    dear, over and over; plain steps to time plain decoding are asked for at every SAMPLE_EVERY-th question
    (at once, in-flight work dropped), a few steps at a depth not chosen at every EXPLORE_EVERY-th decision; a
    fall-back waits for a plain burst at every third and for costs measured here in every seventh phase."""

    def __init__(self, slots: int, phase: int = 5, sample_every: int = 6, explore_every: int = 11) -> None:
        super().__init__(slots, 1.2, "scripted", measuring=False)
        self.phase, self.sample_every, self.explore_every = phase, sample_every, explore_every
        self.decisions = self.asked = self.explored = self.aged = 0

    def step_cost(self, sequences: int, length: int, kind: str = "speed", depth: int | None = None) -> tuple[float, str]:
        depth = self.slots if depth is None else depth
        if depth == self.slots:  # asked once per depth each decision: count the decisions once
            self.decisions += 1
        phase = (self.decisions // self.phase) % 3
        cheap = (phase == 0 and depth == self.slots) or (phase == 2 and depth == 2)
        return (1.0 + 0.05 * (depth - 1) if cheap else 2.0 * depth), "scripted"

    def needs_plain_sample(self, sequences: int, length: int) -> bool:
        self.asked += 1
        return self.asked % self.sample_every == 0

    def plain_overdue(self, sequences: int, length: int) -> bool:
        return True

    def needs_depth_sample(self, sequences: int, length: int, depth: int) -> bool:
        self.explored += 1
        return self.explored % self.explore_every == 0

    def plain_age(self, sequences: int, length: int) -> int:
        """Every third question: the plain cost is old, so a fall-back waits for a burst (BatchScheduler._costs_settled)."""
        self.aged += 1
        return 10 ** 6 if self.aged % 3 == 0 else 0

    def measured_here(self, sequences: int, depth: int | None = None) -> bool:
        """Not yet measured in every seventh phase: no fall-back then."""
        return (self.decisions // self.phase) % 7 != 6


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory) -> dict[str, Engine]:
    from huginn_checkpoints import write_checkpoint
    from iquest_checkpoints import write_iquest
    from looped_checkpoints import write_nanbeige, write_ouro
    from parcae_checkpoints import write_checkpoint as write_parcae

    root = tmp_path_factory.mktemp("adaptive")
    checkpoints = {"zoo-tiny": ZOO / "tiny",
                   "ouro": write_ouro(root / "ouro", residual_scale=0.3),
                   "nanbeige": write_nanbeige(root / "nanbeige", residual_scale=0.3),
                   "huginn": write_checkpoint(root / "huginn", seed=6, layer_scale=0.03, adapter_identity=1.0),
                   "parcae": write_parcae(root / "parcae", seed=6, layer_scale=0.03, decay=0.05, weights_file="model.safetensors"),
                   "iquest": write_iquest(root / "iquest", window=3, residual_scale=0.3)}
    return {name: Engine.load(build_artifact(checkpoint, root / f"{name}-art")) for name, checkpoint in checkpoints.items()}


def _adaptive(engine: Engine, prompt: list[int], params: dict):
    """One sequence on the engine's backend under the real acceptance rule (quick knobs) at scripted costs."""
    from speedc.runtimes.acceptance_policy import AcceptancePolicy
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import RowPolicy

    slots = engine.manifest.slots
    costs = ScriptedCosts(slots)
    policy = AcceptancePolicy(slots, 1.2, "scripted", min_outcomes=2, probe_after=3, probe_outcomes=2)
    scheduler = BatchScheduler(engine.backend, policy=RowPolicy(row_budget=None), acceptance=policy, costs=costs,
                               prefill_chunk=64)
    sequence = scheduler.submit(engine.request_from(prompt, dict(max_new_tokens=NEW_TOKENS, stop_at_eos=False, **params)))
    scheduler.run()
    return sequence, scheduler


@pytest.mark.parametrize("family", ["zoo-tiny", "ouro", "nanbeige", "huginn", "parcae", "iquest"])
def test_switching_mid_sequence_keeps_speed_equal_to_plain(family_engines, family):
    engine = family_engines[family]
    assert engine.manifest.slots > 1
    switched = sampled = 0
    depths = set()
    for prompt in PROMPTS:
        for params in SAMPLING:
            sequence, scheduler = _adaptive(engine, prompt, params)
            plain = engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False, mode="autoregressive", **params)
            assert sequence.out == plain.ids, (family, prompt, params)
            stats = sequence.stats
            assert stats.speed_steps + stats.plain_steps == stats.steps and stats.speed_steps and stats.plain_steps
            switched += scheduler.mode_switches
            sampled += stats.cost_samples
            depths |= set(stats.depth_steps)
    assert switched >= 8 and sampled >= 4  # every sequence switched both ways and ran plain bursts mid-pipeline
    slots = engine.manifest.slots
    assert depths == {d for d in range(2, slots + 1) if slots % d == 0}  # and ran at every depth the P slots allow


def test_default_mode_measures_decides_and_reports(family_engines):
    """The default mode on the real clock: equal to plain and to speed-always, its decisions add up, and what it
    measured is in the stats (per batch size and context band: the plain step and the speed step)."""
    engine = family_engines["zoo-tiny"]
    for prompt in PROMPTS:
        for params in SAMPLING:
            runs = {mode: engine.generate(prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False, mode=mode, **params)
                    for mode in ("speed", "speed-always", "autoregressive")}
            assert runs["speed"].ids == runs["speed-always"].ids == runs["autoregressive"].ids
            stats = runs["speed"].stats
            assert stats.speed_steps + stats.plain_steps == stats.steps
            assert stats.step_cost > 0 and stats.step_cost_source and "measured on this host" in stats.policy
            assert runs["speed-always"].stats.plain_steps == 0 and runs["autoregressive"].stats.speed_steps == 0
    measured = runs["speed"].stats.host_costs["measured"]
    assert any("plain_ms" in row and "speed_ms" in row for row in measured), measured
    assert engine.step_costs().step_cost(1, engine.backend.pool.length)[1].startswith("measured")


def test_cli_modes_and_stats(family_engines, tmp_path):
    artifact = family_engines["zoo-tiny"].directory
    outputs = {}
    for mode in ("speed", "speed-always", "autoregressive"):
        result = run_cli("generate", artifact, "--prompt-ids", "5,7,9", "--max-new-tokens", "24", "--mode", mode,
                         "--ignore-eos", "--json")
        assert result.returncode == 0, result.stderr
        outputs[mode] = json.loads(result.stdout)
    assert outputs["speed"]["ids"] == outputs["speed-always"]["ids"] == outputs["autoregressive"]["ids"]
    assert outputs["speed"]["stats"]["host_costs"]["seed_step_cost"] > 0
    shown = run_cli("generate", artifact, "--prompt-ids", "5,7,9", "--max-new-tokens", "24", "--stats")
    assert shown.returncode == 0 and "fallbacks" in shown.stderr and "step_cost" in shown.stderr
    bad = run_cli("generate", artifact, "--prompt-ids", "5,7,9", "--mode", "speedy")
    assert bad.returncode != 0 and "speedy" in bad.stderr
