"""The per-sequence speculation rule (runtimes/acceptance_policy.py): scripted acceptance patterns drive
its state machine (no model); the real scheduler with mixed per-sequence decisions is in test_batch.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speedc.runtimes.acceptance_policy import AcceptancePolicy, SequenceAcceptance
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
    good, bad = SequenceAcceptance(1.0, outcomes=8), SequenceAcceptance(0.0, outcomes=8)
    assert policy.batch_speculates([good]) and not policy.batch_speculates([bad])
    assert policy.batch_speculates([SequenceAcceptance(0.0, outcomes=7)])  # not judged yet: the prior
    failed_probe = SequenceAcceptance(0.25, probing=True, outcomes=4)  # judged after 4 outcomes, at its estimate
    assert not policy.wants_speculation(failed_probe) and failed_probe.fallbacks == 1
    assert not policy.batch_speculates([failed_probe])  # its batch of one decodes plainly (at the prior it sped on)
    assert policy.batch_speculates([good, bad])  # 3.125 > 2
    assert policy.batch_speculates([good] * 2 + [bad] * 3)  # 6.875 > 5
    assert policy.batch_speculates([good] + [bad] * 3)  # 4.375 > 4
    # A speculating batch is judged at optimistic acceptances (a standard error up: 8 misses say 0.106 at most):
    assert not policy.batch_speculates([good] + [bad] * 4, speculating=False)  # 5.0, not > 5: no start
    assert policy.batch_speculates([good] + [bad] * 4)  # but it goes on: (1 + 4 x 0.272) x 2.5 = 5.22 > 5
    assert not policy.batch_speculates([good] + [bad] * 5)  # 5.90 < 6
    assert not AcceptancePolicy(slots=4, step_cost=4.5).batch_speculates([good])  # c(P) > P: never


def test_a_sequence_falls_back_only_where_even_an_optimistic_estimate_loses():
    """alpha* is 0.5 at c(4) = 1.6. An average of 0.35 over 8 outcomes is within a standard error of winning
    (0.52 at most): chance, not evidence. The same average held over the ~19 outcomes the average weighs is
    evidence (0.46 at most: the bound 0.95), and 0.2 over 8 loses at once (0.36 at most: 0.85)."""
    policy = AcceptancePolicy(slots=4, step_cost=1.6, weight=0.1, min_outcomes=8)
    near = policy.start()
    near.alpha, near.outcomes = policy.threshold - 0.15, 8
    assert analytic_bound(4, near.alpha, 1.6) < 1.0 < policy.bound(near, 4, 1.6, optimistic=True)
    assert policy.wants_speculation(near)
    near.outcomes = 40
    assert policy.bound(near, 4, 1.6, optimistic=True) == pytest.approx(0.95, abs=0.01)
    assert not policy.wants_speculation(near) and near.fallbacks == 1
    far = policy.start()
    far.alpha, far.outcomes = 0.2, 8
    assert policy.bound(far, 4, 1.6, optimistic=True) == pytest.approx(0.85, abs=0.01)
    assert not policy.wants_speculation(far) and far.fallbacks == 1


def test_the_decision_follows_the_step_cost_it_is_given():
    """The same acceptance wins at a cheap step and loses at a dear one (c passed per step: measured here)."""
    policy = AcceptancePolicy(slots=4, step_cost=1.6, min_outcomes=4)
    state = policy.start()
    state.alpha, state.outcomes = 0.75, 20  # alpha* is 0.5 at c 1.6, 0.89 at c 3.0; 0.85 at most (a standard error up)
    assert policy.wants_speculation(state, cost=1.6) and state.speculating
    assert not policy.wants_speculation(state, cost=3.0) and state.fallbacks == 1  # optimistic bound 0.92
    assert policy.batch_speculates([SequenceAcceptance(0.75, outcomes=8)], cost=1.6)
    assert not policy.batch_speculates([SequenceAcceptance(0.75, outcomes=8)], speculating=False, cost=2.8)
    assert policy.threshold_at(2.8) == pytest.approx(1 - (4 / 2.8 - 1) / 3)


def test_measured_tokens_per_step_replace_the_formula_once_enough_steps_ran():
    """A miss caught by an early exit loses fewer than P - 1 steps, so the bound's 1 / (1 + (1 - a)(P - 1))
    tokens a step undercounts: after yield_steps speed steps at a depth the sequence's measured yield decides.
    Acceptance 0.7 at c(4) 2.0: the formula says 0.53 tokens a step (bound 1.05); a yield of 0.75 says 1.5."""
    policy = AcceptancePolicy(slots=4, step_cost=2.0, min_outcomes=4, yield_steps=8)
    state = policy.start()
    for _ in range(7):
        policy.stepped(state, accepted=1, failed=0, emitted=1, depth=4)
    state.alpha = 0.7
    assert policy.tokens_per_step(state, 4) == pytest.approx(1 / (1 + 0.3 * 3))  # 7 steps: not yet measured
    assert policy.bound(state, 4, 2.0) == pytest.approx(analytic_bound(4, 0.7, 2.0))
    for emitted in (1, 0, 1, 1, 1, 0, 1, 1, 0):
        policy.stepped(state, accepted=0, failed=0, emitted=emitted, depth=4)
    state.alpha = 0.7
    yield_ = policy.tokens_per_step(state, 4)
    assert 0.6 < yield_ < 0.9 and policy.bound(state, 4, 2.0) == pytest.approx(yield_ * 4 / 2.0)
    assert policy.tokens_per_step(state, 2) == pytest.approx(1 / (1 + 0.3))  # another depth: its own record
    # A yield as low as the formula's at a dear step loses: the sequence falls back, and its probe starts afresh.
    for _ in range(40):
        policy.stepped(state, accepted=0, failed=0, emitted=0, depth=4)
    assert not policy.wants_speculation(state, cost=3.0) and state.fallbacks == 1
    state.plain_tokens = state.probe_after
    assert policy.wants_speculation(state, cost=3.0) and state.probing and state.yields == {}


def test_the_steps_a_miss_costs_are_learned_from_the_engines_steady_speed_steps():
    """Before a sequence's own yield is measured, its tokens a step come from its acceptance and L, the steps a
    miss costs: the analytic bound's P - 1 until the engine's steady speed steps show another (an early flush
    catches a miss a slot or two in). Scripted: every fifth step emits nothing and one outcome of five fails,
    0.8 tokens a step at acceptance 0.8, where the bound's L = 3 says 0.625."""
    policy = AcceptancePolicy(slots=4, step_cost=2.4)
    assert policy.miss_steps(4) == pytest.approx(3.0) and policy.miss_steps(2) == pytest.approx(1.0)
    fresh = policy.start()
    fresh.alpha, fresh.outcomes = 0.7, policy.min_outcomes
    assert policy.bound(fresh, 4, 2.4) == pytest.approx(analytic_bound(4, 0.7, 2.4))  # 0.88: it would fall back
    state = policy.start()
    for step in range(600):
        policy.stepped(state, accepted=int(step % 5 != 4), failed=int(step % 5 == 4), emitted=int(step % 5 != 4), depth=4)
    assert policy.yield_at(0.8, 4) == pytest.approx(0.8, rel=0.02)
    assert 1.25 < policy.miss_steps(4) < 1.4 and policy.miss_steps(2) == pytest.approx(1.0)  # the prior fades
    assert policy.bound(fresh, 4, 2.4) == pytest.approx(4 / (2.4 * (1 + 0.3 * policy.miss_steps(4))))  # 1.2: it wins
    assert policy.threshold_at(2.4, 4) < 0.7 < analytic_threshold(4, 2.4)
    # Pipeline fills (a sequence's first P steps at a depth) are no misses: they teach nothing.
    other = AcceptancePolicy(slots=4, step_cost=2.4)
    for _ in range(200):
        other.stepped(other.start(), accepted=0, failed=0, emitted=0, depth=4)
    assert other.miss_steps(4) == pytest.approx(3.0)


