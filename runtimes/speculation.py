"""When a decode step speculates, and at which depth: the speculation controller, apart from the scheduler.

    controller = SpeculationController(slots, speculative, policy=RowPolicy(), acceptance=AcceptancePolicy(...))
    plan = controller.decide(decoding, length, width)   # once per decode step: StepPlan(speculate, depth, ...)
    ...the scheduler runs that step (runtimes/batch.py)...
    controller.record(kind, len(decoding), seconds, plan, heads)   # its time: a sample of this host's c(P)

It weighs three things, each measured: each sequence's acceptance (the acceptance policy,
runtimes/acceptance_policy.py: fall-backs, probes), the step costs on this host per batch size, context
band and pipeline depth (runtimes/step_costs.py), and the rows a step would run (RowPolicy). While
speculating it runs short bursts of plain steps to time plain decoding here (PLAIN_BURST), times a depth
it would not choose only where a verdict could change (EXPLORE_BELOW), and keeps a verdict far from
changing for a few steps (DECISION_REUSE). The scheduler owns the sequences, their pipelines and the
pool; this owns no sequence state but what the acceptance policy keeps per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from speedc.cost_model import analytic_bound
from speedc.runtimes.acceptance_policy import AcceptancePolicy, AlwaysSpeculate
from speedc.runtimes.step_costs import StepCosts

if TYPE_CHECKING:
    from speedc.runtimes.sequence import Sequence  # read here: id, acceptance (its policy record), stats, pipeline

# A shallower or deeper pipeline replaces the current one only when its expected tokens per unit of time
# beat the current depth's by this much (the estimates move with every outcome; a change costs a refill).
DEPTH_MARGIN = 0.05
# Plain steps a speculating scheduler runs to time plain decoding when its cost here is unknown or stale
# (StepCosts.needs_plain_sample), the first of them not a sample: a plain step right after speed steps runs
# cold (measured on zoo:small: 6-11 ms against 2.5 in a run of plain steps; the engine graph's other branch).
# A burst is long enough to give StepCosts.min_samples samples of its own (its plain quartile is paired with the
# speed steps around it).
PLAIN_BURST = (4, 8)  # (fewest, most) steps; it ends once the band holds enough samples
# Decode steps after which plain decoding's measured cost is re-timed (a burst) before speculation is left on it:
# the host's load moves in seconds, and a fall-back drains every pipeline.
CONFIRM_AGE = 64
# A depth not chosen is timed (a few steps at it, a change of spacing each way) only while the chosen depth's
# bound for some sequence is below this: where every sequence wins clearly, timing the others is a cost no
# verdict needs (measured on Parcae-770M's shapes at acceptance 1.0, P = 8: 47 of 175 steps at depths 4 and 2
# in 128 tokens, 1.05x plain against 1.26x speculating at 8 throughout).
EXPLORE_BELOW = 1.25
# Where every sequence speculates with a bound of at least this at the chosen depth (not in a probe), the
# verdict is kept for DECISION_REUSE steps: one miss moves a bound by ~0.1, and Python work between two runs of
# the session costs twice: ONNX Runtime's workers stop spinning and the next run waits to wake them (measured
# on zoo:small: 100 us of it made each 1.47 ms step 0.11 ms longer).
FAR_FROM_VERDICT = 1.15
DECISION_REUSE = 4

DEFAULT_ROW_BUDGET = 32  # RowPolicy's: 8 sequences at P = 4 (measured on zoo:small, docs/runtime.md "When to speculate")


@dataclass(frozen=True)
class Mode:
    """What a decoding mode (`--mode`, Engine.generate's mode=) sets in a scheduler. All emit the same tokens."""
    per_sequence: bool  # the acceptance policy decides per sequence (runtimes/acceptance_policy.py); else every
    # sequence speculates whenever the row policy lets it (AlwaysSpeculate)
    batch_row_budget: int | None  # a batch's row budget (the server, the concurrency bench); one sequence has none
    # (0: the mode never speculates, one sequence neither)

    @property
    def speculates(self) -> bool:
        return self.batch_row_budget != 0

    def row_policy(self, batch: bool) -> "RowPolicy":
        if not self.speculates:
            return RowPolicy(row_budget=0)
        return RowPolicy(row_budget=self.batch_row_budget if batch else None)


# speed: speculate while it pays on this host (the acceptance policy at the step costs measured as it runs,
# runtimes/step_costs.py), plain decoding else; speed-always: every step speculates (for measuring SPEED itself
# and for tests); autoregressive: plain decoding only.
MODES = {"speed": Mode(True, DEFAULT_ROW_BUDGET), "speed-always": Mode(False, None), "autoregressive": Mode(False, 0)}


@dataclass
class RowPolicy:
    """When to speculate, per step: SPEED runs P rows per sequence, plain decoding one. Speculate while
    the step has at most ROW_BUDGET rows (P * decoding sequences); above it the batch already shares
    each weight read across enough rows and discarded speculative rows cost real compute, so the step
    decodes plainly. Hysteresis: back to speculation only at or below RESUME_FRACTION of the budget
    (a switch flushes the in-flight work). See README "Continuous batching" for the measurement."""
    row_budget: int | None = DEFAULT_ROW_BUDGET  # rows a speculating step may run; None: no limit, 0: never speculate
    resume_fraction: float = 0.75

    def speculate(self, slots: int, sequences: int, speculating: bool) -> bool:
        if slots == 1:
            return False
        if self.row_budget is None:
            return True
        limit = self.row_budget if speculating else self.row_budget * self.resume_fraction
        return slots * sequences <= limit


@dataclass(frozen=True)
class StepPlan:
    """What one decode step runs: speculate (a speed step at DEPTH) or not (a plain step); BURST: a plain step
    the rules would have speculated, run to time plain decoding here; FRESH: the first run on a reallocated
    pool or of a burst (cold: timed as no sample); LENGTH, WIDTH: the pool's, where its time is filed."""
    speculate: bool
    depth: int
    burst: bool
    fresh: bool
    length: int
    width: int
    leaves_speed: bool = False  # the last decode step speculated and this one does not: in-flight work is dropped


class SpeculationController:
    def __init__(self, slots: int, speculative: bool, *, policy: RowPolicy | None = None,
                 acceptance: AcceptancePolicy | AlwaysSpeculate | None = None, costs: StepCosts | None = None) -> None:
        """SLOTS: the artifact's P; SPECULATIVE: whether its backend can speculate at all. COSTS: where decode
        steps' times are kept (an engine's, shared by its schedulers on one session; None: this controller's
        own, seeded with the acceptance policy's c(P))."""
        self.slots = slots
        self.policy = policy or RowPolicy()
        self.acceptance = acceptance or AlwaysSpeculate()
        self.costs = costs or StepCosts(slots, *self.acceptance.cost_seed(slots))
        # Plain steps are timed while speculating only where a rule decides with their cost.
        self.samples_plain = self.acceptance.weighs_costs
        self._burst = 0  # plain steps run so far in a burst timing plain decoding (0: none running)
        # The depths the P slots may run at (decode.Pipeline.shift's spacing P / d), where a rule chooses: P and
        # its divisors above 1 (P = 4: 4 and 2); plain decoding is the rules' other choice.
        self.depths = [d for d in range(slots, 1, -1) if slots % d == 0] if self.samples_plain else [slots]
        self.depth = slots  # the depth the policy chose
        self.depth_now = slots  # the depth this step runs at (the chosen one, or one being timed)
        self._confirm = False  # a fall-back waits for freshly timed plain steps (_costs_settled)
        self._exploring: list[int] | None = None  # [depth, steps left] while timing a depth it would not choose
        self._reuse = (0, ())  # (steps the last verdict still stands, the sequences it is for): _speculate
        self._geometry = None  # the pool's (length, width) at the last decode step: a step after a change is no sample
        self.acceptance_allows = self.rows_allow = speculative  # each policy's last verdict (_speculate)
        self.speculating, self.mode_switches = speculative, 0  # the last decode step's kind; changes of it so far

    def decide(self, decoding: list[Sequence], length: int, width: int) -> StepPlan:
        """The next decode step of DECODING (the scheduler's decoding sequences) on a pool of LENGTH x WIDTH."""
        speculate = self._speculate(decoding, length)
        burst = speculate and self._plain_burst(decoding, length)
        geometry = (length, width)
        fresh, self._geometry = geometry != self._geometry, geometry  # reallocated: the next run binds anew
        fresh = fresh or self._burst == 1  # a burst's first plain step runs cold
        speculate, left = speculate and not burst, False
        if speculate != self.speculating:
            self.mode_switches += 1
            left, self.speculating = not speculate, speculate
        return StepPlan(speculate, self.depth_now, burst, fresh, length, width, left)

    def _speculate(self, decoding: list[Sequence], length: int) -> bool:
        """Speed or plain step: each sequence's own choice (advancing its fall-back / probe state), the
        batch's sum of them (acceptance policy), both at the step cost measured on this host for this
        many sequences in this context band, then the row budget (row policy)."""
        slots = self.slots
        if slots == 1:
            return False
        left, batch = self._reuse
        if left and batch == tuple(s.id for s in decoding):
            self._reuse = (left - 1, batch)
            return self.acceptance_allows and self.rows_allow
        n = len(decoding)
        measured = {d: self.costs.step_cost(n, length, depth=d) for d in self.depths}
        costs = {d: cost for d, (cost, _) in measured.items()}
        settled, losing = self._costs_settled(decoding, costs, n, length)
        for sequence, verdict in zip(decoding, losing):  # each sequence's own rule first (it advances its state)
            self.acceptance.wants_speculation(sequence.acceptance, costs if len(costs) > 1 else costs[slots], settled,
                                              losing=verdict)
        states = [s.acceptance for s in decoding]
        # the (sequence, depth) table every rule below reads, once a step (a rule that weighs no costs has none)
        table = ({d: [self.acceptance.outlook(state, d, cost) for state in states] for d, cost in costs.items()}
                 if self.samples_plain else None)
        self.depth_now = self._choose_depth(table, costs, n, length)
        depth = self.depth  # the chosen depth (also while another is being timed): what the stats report
        # Each rule's hysteresis follows its own last verdict, not the batch's mode: a batch the acceptance
        # rule turned plain at the row budget (8 sequences at P = 4, budget 32) must speculate again when
        # its probes hold, though 32 rows is above the budget's resume mark (24).
        # The batch speculates where it wins at some depth (as a sequence falls back only where it loses at
        # every depth: judged at the chosen depth alone, a sequence that still won at another stayed plain, never
        # to probe), and leaves speculation only on settled costs.
        self.acceptance_allows = self._batch_wins(table, states, costs) or (self.acceptance_allows and not settled)
        self.rows_allow = self.policy.speculate(slots, n, self.rows_allow)
        for i, sequence in enumerate(decoding):  # what the decision rested on, in each sequence's stats
            stats, state = sequence.stats, sequence.acceptance
            stats.step_cost, stats.step_cost_source, stats.depth = round(costs[depth], 3), measured[depth][1], depth
            stats.bound = round(table[depth][i].bound if table is not None
                                else analytic_bound(depth, stats.acceptance_rate, costs[depth]), 3)
            if state is not None:
                stats.fallbacks, stats.probes = state.fallbacks, state.probes
        far = self.acceptance_allows and self._exploring is None and all(
            s.acceptance is not None and s.acceptance.speculating and not s.acceptance.probing
            and s.stats.bound >= FAR_FROM_VERDICT for s in decoding)
        self._reuse = (DECISION_REUSE - 1, tuple(s.id for s in decoding)) if far else (0, ())
        return self.acceptance_allows and self.rows_allow

    def _costs_settled(self, decoding: list[Sequence], costs: dict[int, float], sequences: int,
                       length: int) -> tuple[bool, list]:
        """(Whether speculation may be left on COSTS, each sequence's fall-back verdict where this worked it out,
        else None): every depth's c rests on this host's steps (not the seed), and where a sequence loses, the
        plain steps behind c were timed within CONFIRM_AGE steps; else a burst of plain steps (real tokens) is
        asked for first and the verdict waits for it."""
        unknown = [None] * len(decoding)
        if not self.samples_plain:  # a rule that takes no measured costs
            return True, unknown
        if not all(self.costs.measured_here(sequences, d) for d in self.depths):
            return False, unknown
        if self.costs.plain_age(sequences, length) <= CONFIRM_AGE:
            return True, unknown
        losing = [self.acceptance.losing(s.acceptance, costs) for s in decoding]
        if any(losing):
            self._confirm = True
            return False, losing
        return True, losing

    def _batch_wins(self, table: dict | None, states: list, costs: dict[int, float]) -> bool:
        """Whether the batch speculates at some depth by the acceptance rule (AcceptancePolicy.batch_speculates over
        TABLE: a sequence still speculating counts at its optimistic estimate while the batch speculates)."""
        if table is None:
            return self.acceptance.batch_speculates(states)
        return any(self.acceptance.batch_wins([o.hopeful if self.acceptance_allows and state.speculating else o.tokens
                                               for o, state in zip(table[d], states)], cost, d) for d, cost in costs.items())

    def _choose_depth(self, table: dict | None, costs: dict[int, float], sequences: int, length: int) -> int:
        """The depth the next speed step runs at: the policy's best at these costs (TABLE: the step's outlooks),
        kept unless another beats it by DEPTH_MARGIN; while a depth's cost here is unknown or stale and some
        sequence's bound at the chosen depth is near a verdict (below EXPLORE_BELOW), that depth for a few steps
        (its warm-up, samples and the pipeline's change of spacing) so the choice rests on measurements, once the
        chosen depth itself is measured (a fall-back verdict waits for every depth: _costs_settled).
        A change of depth drops nothing: decode.Pipeline.shift only spaces new entries."""
        if len(self.depths) == 1:
            return self.depths[0]
        scores = {d: self.acceptance.score([o.tokens for o in table[d]], d, cost) for d, cost in costs.items()}
        best = self.acceptance.best_of(scores)  # AcceptancePolicy.best_depth, from the table
        if scores[best] > scores[self.depth] * (1 + DEPTH_MARGIN):
            self.depth = best
        if self._exploring is not None:
            self._exploring[1] -= 1
            if self._exploring[1] > 0:
                return self._exploring[0]
            self._exploring = None
        if (self.acceptance_allows and not self.costs.needs_depth_sample(sequences, length, self.depth)
                and any(o.bound < EXPLORE_BELOW for o in table[self.depth])):
            stale = next((d for d in self.depths if d != self.depth and self.costs.needs_depth_sample(sequences, length, d)),
                         None)
            if stale is not None:
                self._exploring = [stale, self.costs.warmup + self.costs.min_samples + self.slots]
                return stale
        return self.depth

    def record(self, kind: str | None, sequences: int, seconds: float, plan: "StepPlan", heads: int) -> None:
        """A decode step of KIND ("plain", "speed", "full"; None: nothing ran) took SECONDS: a sample of this
        host's step costs, unless it was the first run since the pool was reallocated (FRESH: new buffers,
        new bindings). DEPTH: the pipeline depth a speed step ran at; HEADS: the head rows it ran."""
        if kind is None:
            return
        if plan.fresh:
            self.costs.tick()
            return
        length, width, depth, at = plan.length, plan.width, plan.depth, self.costs.kind_at
        self.costs.record(kind if kind == "plain" else at("speed", depth), sequences, length, seconds, width, heads)
        if kind == "full":
            self.costs.record(at("full", depth), sequences, length, seconds, width, heads)

    def _plain_burst(self, decoding: list[Sequence], length: int) -> bool:
        """Whether this step, which the rules would speculate, runs as a plain step to time plain decoding here
        (real tokens: a burst of PLAIN_BURST steps). One starts where plain decoding's cost in this band is
        unknown or stale, when no pipeline holds in-flight work (after prefill, after a miss: nothing to
        drop), or at once where the cost was never measured here or is twice as stale."""
        if not self.samples_plain:
            return False
        n = len(decoding)
        fewest, most = PLAIN_BURST
        if self._burst:
            if self._burst < most and (self._burst < fewest or self.costs.needs_plain_sample(n, length)):
                self._burst += 1
                return True
            self._burst = 0
            return False
        if self._confirm or (self.costs.needs_plain_sample(n, length) and (all(s.pipeline.empty for s in decoding)
                                                                           or self.costs.plain_overdue(n, length))):
            self._burst, self._confirm = 1, False
            return True
        return False
