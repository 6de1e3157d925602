"""runtimes/speculation.py: one decode step's decision reads a (sequence, depth) table of the acceptance
policy's expectations, filled once, and its verdicts are those of the policy's own state-based rules."""

from __future__ import annotations

from types import SimpleNamespace

from speedc.runtimes.acceptance_policy import AcceptancePolicy
from speedc.runtimes.decode import DecodeStats
from speedc.runtimes.speculation import SpeculationController


class CountingPolicy(AcceptancePolicy):
    """The real policy, counting how often a step asks for each sequence's expectations."""

    def __init__(self, *args, **knobs) -> None:
        super().__init__(*args, **knobs)
        self.asked: dict[str, int] = {"outlook": 0, "tokens_per_step": 0, "bound": 0}

    def outlook(self, state, depth, cost):
        self.asked["outlook"] += 1
        return super().outlook(state, depth, cost)

    def tokens_per_step(self, state, depth=None, optimistic=False):
        self.asked["tokens_per_step"] += 1
        return super().tokens_per_step(state, depth, optimistic)

    def bound(self, state, depth, cost, optimistic=False):
        self.asked["bound"] += 1
        return super().bound(state, depth, cost, optimistic)


def sequences(policy: AcceptancePolicy, alphas: list[float]) -> list:
    """Decoding sequences as the controller reads them: an id, a judged policy record, stats, an empty pipeline."""
    out = []
    for i, alpha in enumerate(alphas):
        state = policy.start()
        state.alpha, state.outcomes = alpha, 20
        out.append(SimpleNamespace(id=i, acceptance=state, stats=DecodeStats("speed"), pipeline=SimpleNamespace(empty=True)))
    return out


def test_a_step_fills_the_table_once_and_decides_as_the_policy_rules():
    policy = CountingPolicy(slots=4, step_cost=1.6)
    controller = SpeculationController(4, True, acceptance=policy)
    decoding = sequences(policy, [0.9, 0.8, 0.3])
    plan = controller.decide(decoding, 64, 4)
    depths = controller.depths  # P = 4: depths 4 and 2
    assert depths == [4, 2]
    # each (sequence, depth) outlook once: its tokens, its optimistic tokens, its bound
    assert policy.asked["outlook"] == len(decoding) * len(depths)
    assert policy.asked["tokens_per_step"] == 2 * policy.asked["outlook"]
    assert policy.asked["bound"] == policy.asked["outlook"]  # no sequence judged losing was asked again
    # the verdicts equal the policy's state-based rules at the costs the step used (the seed here)
    states = [s.acceptance for s in decoding]
    costs = {d: controller.costs.step_cost(3, 64, depth=d)[0] for d in depths}
    assert controller.depth == policy.best_of({d: policy.depth_score(states, d, c) for d, c in costs.items()})
    assert controller.acceptance_allows == any(policy.batch_speculates(states, True, c, d) for d, c in costs.items())
    assert [s.stats.bound for s in decoding] == [round(policy.bound(st, controller.depth, costs[controller.depth]), 3)
                                                 for st in states]
    assert plan.depth in depths


def test_a_rule_that_weighs_no_costs_has_no_table():
    controller = SpeculationController(4, True)  # AlwaysSpeculate
    decoding = [SimpleNamespace(id=0, acceptance=None, stats=DecodeStats("speed"), pipeline=SimpleNamespace(empty=True))]
    plan = controller.decide(decoding, 64, 1)
    assert plan.speculate and plan.depth == 4 and controller.depths == [4]
