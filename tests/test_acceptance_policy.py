"""The per-sequence speculation rule (runtimes/acceptance_policy.py): scripted acceptance patterns drive
its state machine (no model); the real scheduler with mixed per-sequence decisions is in test_batch.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speedc.runtimes.acceptance_policy import AcceptancePolicy
from speedc.cost_model import analytic_bound, assumed_step_cost


def _steps(policy: AcceptancePolicy, state, script: str) -> str:
    """Run SCRIPT, one character per scheduler step: 'a' one confirmed speculation, 'f' one failed,
    '-' a step without an outcome. Returns what the sequence did at each step: S speculate, p plain."""
    did = []
    for outcome in script:
        if policy.wants_speculation(state):
            did.append("S")
            policy.observe(state, outcome == "a", outcome == "f")
        else:
            did.append("p")
            policy.waited(state)
    return "".join(did)


def test_threshold_is_where_the_bound_crosses_one():
    policy = AcceptancePolicy(slots=4, step_cost=1.6)
    alpha = policy.threshold
    assert 0 < alpha < 1 and analytic_bound(4, alpha, 1.6) == pytest.approx(1.0)
    assert AcceptancePolicy(slots=4, step_cost=4.5).threshold > 1  # c(P) > P: SPEED can never win
    assert not AcceptancePolicy(slots=4, step_cost=4.5).wants_speculation(AcceptancePolicy(4, 4.5).start())


def test_falls_back_after_enough_failures_probes_and_backs_off():
    policy = AcceptancePolicy(slots=4, step_cost=1.6, min_outcomes=4, probe_after=3, max_probe_after=12)
    state = policy.start()
    # four failures: judged after min_outcomes -> plain for probe_after tokens, then a probe
    assert _steps(policy, state, "ffff" + "---" + "ffff") == "SSSS" + "ppp" + "SSSS"
    assert state.fallbacks == 1 and state.probing
    # the probe failed too: plain for twice as long, then probing again
    assert _steps(policy, state, "-" * 6 + "ffff" + "-" * 12 + "ffff" + "-" * 12) == "p" * 6 + "SSSS" + "p" * 12 + "SSSS" + "p" * 12
    assert state.probe_after == 12 and state.fallbacks == 4  # doubled twice more, capped at max_probe_after


def test_a_probe_that_holds_keeps_speculating_and_resets_the_wait():
    policy = AcceptancePolicy(slots=4, step_cost=1.6, min_outcomes=4, probe_after=3)
    state = policy.start()
    _steps(policy, state, "ffff" + "---" + "ffff" + "------")  # two fall-backs: the wait doubled to 6
    assert state.probe_after == 6 == state.plain_tokens and not state.speculating  # a probe is due
    assert _steps(policy, state, "aaaa" + "a" * 20) == "S" * 24  # the text became predictable
    assert not state.probing and state.probe_after == 3 and state.alpha == pytest.approx(1.0)


def test_a_good_run_survives_a_few_misses_and_a_long_bad_stretch_does_not():
    policy = AcceptancePolicy(slots=4, step_cost=1.6, weight=0.1, min_outcomes=8)
    state = policy.start()
    assert _steps(policy, state, "aaaaaaaaaa" + "ffaaafa" * 4) == "S" * 38  # ~70% accepted: above alpha* = 0.5
    did = _steps(policy, state, "f" * 12)
    assert did.startswith("S") and did.endswith("p") and state.fallbacks == 1  # the average follows the text
    assert state.alpha < policy.threshold


def test_step_cost_from_the_manifest_else_the_assumed_one():
    def manifest(build):  # the two fields for_manifest reads
        return SimpleNamespace(slots=4, build=build)

    measured = AcceptancePolicy.for_manifest(manifest({"step_cost_measured": {"slots": 4, "step_cost": 2.1}}))
    assert (measured.step_cost, measured.step_cost_source) == (2.1, "measured at build")
    for build in ({}, {"step_cost_measured": {"slots": 2, "step_cost": 1.2}}):  # none, or taken at another P
        fallback = AcceptancePolicy.for_manifest(manifest(build))
        assert fallback.step_cost == assumed_step_cost(4) == pytest.approx(1.6)  # the compiler's assumption, one value
        assert "assumed c(P) = 1 + 0.2 (P - 1), not measured" in fallback.describe()


def test_the_batch_speculates_while_its_summed_bound_wins():
    """With c/P = 0.4 a sequence at alpha 1 makes 2.5 tokens per plain-token cost in a speed step, one at
    alpha 0 makes 0.625: losers ride along while the winners carry the batch, else all decode plainly."""
    policy = AcceptancePolicy(slots=4, step_cost=1.6)
    good, bad = SimpleNamespace(alpha=1.0, outcomes=8), SimpleNamespace(alpha=0.0, outcomes=8)
    assert policy.batch_speculates([good]) and not policy.batch_speculates([bad])
    assert policy.batch_speculates([SimpleNamespace(alpha=0.0, outcomes=7)])  # not judged yet: the prior
    assert policy.batch_speculates([good, bad])  # 3.125 > 2
    assert policy.batch_speculates([good] * 2 + [bad] * 3)  # 6.875 > 5
    assert policy.batch_speculates([good] + [bad] * 3)  # 4.375 > 4
    assert not policy.batch_speculates([good] + [bad] * 5, speculating=False)  # 5.625 < 6: no start
    assert policy.batch_speculates([good] + [bad] * 5)  # but a speculating batch goes on within the margin: > 0.9 * 6
    assert not policy.batch_speculates([good] + [bad] * 7)  # 6.875 < 0.9 * 8
    assert not AcceptancePolicy(slots=4, step_cost=4.5).batch_speculates([good])  # c(P) > P: never


def test_a_sequence_falls_back_only_where_speculation_loses_by_more_than_the_margin():
    policy = AcceptancePolicy(slots=4, step_cost=1.6, weight=0.1, min_outcomes=8)
    near = policy.start()
    near.alpha, near.outcomes = policy.threshold - 0.02, 8  # the bound just under 1: chance, not evidence
    assert 1.0 - policy.margin < analytic_bound(4, near.alpha, 1.6) < 1.0
    assert policy.wants_speculation(near)
    far = policy.start()
    far.alpha, far.outcomes = policy.threshold - 0.15, 8
    assert analytic_bound(4, far.alpha, 1.6) < 1.0 - policy.margin
    assert not policy.wants_speculation(far) and far.fallbacks == 1