def analytic_threshold(slots: int, cost: float) -> float:
    """alpha* of the analytic bound: where it crosses 1."""
    return 1.0 - (slots / cost - 1.0) / (slots - 1)


def test_a_new_sequence_starts_from_what_the_engine_learned():
    """A checkpoint whose draft agrees rarely: the first sequence pays min_outcomes speculations to learn it, the
    next only min_outcomes - learned_weight (the engine's average counts as learned_weight of its outcomes), then
    waits as long as the last failed probe said. A text that agrees well after it is judged on its own outcomes
    too and keeps speculating."""
    policy = AcceptancePolicy(slots=4, step_cost=1.6, min_outcomes=8, learned_weight=4, probe_after=3,
                              max_probe_after=48)
    first = policy.start()
    assert _steps(policy, first, "f" * 8 + "---" + "ffff") == "S" * 8 + "ppp" + "SSSS"
    assert _steps(policy, first, "-") == "p" and first.probe_after == 6 == policy.learned_probe_after["greedy"]
    assert policy.learned_alpha["greedy"] < policy.threshold
    assert _steps(policy, policy.start("sampled"), "a") == "S"  # another kind of request learns on its own
    second = policy.start()
    assert _steps(policy, second, "ffff" + "------" + "ffff" + "-") == "SSSS" + "pppppp" + "SSSS" + "p"
    assert second.probes == 1 and second.probe_after == 12 == policy.learned_probe_after["greedy"]  # the probe failed
    third = policy.start()  # four accepted outcomes outweigh the engine's four failed ones (optimistically)
    assert _steps(policy, third, "a" * 12) == "S" * 12 and third.fallbacks == 0
    assert third.alpha > policy.threshold

