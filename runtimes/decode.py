"""SPEED's per-sequence bookkeeping, run by the scheduler (runtimes/batch.py) for every sequence, a
single-sequence call being a batch of one.

One step of one sequence's pipeline (P slots, slot 0 youngest; each slot holds (token, position) or a bubble):

    1. the pending token enters slot 0; every other slot moved one deeper after the last step
    2. the step: every slot runs one stage; the oldest slot's final head gives the true token y for
       position q = oldest.pos + 1, slot 0's exit head a guess for its successor
    3. emit y (the full model's token, exactly as plain decoding picks it)
    4. verify: the in-flight token for position q must equal y, else flush every slot at >= q and
       let y enter next (the pipeline refills: P-1 steps without emission)
    5. early flush (optional): a deeper slot's exit guess is better informed than the guess that
       entered; if it contradicts the in-flight successor, flush now instead of at the last layer
    6. otherwise slot 0's exit guess enters next step

Every emitted token comes from the final head of a token whose predecessors were all verified, so
the output equals plain decoding; speculation only decides which work is reused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Generator

import numpy as np

from speedc.models.sampling import TokenPicker
from speedc.runtimes.exit_rule import DepthRule, TokenExit


@dataclass
class DecodeStats:
    mode: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)
    new_tokens: int = 0
    steps: int = 0  # graph runs after prefill
    accepted: int = 0  # speculations confirmed at the last layer
    mispredicted: int = 0  # speculations contradicted at the last layer (flush + refill)
    early_flushes: int = 0  # flushes triggered by a deeper exit head
    flushed_tokens: int = 0  # in-flight tokens discarded by any flush
    prefill_seconds: float = 0.0  # its prompt's: the prefill's runs, the pool's growth and prefix copy at admission
    decode_seconds: float = 0.0
    stop_reason: str = ""
    # The speculation policy's record of this sequence (runtimes/acceptance_policy.py, step_costs.py):
    speed_steps: int = 0  # decode steps it ran speculating
    plain_steps: int = 0  # decode steps it ran as plain tokens
    fallbacks: int = 0  # times the policy turned it to plain decoding (speculation did not pay)
    probes: int = 0  # times it speculated again after a fall-back, to measure its acceptance afresh
    cost_samples: int = 0  # plain steps run while it would have speculated, to time plain decoding here
    depth_steps: dict = field(default_factory=dict)  # pipeline depth -> speed steps it ran at that depth
    depth: int = 0  # the pipeline depth of the policy's last decision
    step_cost: float = 0.0  # c(P) of the policy's last decision (measured on this host, or the seed)
    step_cost_source: str = ""
    bound: float = 0.0  # the analytic bound at its acceptance and that c(P), at the last decision
    policy: str = ""  # the rule that decided
    host_costs: dict = field(default_factory=dict)  # step times measured on this host (StepCosts.report)
    depth_rule: str = ""  # the request's depth rule (runtimes/exit_rule.py; "": the artifact's full depth)
    exit_loops: dict = field(default_factory=dict)  # loop (from 0) -> emitted tokens whose logits were read there

    def exited(self, loop: int) -> None:
        """A token was emitted from the logits read after LOOP (from 0), under a depth rule."""
        self.exit_loops[loop] = self.exit_loops.get(loop, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        """Confirmed speculations / checked ones, a failure at the last layer or by an early flush alike
        (the alpha of the analytic bound; every report pools it this way)."""
        return pooled_acceptance([self])

    @property
    def failed_speculations(self) -> int:
        """Speculations that did not survive: contradicted at the last layer or by an early flush
        (what the analytic bound's 1 - alpha counts)."""
        return self.mispredicted + self.early_flushes

    @property
    def tokens_per_step(self) -> float:
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(acceptance_rate=round(self.acceptance_rate, 4), tokens_per_step=round(self.tokens_per_step, 4),
                    decode_tokens_per_second=round((self.new_tokens - 1) / self.decode_seconds, 2)
                    if self.decode_seconds > 0 else None)
        return data


def pooled_acceptance(runs) -> float:
    """DecodeStats.acceptance_rate over many runs (RUNS: their stats), summed before dividing."""
    runs = list(runs)
    accepted = sum(s.accepted for s in runs)
    checked = accepted + sum(s.failed_speculations for s in runs)
    return accepted / checked if checked else 0.0


@dataclass
class InFlightToken:
    """A token in flight: its id and the position it sits at (what its draft's top K ids and its hidden
    row are, the backend keeps: runtimes/backends/protocol.py DraftCandidates). Under a depth rule
    (absorb_exits) also its way through the rule, and once it exited, the logits read there until its
    successor is emitted from them (RESULT), then EMITTED: it rides on for its K/V only."""
    token: int
    pos: int
    exit: TokenExit | None = field(default=None, compare=False, repr=False)
    exit_loop: int = -1  # the loop its logits were read at (-1: not yet)
    result: tuple | None = field(default=None, compare=False, repr=False)  # (logits [V] or None, argmax)

    @property
    def emitted(self) -> bool:
        """It exited and its successor was emitted from its result (which is then dropped)."""
        return self.exit_loop >= 0 and self.result is None


class Pipeline:
    """P in-flight tokens (slot 0 youngest) and the rules that keep SPEED lossless, for one sequence
    (the scheduler, runtimes/batch.py, keeps one per sequence).

        shift(last_useful, spacing)
                            the pending token enters slot 0 (unless the token ahead of it is fewer than
                            SPACING slots deep), every other slot goes one stage deeper
        confirm(q, y)       y, confirmed at the last layer for position q, is checked against the
                            speculation for q: accepted, or the younger tokens are flushed and y re-enters
        speculate(exit_at)  early flush on a deeper exit head's disagreement; else slot 0's exit guess
    """

    def __init__(self, slots: int, stats: DecodeStats, pending: InFlightToken | None = None) -> None:
        self.slots: list[InFlightToken | None] = [None] * slots
        self.stats = stats
        self.pending = pending  # what enters slot 0 at the next step

    @property
    def empty(self) -> bool:
        return all(slot is None for slot in self.slots)

    def flush_from(self, q: int) -> None:
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.pos >= q:
                self.slots[i] = None
                self.stats.flushed_tokens += 1

    def drain(self) -> None:
        """Leaving speculation: every in-flight token is unverified work, and the pending draft is dropped."""
        self.flush_from(0)
        self.pending = None

    def holder(self, q: int) -> InFlightToken | None:
        return next((s for s in self.slots if s is not None and s.pos == q), None)

    def shift(self, last_useful: int, spacing: int = 1) -> InFlightToken | None:
        """Advance one stage; returns the token entering slot 0 (None: a bubble). A token at position q
        is worth computing only while q <= LAST_USEFUL (position q + 1 may still be emitted).

        SPACING g > 1 runs the P slots as a pipeline of depth P / g: a token enters only once the one ahead
        of it is at least g slots deep, so at most P / g tokens are in flight, each stage of S layers a
        step, and a step computes P / g rows (the fused graphs skip bubbles). Per token that is the work
        and the weight reads of a P / g-slot pipeline of g x S layers a slot, with its shorter refill
        after a miss; the pending draft waits (still pending) meanwhile. Which tokens are emitted never
        depends on it: the spacing only delays speculative entries."""
        pending = self.pending
        enter = pending if pending is not None and pending.pos <= last_useful else None
        if enter is not None and spacing > 1 and any(slot is not None for slot in self.slots[:spacing - 1]):
            self.slots = [None] + self.slots[:-1]  # the token ahead is too close: a bubble, the draft waits
            return None
        self.slots = [enter] + self.slots[:-1]
        self.pending = None
        return enter

    def confirm(self, q: int, y: int) -> None:
        successor = self.holder(q)
        if successor is not None and successor.token == y:
            self.stats.accepted += 1
        else:
            self.stats.mispredicted += successor is not None
            self.flush_from(q)
            self.pending = InFlightToken(y, q)

    def speculate(self, exit_token_at: Callable[[int], int], early_flush: bool) -> None:
        """EXIT_TOKEN_AT(s): the exit head's argmax for the token in slot s this step."""
        if self.pending is None and early_flush:
            for s in range(len(self.slots) - 2, 0, -1):  # deepest (best informed) first
                token = self.slots[s]
                if token is None:
                    continue
                guess = exit_token_at(s)
                successor = self.holder(token.pos + 1)
                if successor is not None and successor.token != guess:
                    self.flush_from(token.pos + 1)
                    self.pending = InFlightToken(guess, token.pos + 1)
                    self.stats.early_flushes += 1
                    break
        if self.pending is None and self.slots[0] is not None:
            self.pending = InFlightToken(exit_token_at(0), self.slots[0].pos + 1)


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    picker: TokenPicker
    stop: Callable[[list[int]], str | None]  # new ids -> stop reason or None
    history: list[int] = field(default_factory=list)
    # the prompt's own log-probabilities, with this many top alternatives (None: not asked): prefilled a
    # token a run (the prefill graph gives logits after each chunk's last token only)
    prompt_logprobs: int | None = None
    prompt_logprob_values: list = field(default_factory=list)  # TokenLogprob of prompt[1:], in order
    depth_rule: DepthRule | None = None  # loops and exit rule (runtimes/exit_rule.py); None: the full depth as built


Decoding = Generator[int, None, tuple[list[int], DecodeStats]]  # yields confirmed tokens, returns (ids, stats)


def run_to_end(decoding: Decoding) -> tuple[list[int], DecodeStats]:
    while True:
        try:
            next(decoding)
        except StopIteration as done:
            return done.value


def emit_token(request: Request, out: list[int], token: int, stats: DecodeStats) -> bool:
    """Record a confirmed token; True when generation is over."""
    out.append(token)
    request.history.append(token)
    stats.new_tokens = len(out)
    reason = request.stop(out)
    if reason is None and len(out) >= request.max_new_tokens:
        reason = "max_new_tokens"
    if reason:
        stats.stop_reason = reason
        return True
    return False


def absorb(pipeline: Pipeline, request: Request, out: list[int], outcome, early_flush: bool,
           emit: Callable[[int], bool]) -> None:
    """One speed step's OUTCOME (backends/protocol.SequenceOutcome) for one sequence: the token leaving the
    last slot is picked from its final logits and emitted (EMIT -> whether the sequence is done; it appends to
    OUT), verifying the draft behind it; then the next draft, and with EARLY_FLUSH the deeper slots' checks.
    Under a grammar the draft is slot 0's exit masked by the grammar after the confirmed and in-flight tokens
    (runtimes/constraint.py), and no early-flush check runs (it would score an unmasked exit)."""
    oldest = pipeline.slots[-1]
    if oldest is not None:
        y = request.picker.pick(outcome.final_logits, outcome.final_token, request.history)
        if emit(y):
            return
        pipeline.confirm(oldest.pos + 1, y)
    draft_next(pipeline, request, out, outcome, early_flush)


def draft_next(pipeline: Pipeline, request: Request, out: list[int], outcome, early_flush: bool) -> None:
    """After a step's emissions: slot 0's exit guess becomes the pending draft (where none is pending), with
    EARLY_FLUSH the deeper slots' checks first; under a grammar the draft is masked (absorb says how)."""
    guesses = outcome.guesses
    constraint = request.picker.constraint
    if constraint is None:
        pipeline.speculate(guesses.__getitem__, early_flush)
        return
    confirmed = len(request.prompt) + len(out) - 1  # the position of the last emitted token

    def draft(slot: int) -> int:
        in_flight = sorted((s for s in pipeline.slots if s is not None and s.pos > confirmed), key=lambda s: s.pos)
        candidates = outcome.draft_candidates if outcome.draft_candidates is not None else [guesses[slot]]
        masked = constraint.draft(candidates, [s.token for s in in_flight])
        return guesses[slot] if masked is None else masked

    pipeline.speculate(draft, False)


def exit_heads_wanted(pipeline: Pipeline, rule: DepthRule) -> list[int]:
    """The slots whose final head a step runs under RULE (slot s has just run its loops; an exit rule's: loop s):
    each token's that has not exited, within the slots its rule reads out at."""
    slots = pipeline.slots
    return [s for s in rule.head_slots if s < len(slots) and slots[s] is not None and slots[s].exit_loop < 0]


def absorb_exits(pipeline: Pipeline, request: Request, out: list[int], outcome, rule: DepthRule,
                 state_at: Callable[[int], np.ndarray], emit: Callable[[int], bool], drafts: bool = True) -> None:
    """One step's OUTCOME for a sequence under a depth rule (runtimes/exit_rule.py), its readouts at slot ends.

        1. each token that ran a loop it may exit at (exit_heads_wanted) takes that loop's head
           (OUTCOME.loop_heads: slot -> (argmax, logits or None)) and gate (of STATE_AT(slot): the state [H]
           the slot ended the step with) through its TokenExit; one that exits keeps the logits read there
        2. from the oldest: while the token at the last emitted position has exited, its successor is picked
           from those logits and emitted (EMIT), verifying the draft behind it (Pipeline.confirm: a miss
           flushes the younger tokens, the emitted one enters next); a younger token's exit waits its turn
        3. an emitted token rides on to the deepest slot a later token may read (DepthRule.run_slots), then
           leaves its slot
        4. with DRAFTS, slot 0's exit guess drafts the next token, as without a rule; without, only an emitted
           token enters (plain decoding: nothing speculative in flight, the next token entering at its
           predecessor's exit while that one's deeper loops run)

    Every emitted token is picked from the logits its rule reads, of a token whose predecessors were all
    verified, so the output equals the rule's plain decoding; drafts only decide which work is reused."""
    for s in range(len(pipeline.slots) - 1, -1, -1):  # oldest first
        token = pipeline.slots[s]
        if s not in outcome.loop_heads or token is None:
            continue
        argmax, logits = outcome.loop_heads[s]
        token.exit = token.exit or TokenExit(rule)
        gate = rule.gate(state_at(s)) if rule.reads_gate and s < rule.slots - 1 else None
        if token.exit.after_loop(s, gate, logits):
            if rule.weighted:
                logits = token.exit.expected
                argmax = int(np.argmax(logits))
            token.exit_loop, token.result = rule.loop_at(s), (None if logits is None else np.array(logits), argmax)
    while True:
        frontier = pipeline.holder(len(request.prompt) + len(out) - 1)
        if frontier is None or frontier.result is None:
            break
        (logits, argmax), frontier.result = frontier.result, None
        pipeline.stats.exited(frontier.exit_loop)
        y = request.picker.pick(logits, argmax, request.history)
        if emit(y):
            return
        pipeline.confirm(frontier.pos + 1, y)
    for s in range(rule.run_slots - 1, len(pipeline.slots)):
        if pipeline.slots[s] is not None and pipeline.slots[s].emitted:
            pipeline.slots[s] = None
    if drafts:
        draft_next(pipeline, request, out, outcome, False)
