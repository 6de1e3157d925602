"""When one sequence of a batch should speculate: from its own acceptance (runtimes/speculation.py asks per step).

RowPolicy (speculation.py) decides per step from the row count; this decides per sequence from how well its
speculation has been doing. SPEED beats plain decoding of the same sequence only while its bound is above 1,
the analytic bound (speedc/cost_model.py) with L, the steps a miss costs, learned as the engine runs (the
analytic bound's P - 1 seeds it; miss_steps), until the sequence's own tokens per step are measured:

    P / (c(P) (1 + (1 - alpha) L)) > 1   <=>   alpha > alpha* = 1 - (P / c(P) - 1) / L

alpha is the sequence's average of its speculation outcomes (confirmed = 1, failed at the last layer or
by an early flush = 0): a plain mean over the first 1/weight outcomes, then an exponential average, so it
follows a text that changes character. c is what a step costs on this host now: the scheduler passes the
cost its runtimes/step_costs.py measured for the step's batch size and context band (the build host's
c(P), or the cost model's assumption, only seeds it; `step_cost` here is that seed, used where no cost
is passed). The state machine of one sequence:

    speculating --(>= min_outcomes outcomes and the bound < 1 at an optimistic acceptance)--> plain
    plain --(probe_after tokens decoded plainly)--> speculating (a probe: its average starts afresh)
    a probe that falls back again (judged after probe_outcomes outcomes) doubles probe_after (up to
    max_probe_after); one that holds (min_outcomes outcomes without falling back) resets it

What the policy learned outlives the sequence: a new sequence starts from the acceptance the engine's
recent outcomes of its kind of request averaged (`learned_alpha`, once min_outcomes were seen; greedy and
sampled requests apart: a sampled token matches the draft's argmax far less often), held as `learned_weight`
outcomes of its own, and the current wait between probes. So a checkpoint whose draft agrees rarely pays a
few speculations per request, not min_outcomes and a probe, while a text that agrees well is judged on its
own outcomes too: the engine's average is another text's (measured on zoo:small, 64-token requests: after
one text at acceptance 0.71, four at 0.83-0.91 decoded plainly from their first token at 0.96-1.02x plain,
where speculating ran 1.46-1.61x).

The batch then speculates or decodes plainly as a whole (`batch_speculates`: the bound summed over its
sequences; a split into a speed run and a plain run never pays, see there). Whatever it decides stays lossless: the scheduler only drops unverified work when a sequence switches.
Standard library only (the runtime path imports no torch).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from speedc.cost_model import assumed_step_cost, describe_assumed_step_cost
from speedc.runtimes.step_costs import seed_step_cost


def _held(count: int, weight: float) -> float:
    """Samples an average of COUNT samples holds: all of them, at most about (2 - w) / w once it is an exponential
    average of weight w (the count its standard error is taken over)."""
    return min(count, (2.0 - weight) / weight)


@dataclass(frozen=True)
class Outlook:
    """One sequence's expectations at one pipeline depth, read once per decode step (the controller's
    (sequence, depth) table, runtimes/speculation.py)."""
    tokens: float  # AcceptancePolicy.tokens_per_step
    hopeful: float  # the same, optimistic (`confidence` standard errors higher)
    bound: float  # AcceptancePolicy.bound at that depth's step cost


@dataclass
class SequenceAcceptance:
    """One sequence's record: its averaged acceptance and where it is in the state machine."""
    alpha: float
    speculating: bool = True
    outcomes: int = 0  # speculation outcomes since speculation (re)started
    plain_tokens: int = 0  # tokens decoded plainly since it fell back
    probe_after: int = 0  # plain tokens before the next probe (grows while probes keep failing)
    probing: bool = False  # speculating again after a fall-back, not yet shown to hold
    fallbacks: int = 0
    probes: int = 0
    kind: str = "greedy"  # of request: what the engine learned is kept per kind (AcceptancePolicy.start)
    # pipeline depth d -> [tokens per step of a d-slot pipeline while speculating (averaged), steps behind it];
    # a step of a d-slot pipeline is P / d speed steps (decode.Pipeline.shift's spacing), the bound's unit
    yields: dict = field(default_factory=dict)
    depth_run: tuple = (0, 0)  # (the depth of its last speed steps, how many in a row ran at it)