def test_step_costs_measured_per_batch_size_and_band_after_a_warm_up():
    """Scripted step times (no clock): the seed stands in until a band has min_samples of both kinds, then c =
    P x speed / plain of that band (unslowed means: a shared host only ever slows a step); a band without its
    own measurement borrows the nearest measured one; a plain estimate goes stale after refresh_steps; a depth
    not measured falls back to the seed, never to another depth's measurement."""
    from speedc.runtimes.step_costs import StepCosts, context_band

    assert [context_band(t) for t in (1, 64, 65, 144, 1024, 1025)] == [64, 64, 128, 256, 1024, 2048]
    costs = StepCosts(slots=4, seed=1.6, seed_source="seed", warmup=1, min_samples=3, refresh_steps=10)
    assert costs.step_cost(1, 200) == (1.6, "seed") and costs.needs_plain_sample(1, 200)
    for seconds in (9.0, 0.010, 0.010, 0.010, 0.5):  # the first is warm-up, 0.5 a slowed step: not counted
        costs.record("plain", 1, 200, seconds)
    for seconds in (9.0, 0.005, 0.005, 0.005):
        costs.record("speed", 1, 200, seconds)
    assert costs.step_cost(1, 200) == (pytest.approx(4 * 0.005 / 0.010), "measured here")
    costs.record("plain", 1, 210, 5.0)  # the first step over a new pool length (same band): warm-up again
    assert costs.seconds("plain", 1, 256) == pytest.approx(0.010)
    assert costs.step_cost(1, 900)[0] == pytest.approx(4 * 0.005 / 0.010)  # band 1024 borrows band 256
    assert costs.step_cost(1, 200, depth=2) == (pytest.approx(1.6 * 1.2 / 1.6), "seed, scaled to depth 2")
    assert "none yet at 1024" in costs.step_cost(1, 900)[1]
    assert costs.step_cost(2, 200) == (1.6, "seed")  # another batch size: nothing measured yet
    assert not costs.needs_plain_sample(1, 200)
    for _ in range(10):
        costs.record("speed", 1, 200, 0.005)
    assert costs.needs_plain_sample(1, 200)  # stale: more than refresh_steps decode steps since the newest plain
    report = costs.report()
    assert report["measured"][0]["mean_step_cost"] == pytest.approx(2.0) and "step_cost" not in report["measured"][0]
    costs.record("speed@2", 1, 200, 0.004)
    assert costs.step_cost(1, 200, depth=2)[1] == "seed, scaled to depth 2"  # warm-up, then too few samples
    for _ in range(4):
        costs.record("speed@2", 1, 200, 0.004)
    assert costs.step_cost(1, 200, depth=2) == (pytest.approx(4 * 0.004 / 0.010), "measured here")
    assert costs.report()["measured"][0]["depths"] == {2: {"speed_ms": 4.0, "mean_step_cost": 1.6}}
    for _ in range(16):  # plain steps slowed far beyond P speed steps: implausible, the seed decides
        costs.record("plain", 1, 2000, 0.5)
        costs.record("speed", 1, 2000, 0.005)
    assert costs.step_cost(1, 2000) == (pytest.approx(2.0), "measured at context band 256 (none yet at 2048)")
    scripted = StepCosts(slots=4, seed=2.0, seed_source="scripted", measuring=False)
    scripted.record("plain", 1, 200, 0.01)
    assert scripted.step_cost(1, 200) == (2.0, "scripted") and not scripted.needs_plain_sample(1, 200)


