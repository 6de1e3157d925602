"""runtimes/exit_rule.py and decode.absorb_exits with scripted stand-ins: the published exit arithmetic a loop
at a time, which loops run and are read, and the pipeline's order of emission under a rule (a younger
token's exit waits for the older one's; a miss at the older one's exit flushes the younger with its
kept result)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from speedc.errors import GenerationError
from speedc.models.sampling import SamplingParams, TokenPicker
from speedc.runtimes.decode import DecodeStats, InFlightToken, Pipeline, Request, absorb_exits, emit_token, exit_heads_wanted
from speedc.runtimes.exit_rule import DepthRule, DepthRules, ExitGate, TokenExit


def exit_loop(rule: DepthRule, gates: list[float], logits: list | None = None) -> tuple[int, TokenExit]:
    token = TokenExit(rule)
    for loop in range(rule.loops):
        if token.after_loop(loop, np.float32(gates[loop]), None if logits is None else np.asarray(logits[loop], np.float32)):
            return loop, token
    raise AssertionError("no exit by the last loop")


def test_threshold_exits_where_the_cumulative_probability_reaches_it():
    # p = 0.2, 0.5 * 0.8 = 0.4 (cumulative 0.6), ...
    assert exit_loop(DepthRule(4, exit_threshold=0.55), [0.2, 0.5, 0.9, 0.0])[0] == 1
    assert exit_loop(DepthRule(4, exit_threshold=0.2), [0.2, 0.5, 0.9, 0.0])[0] == 0  # >=, as published
    assert exit_loop(DepthRule(4, exit_threshold=1.0), [0.0, 0.0, 0.0, 0.0])[0] == 3  # the last loop takes the rest
    assert exit_loop(DepthRule(2, exit_threshold=0.9), [0.5, 0.0])[0] == 1  # loops 2: the remainder at loop 1


def test_weighted_exit_sums_every_loops_logits_by_the_exit_distribution():
    logits = [[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]]
    loop, token = exit_loop(DepthRule(3, weighted=True), [0.5, 0.5, 0.7], logits)
    p = [0.5, 0.25, 0.25]  # the last loop takes the remainder, its own gate unread
    assert loop == 2
    np.testing.assert_allclose(token.expected, sum(pi * np.asarray(li) for pi, li in zip(p, logits)), rtol=1e-6)


def test_slots_read_and_run():
    assert list(DepthRule(4).head_slots) == [3] and DepthRule(4).run_slots == 4
    assert list(DepthRule(3).head_slots) == [2] and DepthRule(3).run_slots == 3
    assert list(DepthRule(4, exit_at_step=1).head_slots) == [1] and DepthRule(4, exit_at_step=1).run_slots == 2
    assert list(DepthRule(4, exit_threshold=0.5).head_slots) == [0, 1, 2, 3] and DepthRule(4, exit_threshold=0.5).run_slots == 4


def test_a_recurrent_cores_loops_read_out_at_the_end_of_their_slot():
    """Huginn built for 8 repeats at P = 4 (two a slot): 4 loops read out at the end of slot 1 (loop 3's state),
    3 loops inside slot 1 (loop 2's: the slot runs loop 3 too, unread)."""
    rules = DepthRules("huginn", 8, False, False, None, recurrent=True, slots=4)
    rule = rules.rule(loops=4)
    assert (rule.per_slot, rule.slots, list(rule.head_slots), rule.run_slots, rule.loop_at(1)) == (2, 2, [1], 2, 3)
    token = TokenExit(rule)
    assert not token.after_loop(0, None, None) and token.after_loop(1, None, None)
    inside = rules.rule(loops=3)
    assert (inside.slots, list(inside.head_slots), inside.run_slots, inside.loop_at(1)) == (2, [1], 2, 2)
    assert rules.rule(loops=1).loop_at(0) == 0 and rules.rule(loops=8).slots == 4 and rules.rule() is None
    for bad in (10, 0, 2.5):
        with pytest.raises(GenerationError, match="loops must be an integer in 1..8"):
            rules.rule(loops=bad)
    with pytest.raises(GenerationError, match="huginn has no exit rules"):
        rules.rule(exit_at_step=1)
    with pytest.raises(GenerationError, match=r"plain \(P = 1\)"):
        DepthRules("huginn", 8, False, False, None, recurrent=True, slots=1).rule(loops=4)


def test_gate_is_the_sigmoid_of_a_linear_readout():
    gate = ExitGate(np.array([1.0, -2.0], np.float32), 0.5)
    assert gate(np.array([1.0, 1.0], np.float32)) == pytest.approx(1 / (1 + np.exp(0.5)))


def test_rules_an_artifact_allows():
    ouro = DepthRules("ouro", 4, True, True, ExitGate(np.zeros(2, np.float32), 0.0))
    assert ouro.rule() is None and ouro.rule(loops=4) == DepthRule(4)
    assert ouro.rule(exit_threshold=0.5).gate is ouro.gate and ouro.rule(exit_at_step=1).gate is None
    with pytest.raises(GenerationError, match="rebuild with --slots 4"):
        DepthRules("ouro", 4, True, False, None).rule(loops=2)
    with pytest.raises(GenerationError, match="does not hold"):
        DepthRules("nanbeige", 4, True, True, None).rule(weighted_exit=True)
    with pytest.raises(GenerationError, match="llama has no per-request depth rules"):
        DepthRules("llama", 4, False, True, None).rule(loops=2)


# ---- absorb_exits over a scripted pipeline ----------------------------------------------------------------
def run_step(pipeline: Pipeline, request: Request, out: list, heads: dict, gates: dict, rule: DepthRule) -> list[int]:
    """One step's outcome: HEADS slot -> argmax of the rows exit_heads_wanted asks; GATES slot -> lambda."""
    assert set(heads) == set(exit_heads_wanted(pipeline, rule))
    outcome = SimpleNamespace(loop_heads={s: (token, None) for s, token in heads.items()}, guesses={0: 99},
                              draft_candidates=None)
    emitted: list[int] = []

    def emit(token: int) -> bool:
        emitted.append(token)
        return emit_token(request, out, token, pipeline.stats)

    states = {s: np.array([np.log(gates[s] / (1 - gates[s]))], np.float32) for s in gates}  # gate(h) = sigmoid(h)
    absorb_exits(pipeline, request, out, outcome, rule, states.__getitem__, emit)
    return emitted


def two_in_flight():
    """A threshold-0.5 pipeline after prompt [1, 2, 3]: the last prompt token (pos 2) in slot 1, past loop 0
    without exiting (gate 0.1), its draft successor 50 (pos 3) in slot 0. -> (rule, stats, pipeline, request, out)"""
    rule = DepthRule(4, exit_threshold=0.5, gate=ExitGate(np.ones(1, np.float32), 0.0))
    stats = DecodeStats("speed")
    pipeline = Pipeline(4, stats)
    request = Request([1, 2, 3], 10, TokenPicker(SamplingParams()), lambda ids: None, history=[1, 2, 3])
    pipeline.slots = [InFlightToken(50, 3), InFlightToken(3, 2), None, None]
    pipeline.slots[1].exit = TokenExit(rule)
    pipeline.slots[1].exit.after_loop(0, np.float32(0.1), None)
    return rule, stats, pipeline, request, []


def test_a_younger_exit_waits_and_is_flushed_with_its_result_on_a_miss():
    rule, stats, pipeline, request, out = two_in_flight()
    # the younger token exits at loop 0 (gate 0.9) with 60; the older does not exit at loop 1 (0.1, 0.1)
    assert run_step(pipeline, request, out, {0: 60, 1: 7}, {0: 0.9, 1: 0.1}, rule) == []
    assert pipeline.slots[0].result == (None, 60) and pipeline.slots[0].exit_loop == 0
    assert pipeline.pending.token == 99  # slot 0's draft enters behind it
    # next step: the older exits at loop 2 with 51, not the 50 in flight: 50 and its kept 60 are flushed
    pipeline.shift(100)
    assert run_step(pipeline, request, out, {2: 51, 0: 61}, {2: 0.9, 0: 0.5}, rule) == [51]
    assert pipeline.pending.token == 51 and stats.mispredicted == 1 and stats.flushed_tokens == 2
    assert all(slot is None or slot.pos < 3 for slot in pipeline.slots) and stats.exit_loops == {2: 1}


def test_a_verified_exit_emits_the_kept_result_of_its_successor_at_once():
    rule, stats, pipeline, request, out = two_in_flight()
    # both exit in the same step: the older (loop 1) with 50 = the draft in flight, the younger (loop 0) with 60
    assert run_step(pipeline, request, out, {0: 60, 1: 50}, {0: 0.9, 1: 0.9}, rule) == [50, 60]
    assert stats.accepted == 1 and stats.exit_loops == {1: 1, 0: 1} and pipeline.pending.token == 60
    assert pipeline.slots[0].emitted and pipeline.slots[1].emitted  # both ride on for their deeper loops' K/V