@dataclass
class AcceptancePolicy:
    slots: int  # P
    step_cost: float  # c(P)
    step_cost_source: str = "measured"
    weight: float = 0.1  # of each new outcome in the exponential average (about the last 10 outcomes count)
    prior: float = 1.0  # alpha shown before a sequence's first outcome (decisions wait for min_outcomes)
    min_outcomes: int = 8  # outcomes seen before a sequence may fall back
    # A probe speculates on text that recently lost: a few outcomes judge it (each probe of a low-acceptance
    # text costs its refill and these outcomes, about P plain tokens' time at acceptance 0.3).
    probe_outcomes: int = 4
    probe_after: int = 32
    max_probe_after: int = 512
    # Hysteresis by evidence: speculation is left only where an optimistic estimate still loses, the acceptance
    # (or measured yield) this many standard errors above its average. An average of ~10 outcomes dips below
    # alpha* by chance on text that speculates well, and each switch drains the pipelines; measured on
    # zoo:small at acceptance 0.82: a fixed margin of 0.1 on the bound still let a first sequence fall back
    # after 8 outcomes at 0.75 or 16 steps at 0.44 tokens a step (0.73 over the whole run), where the bound
    # was 1.4; at acceptance 0.35 the optimistic estimate loses after ~19 outcomes.
    confidence: float = 1.0
    # A sequence's tokens per speed step are measured once it has run this many speed steps at a depth (until
    # then yield_at its acceptance stands in): a sequence's own text, not the engine's average, is what it
    # emits (measured on zoo:small at acceptance 0.80: 0.73 tokens a step where the analytic bound says 0.63).
    yield_steps: int = 16
    yield_weight: float = 0.05  # of each speed step in the measured yield (about the last 20 steps count)
    # Until then the steps a miss costs are the engine's, learned per depth (miss_steps) over its steady speed
    # steps, each sum kept at (1 - miss_memory) a step: the bound's d - 1 counts a miss caught at the last
    # slot, an early-flush check catches one a slot or two in (measured speed-always on zoo:small: 1.7-2.2
    # steps at P = 4; the formula's 0.55 tokens a step at acceptance 0.73 where the runs made 0.62-0.68, and
    # sequences judged on it fell back at 512 positions where speculating ran 1.12x plain). d - 1 counts as
    # miss_prior misses of the sums.
    miss_memory: float = 1.0 / 512
    miss_prior: float = 4.0
    memory_weight: float = 0.05  # of each outcome in learned_alpha (about the last 20 outcomes of any sequence)
    learned_weight: int = 4  # outcomes learned_alpha counts as in a new sequence's average (< min_outcomes)
    # What the engine learned, per kind of request ("greedy", "sampled"): its recent acceptance over every
    # sequence of that kind, the outcomes behind it, and the wait between probes the last probe left.
    learned_alpha: dict = field(default_factory=dict)
    learned_outcomes: Counter = field(default_factory=Counter)
    learned_probe_after: dict = field(default_factory=dict)
    # depth -> decayed sums over steady speed steps: [steps of a depth-d pipeline, tokens, accepted, failed]
    learned_misses: dict = field(default_factory=dict)

    weighs_costs = True  # decides with the step costs measured on this host (several depths, plain steps timed)

    def cost_seed(self, slots: int) -> tuple[float, str]:
        """c(P) and where it comes from, until this host's steps are timed (runtimes/step_costs.py)."""
        return self.step_cost, self.step_cost_source

    @classmethod
    def for_manifest(cls, manifest, **knobs) -> "AcceptancePolicy":
        """Seeded as the step timer is (step_costs.seed_step_cost)."""
        return cls(manifest.slots, *seed_step_cost(manifest), **knobs)

    @property
    def threshold(self) -> float:
        """alpha* at the seed cost: below it the bound is under 1 (speculation loses). > 1: never speculate."""
        return self.threshold_at(self.step_cost)

    def threshold_at(self, cost: float, depth: int | None = None) -> float:
        """alpha* of a pipeline of DEPTH (None: P) slots whose step costs COST (its c)."""
        depth = self.slots if depth is None else depth
        if depth == 1:
            return float("inf")
        return 1.0 - (depth / cost - 1.0) / self.miss_steps(depth)

    @staticmethod
    def can_pay(cost: float, depth: int) -> bool:
        """Whether a DEPTH-slot pipeline whose step costs COST wins at any acceptance (alpha* < 1): only while a
        step of its d rows costs less than d plain tokens, whatever a miss costs."""
        return 1 < depth and cost < depth

    def miss_steps(self, depth: int) -> float:
        """Steps of a DEPTH-slot pipeline one failed speculation costs, as this engine's steady speed steps
        show: (steps - tokens) / the misses a token's acceptance a gives, 1 - a a token, at the pooled acceptance;
        the bound's DEPTH - 1 (a miss caught at the last slot) counted as miss_prior misses."""
        steps, tokens, accepted, failed = self.learned_misses.get(depth, (0.0, 0.0, 0.0, 0.0))
        misses = tokens * failed / (accepted + failed) if failed else 0.0
        return (max(steps - tokens, 0.0) + self.miss_prior * (depth - 1)) / (misses + self.miss_prior)

    def yield_at(self, alpha: float, depth: int) -> float:
        """Tokens a step of a DEPTH-slot pipeline emits at acceptance ALPHA: 1 / (1 + (1 - a) x miss_steps)."""
        return 1.0 / (1.0 + (1.0 - alpha) * self.miss_steps(depth))

    def depth_costs(self, cost: float | dict | None) -> dict[int, float]:
        """COST as {depth: c}: None is the seed at P, a number c at P, a dict c per depth the runtime may run."""
        if cost is None:
            return {self.slots: self.step_cost}
        return dict(cost) if isinstance(cost, dict) else {self.slots: cost}

    def best_depth(self, states: list[SequenceAcceptance], costs: dict[int, float]) -> int:
        """The pipeline depth d (of COSTS' keys) that emits the most tokens per unit of time for STATES:
        the largest sum_i t_i(d) x d / c(d), t_i(d) = tokens_per_step (the bound's units, a plain
        token costing 1). A shallower pipeline loses less to a miss (d - 1 steps' work) and its steps run
        fewer rows; a deeper one shares each weight read among more. Ties go to the deeper."""
        return self.best_of({d: self.depth_score(states, d, cost) for d, cost in costs.items()})

    @staticmethod
    def best_of(scores: dict[int, float]) -> int:
        """The depth of the highest of SCORES (depth_score per depth); ties go to the deeper."""
        return max(scores, key=lambda d: (scores[d], d))

    def depth_score(self, states: list[SequenceAcceptance], depth: int, cost: float) -> float:
        """Expected tokens per plain token's time of STATES in a DEPTH-slot pipeline whose step costs COST."""
        return self.score([self.tokens_per_step(s, depth) for s in states], depth, cost)

    @staticmethod
    def score(tokens: list[float], depth: int, cost: float) -> float:
        """depth_score of sequences expecting TOKENS per step each."""
        return sum(tokens) * depth / cost

    def outlook(self, state: SequenceAcceptance, depth: int, cost: float) -> Outlook:
        """STATE's expectations at DEPTH, its step costing COST: what every rule of one decode step reads."""
        return Outlook(self.tokens_per_step(state, depth), self.tokens_per_step(state, depth, optimistic=True),
                       self.bound(state, depth, cost))

    def describe(self) -> str:
        return (f"per sequence: speculate while the bound P/(c(1+(1-a)L)) > 1 at c measured on this host as it runs "
                f"and L the steps a miss costs, learned (now {self.miss_steps(self.slots):.2f}; seed c={self.step_cost:.2f}, "
                f"{self.step_cost_source}: acceptance > {self.threshold:.2f} at P={self.slots})")

    def start(self, kind: str = "greedy") -> SequenceAcceptance:
        """A new sequence's record (KIND of request: "greedy" or "sampled"): the engine's learned acceptance
        of that kind (counted as learned_weight outcomes: the sequence speculates until its own outcomes bring
        it to min_outcomes) and wait between probes where it has them, else the prior."""
        state = SequenceAcceptance(self.prior, probe_after=self.learned_probe_after.get(kind, self.probe_after), kind=kind)
        if self.learned_outcomes[kind] >= self.min_outcomes:
            state.alpha, state.outcomes = self.learned_alpha[kind], min(self.learned_weight, self.min_outcomes - 1)
        return state

    def observe(self, state: SequenceAcceptance, accepted: int, failed: int) -> None:
        """Fold one step's speculation outcomes into STATE (failed first: order only matters within a step).
        The first 1/weight outcomes since a (re)start are a plain mean (a bias-free start), then the
        exponential average takes over."""
        for outcome, count in ((0.0, failed), (1.0, accepted)):
            for _ in range(count):
                state.outcomes += 1
                state.alpha += max(self.weight, 1.0 / state.outcomes) * (outcome - state.alpha)
                self.learned_outcomes[state.kind] += 1
                learned = self.learned_alpha.get(state.kind, self.prior)
                weight = max(self.memory_weight, 1.0 / self.learned_outcomes[state.kind])
                self.learned_alpha[state.kind] = learned + weight * (outcome - learned)

    def stepped(self, state: SequenceAcceptance, accepted: int, failed: int, emitted: int | None = None,
                depth: int | None = None) -> None:
        """STATE's sequence ran in a speed step of a DEPTH-slot pipeline (None: P) that EMITTED tokens (0 or
        1; None: not counted): judged by its outcomes and its yield when it chose speculation, else it rode
        along, one step nearer its next probe."""
        if not state.speculating:
            self.waited(state)
            return
        self.observe(state, accepted, failed)
        depth = self.slots if depth is None else depth
        run = state.depth_run[1] + 1 if state.depth_run[0] == depth else 1
        state.depth_run = (depth, run)
        # The first P steps after a change of depth run the pipeline's change of spacing, not the depth's steady
        # state (measured on zoo:small: 0.33 tokens a step over 12 steps at depth 2 where it holds 0.4).
        if emitted is not None and run > self.slots:
            record = state.yields.setdefault(depth, [0.0, 0, 0.0])  # [average, steps, average of squares]
            record[1] += 1
            per_step = emitted * self.slots / depth  # P / d speed steps make one step of a d-slot pipeline
            weight = max(self.yield_weight, 1.0 / record[1])
            record[0] += weight * (per_step - record[0])
            record[2] += weight * (per_step * per_step - record[2])
            sums = self.learned_misses.setdefault(depth, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((depth / self.slots, emitted, accepted, failed)):  # a speed step is d / P of a step at d
                sums[i] = (1.0 - self.miss_memory) * sums[i] + value

    def waited(self, state: SequenceAcceptance) -> None:
        """STATE's sequence ran one decode step while it had chosen plain decoding (a plain token, or a
        speed step the batch's layout made it take): one step nearer its next probe."""
        state.depth_run = (0, 0)  # a plain step drains the pipeline: the next speed steps refill it
        if not state.speculating:
            state.plain_tokens += 1

    def tokens_per_step(self, state: SequenceAcceptance, depth: int | None = None, optimistic: bool = False) -> float:
        """Tokens a step of a DEPTH-slot pipeline (None: P) is expected to emit for STATE's sequence: its
        measured yield once measured, else yield_at its acceptance, at the prior until its outcomes judge it
        (`judged`, as its own rule waits for them). OPTIMISTIC: `confidence` standard errors higher."""
        depth = self.slots if depth is None else depth
        measured = self.measured_yield(state, depth, optimistic)
        if measured is not None:
            return measured
        return self.yield_at(self.acceptance(state, optimistic) if self.judged(state) else self.prior, depth)

    def judged(self, state: SequenceAcceptance) -> bool:
        """Whether STATE's own outcomes decide for it: min_outcomes of them (probe_outcomes in a probe), or its
        rule has left speculation (a probe that failed after 4 outcomes is judged: at the prior it would
        carry its batch on speculating while it waits for its next probe)."""
        return (not state.speculating
                or state.outcomes >= (self.probe_outcomes if state.probing else self.min_outcomes))

    def acceptance(self, state: SequenceAcceptance, optimistic: bool = False) -> float:
        """STATE's averaged acceptance; OPTIMISTIC: `confidence` standard errors above it, the standard error of
        a rate over the outcomes the average holds (an exponential average of weight w holds about (2 - w) / w),
        taken at (k + 1) / (n + 2) so that a run of all misses is not certain after four."""
        if not optimistic or state.outcomes == 0:
            return state.alpha
        held = _held(state.outcomes, self.weight)
        rate = (state.alpha * held + 1.0) / (held + 2.0)
        return min(1.0, state.alpha + self.confidence * math.sqrt(rate * (1.0 - rate) / held))

    def bound(self, state: SequenceAcceptance, depth: int, cost: float, optimistic: bool = False) -> float:
        """SPEED's speedup over plain decoding for STATE's sequence in a DEPTH-slot pipeline whose step costs
        COST: its measured tokens per step x DEPTH / COST once measured, else yield_at its acceptance x DEPTH /
        COST (OPTIMISTIC: either `confidence` standard errors higher)."""
        measured = self.measured_yield(state, depth, optimistic)
        if measured is None:
            measured = self.yield_at(self.acceptance(state, optimistic), depth)
        return measured * depth / cost

    def measured_yield(self, state: SequenceAcceptance, depth: int, optimistic: bool = False) -> float | None:
        """STATE's tokens per step at DEPTH once yield_steps steps measured it, else None. OPTIMISTIC: plus
        `confidence` standard errors of the average (over the steps it holds, about (2 - w) / w)."""
        record = state.yields.get(depth)
        if record is None or record[1] < self.yield_steps:
            return None
        if not optimistic:
            return record[0]
        held = _held(record[1], self.yield_weight)
        return record[0] + self.confidence * math.sqrt(max(record[2] - record[0] ** 2, 0.0) / held)

    def batch_speculates(self, states: list[SequenceAcceptance], speculating: bool = True,
                         cost: float | None = None, depth: int | None = None) -> bool:
        """Whether one iteration's decoding sequences (STATES) speculate together or all decode plainly.
        The bound's cost units (a plain run costs 1, a speed run c/P) and each sequence's expected
        tokens per speed step t_i (tokens_per_step):

            speed:  sum_i t_i / (c/P)        plain:  n / 1

        With one sequence this is its own bound > 1. Why not split the batch (speculators in a speed run,
        losers in a plain run of their own)? A speed step emits at most one token per sequence, so such
        an iteration emits at most n tokens for more than a plain run's cost, which emits exactly n for
        every sequence: splitting is never better, for the batch or for any one sequence. So losing
        sequences ride along in the speed run while the winners carry the batch; when the losers weigh
        more, everyone decodes plainly until probes (a sequence's average starting afresh) say otherwise.
        SPECULATING: this rule's last verdict (the scheduler keeps it apart from the row rule's); leaving
        speculation is judged at the optimistic estimates (see `confidence`). COST: c of this step on this host (None: the seed) for a
        pipeline of DEPTH slots (None: P; the P slots run at a shallower depth: decode.Pipeline.shift)."""
        cost = self.step_cost if cost is None else cost
        depth = self.slots if depth is None else depth
        # a sequence that left speculation counts at its estimate: it was judged losing, optimism stays with it
        return self.batch_wins([self.tokens_per_step(state, depth, optimistic=speculating and state.speculating)
                                for state in states], cost, depth)

    def batch_wins(self, tokens: list[float], cost: float, depth: int) -> bool:
        """batch_speculates of sequences expecting TOKENS per step each (the optimistic ones where it says)."""
        return self.can_pay(cost, depth) and self.score(tokens, depth, cost) > len(tokens)

    def losing(self, state: SequenceAcceptance, costs: dict[int, float]) -> bool:
        """Whether STATE's sequence speculates, has been judged (min_outcomes outcomes, probe_outcomes in a probe)
        and loses at every depth of COSTS ({depth: c}): the fall-back verdict. Judged at the optimistic estimate,
        except in a probe: a probe speculates on text that recently lost, so it must show that it wins (at
        acceptance 0.3, probes judged optimistically held by chance and reset the wait: 3-4 probes in 128 tokens)."""
        optimistic = not state.probing
        return (state.speculating and self.judged(state)
                and max(self.bound(state, depth, c, optimistic) for depth, c in costs.items()) < 1.0)

    def wants_speculation(self, state: SequenceAcceptance, cost: float | dict | None = None,
                          costs_settled: bool = True, losing: bool | None = None) -> bool:
        """Advance STATE's state machine at step cost COST (None: the seed; a dict: c per pipeline depth the
        runtime may run, the best of them judged); whether its sequence should speculate this step.
        COSTS_SETTLED False: COST is not yet measured on this host (the runtime is still timing its steps), so
        no fall-back is decided on it (the seed measured at build, on another host or under another load, put
        c(4) at 2.7 where this host's steps gave 1.7-2.1, and a first sequence at acceptance 0.75 fell back).
        LOSING: `losing(state, costs)` where the caller already worked it out this step (None: worked out here)."""
        costs = self.depth_costs(cost)
        if state.speculating:
            if costs_settled and (self.losing(state, costs) if losing is None else losing):
                if state.probing:  # the probe failed: wait longer next time
                    state.probe_after = min(2 * state.probe_after, self.max_probe_after)
                    self.learned_probe_after[state.kind] = state.probe_after
                state.speculating, state.probing, state.plain_tokens = False, False, 0
                state.fallbacks += 1
            elif state.probing and state.outcomes >= self.min_outcomes:
                state.probing, state.probe_after = False, self.probe_after  # the text became predictable
                self.learned_probe_after.pop(state.kind, None)
        elif state.plain_tokens >= state.probe_after:
            state.speculating, state.probing = True, True
            state.alpha, state.outcomes, state.yields = self.prior, 0, {}
            state.probes += 1
        return state.speculating and any(self.can_pay(c, depth) for depth, c in costs.items())


class AlwaysSpeculate:
    """The per-sequence rule switched off: every sequence speculates whenever the row policy lets it. It keeps
    no state per sequence and weighs no costs, so the controller never asks it for a bound, a depth or a verdict
    on costs (runtimes/speculation.py reads `weighs_costs`)."""
    weighs_costs = False

    def cost_seed(self, slots: int) -> tuple[float, str]:
        return assumed_step_cost(slots), describe_assumed_step_cost()

    def start(self, kind: str = "greedy") -> None:
        return None

    def waited(self, state) -> None:
        pass

    def stepped(self, state, accepted: int, failed: int, emitted: int | None = None, depth: int | None = None) -> None:
        pass

    def wants_speculation(self, state, cost: float | None = None, costs_settled: bool = True,
                          losing: bool | None = None) -> bool:
        return True

    def batch_speculates(self, states, speculating: bool = True, cost: float | None = None,
                         depth: int | None = None) -> bool:
        return True

    def describe(self) -> str:
        return "per sequence: off (every sequence speculates when the row budget allows)"