def test_the_depth_that_emits_most_per_unit_of_time_is_chosen():
    """P = 4 slots may run as a 2-slot pipeline (runtimes/decode.py Pipeline.shift's spacing): at a high
    acceptance the deeper pipeline shares each weight read among more rows, at a middling one the shallower
    loses less to each miss, and a sequence keeps speculating where some depth still wins."""
    policy = AcceptancePolicy(slots=4, step_cost=2.3)
    costs = {4: 2.3, 2: 1.4}
    high, middle = SequenceAcceptance(0.95, outcomes=8), SequenceAcceptance(0.6, outcomes=8)
    assert policy.best_depth([high], costs) == 4  # 4 x 0.870 / 2.3 = 1.51 against 2 x 0.952 / 1.4 = 1.36
    assert policy.best_depth([middle], costs) == 2  # 4 x 0.455 / 2.3 = 0.79 against 2 x 0.714 / 1.4 = 1.02
    assert policy.batch_speculates([middle], False, cost=1.4, depth=2) and not policy.batch_speculates([middle], False, cost=2.3)
    assert policy.best_depth([high, middle, middle], costs) == 2 and policy.best_depth([high] * 3 + [middle], costs) == 4
    one, other = policy.start(), policy.start()
    for state in (one, other):
        state.alpha, state.outcomes = 0.5, 20  # 0.62 at most (a standard error up)
    assert not policy.wants_speculation(one, cost=2.3) and one.fallbacks == 1  # at P alone it loses: 0.81
    assert policy.wants_speculation(other, cost=costs) and other.fallbacks == 0  # at depth 2 it wins: 1.03


def test_c_pairs_the_plain_steps_with_the_speed_steps_timed_beside_them():
    """Load that arrives after a plain burst slows the later speed steps, not the burst: c from the speed steps
    nearest in time to the plain ones stays the step's cost (P x 1 ms / 2 ms = 2), where a ratio of the two
    moments would say 6 and end speculation that pays."""
    from speedc.runtimes.step_costs import StepCosts

    costs = StepCosts(slots=4, seed=1.6, seed_source="seed", warmup=0, min_samples=3, window=4, plain_window=4)
    for _ in range(8):
        costs.record("speed", 1, 200, 0.001)  # quiet
    for _ in range(4):
        costs.record("plain", 1, 200, 0.002)  # the burst, quiet too
    for _ in range(40):
        costs.record("speed", 1, 200, 0.003)  # then the host is loaded
    assert costs.seconds("speed", 1, 256) == pytest.approx(0.003)  # the latest speed steps
    assert costs.step_cost(1, 200) == (pytest.approx(2.0), "measured here")
    assert costs.report()["measured"][0]["mean_step_cost"] == pytest.approx(2.0)
    assert costs.plain_age(1, 200) == 40
    costs.record("plain", 1, 200, 0.006)  # a new burst under the load: its first sample (clock 53, answers cached)
    assert costs.step_cost(1, 200)[0] == pytest.approx(6.0)  # is paired with the loaded speed steps at once
    for _ in range(3):
        costs.record("plain", 1, 200, 0.006)  # the ratio of that moment
    assert costs.step_cost(1, 200)[0] == pytest.approx(2.0)
    assert costs.plain_age(1, 200) == 0 and costs.measured_here(1) and not costs.measured_here(1, depth=2)


def test_no_fall_back_before_the_costs_are_this_hosts_and_yields_count_whole_pipeline_steps():
    """A cost not yet measured here (the build host's seed) leaves no sequence plain however it judges; a depth
    d < P pipeline's tokens per step count P / d speed steps a step (the bound's unit), after its first P steps
    (the change of spacing)."""
    policy = AcceptancePolicy(slots=4, step_cost=3.0, min_outcomes=4, yield_steps=4)
    state = policy.start()
    state.alpha, state.outcomes = 0.75, 20  # at the seed's 3.0 even the optimistic bound is 0.92
    assert policy.losing(state, {4: 3.0})
    assert policy.wants_speculation(state, cost=3.0, costs_settled=False) and state.fallbacks == 0
    assert not policy.losing(state, {4: 2.0}) and policy.wants_speculation(state, cost=2.0)
    for emitted in (0, 0, 0, 0) + (1, 0) * 4:  # depth 2: one token every other speed step once settled
        policy.stepped(state, accepted=0, failed=0, emitted=emitted, depth=2)
    assert state.yields[2][1] == 8 and policy.measured_yield(state, 2) == pytest.approx(1.0)
    assert policy.bound(state, 2, 1.6) == pytest.approx(1.0 * 2 / 1.6)
    policy.stepped(state, accepted=0, failed=0, emitted=1, depth=4)
    assert state.depth_run == (4, 1) and 4 not in state.yields  # a change of depth: its spacing settles first
    policy.waited(state)
    assert state.depth_run == (0, 0)
    assert not policy.wants_speculation(state, cost={4: 6.0, 2: 4.0}) and state.fallbacks == 1


def test_the_seed_is_the_build_hosts_measurement_only_when_plausible():
    """c(P) measured at build seeds the step timer and the policy alike, when taken at the artifact's P and not
    below 1 (P rows never cost less than one row's pass: a loaded build host measured 0.89); else the cost model's."""
    from types import SimpleNamespace

    from speedc.cost_model import assumed_step_cost
    from speedc.runtimes.step_costs import StepCosts, seed_step_cost

    def manifest(slots, measured):
        return SimpleNamespace(slots=slots, build={"step_cost_measured": measured})

    assert seed_step_cost(manifest(4, {"slots": 4, "step_cost": 2.1})) == (2.1, "measured at build")
    for measured in ({"slots": 2, "step_cost": 0.89}, {"slots": 2, "step_cost": 2.1}, None):
        cost, source = seed_step_cost(manifest(4, measured))
        assert cost == assumed_step_cost(4) and source.endswith("not measured")
    seeded = manifest(4, {"slots": 4, "step_cost": 2.1})
    assert AcceptancePolicy.for_manifest(seeded).step_cost == StepCosts.for_manifest(seeded).seed == 2.1


def test_speed_steps_are_costed_at_their_mix_of_head_rows():
    """A speed step's cost follows the heads it runs (readouts, checks): at a low acceptance most steps run
    few. Grouped by head rows, the estimate is the mix of each group's unslowed mean (3 cheap : 1 dear ->
    (3 x 8 + 14) / 4 = 9.5 ms) where the lower quartile of the mixture would be a cheap step's 8 ms, and a
    slowed step in either group still moves nothing."""
    from speedc.runtimes.step_costs import StepCosts, unslowed_mean

    assert unslowed_mean([0.010, 0.011, 0.012, 0.030]) == pytest.approx(0.011)  # 0.030: slowed (> 1.5 x 0.010)
    costs = StepCosts(slots=4, seed=1.6, seed_source="seed", warmup=0, min_samples=3, window=16, plain_window=4)
    for _ in range(4):
        costs.record("plain", 1, 200, 0.010)
    for step in range(16):
        dear = step % 4 == 3
        slowed = 3.0 if step in (5, 11) else 1.0  # another process took the core: one cheap step, one dear
        costs.record("speed", 1, 200, slowed * (0.014 if dear else 0.008), heads=3 if dear else 1)
    assert costs.seconds("speed", 1, 256) == pytest.approx(0.0095)
    assert costs.step_cost(1, 200) == (pytest.approx(4 * 0.0095 / 0.010), "measured here")
    costs.record("speed", 1, 200, 0.020)  # a step with no heads: a group of its own, 1 in the window of 16
    assert costs.seconds("speed", 1, 256) == pytest.approx((11 * 0.008 + 4 * 0.014 + 0.020) / 16)
