r"""A looped model's own depth rules at decode time, per request: how many loops a token runs and at which
loop its logits are read (Ouro's published OuroForCausalLM.forward; the depth plan's `loop_exits`).

    h_i      the state after loop i, normed at the loop boundary (what the head reads as it is)
    lambda_i sigmoid(w . h_i + b)                             (model.early_exit_gate, kept in the manifest)
    p_i      lambda_i * prod_{j<i} (1 - lambda_j), i < n-1;   p_{n-1} = what is left   (n: the loops run)

    loops n           total_ut_steps: loops 0..n-1 run, the last read is n-1 (n <= the artifact's loops)
    exit_at_step k    logits = lm_head(h_k)
    exit_threshold t  logits = lm_head(h_k), k the first loop whose cumulative p reaches t (else n-1)
    weighted_exit     logits = sum_i p_i * lm_head(h_i)
    (none)            logits = lm_head(h_{n-1})

A recurrent core (Huginn's num_steps, Parcae's recurrence; the plan's `recurrent`) takes `loops` alone: its
repeats, up to the built R; the readout (coda and head, its own K/V at that depth) then reads the state after
that many, inside the slot they end in where a slot runs several, in the prefill and the steps alike
(contract.READOUT_REPEATS); its plain decoding runs the plain program with that readout (Sequence.on_plain_steps).

A token's exit is decided a loop at a time (TokenExit.after_loop), by the same code in both decode modes, on
the pipeline's steps (one loop a slot): plain decoding lets the next token enter at the exit, SPEED lets it
enter on a draft earlier and verifies it there (runtimes/decode.py absorb_exits). After its exit a token
still runs the deeper loops a later token may read the K/V of (exits decided by the gate), none beyond n,
and none beyond a fixed exit step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from speedc.errors import GenerationError
from speedc.models.sampling import is_integer

SETTINGS = ("loops", "exit_at_step", "exit_threshold", "weighted_exit")  # generate()'s keyword arguments
F32 = np.float32


def depth_settings(loops=None, exit_at_step=None, exit_threshold=None, weighted_exit=False) -> dict:
    """generate()'s depth keyword arguments as DepthRules.rule takes them."""
    return {"loops": loops, "exit_at_step": exit_at_step, "exit_threshold": exit_threshold, "weighted_exit": weighted_exit}


@dataclass(frozen=True)
class DepthRule:
    """One request's depth: LOOPS run (core repeats: Ouro's total_ut_steps, Huginn's num_steps), and the exit
    rule among them (at most one is set). The pipeline runs PER_SLOT loops a slot (exit rules: one), so the
    readout in a token's slot s follows loop min((s + 1) * PER_SLOT, LOOPS) - 1."""
    loops: int
    exit_at_step: int | None = None
    exit_threshold: float | None = None
    weighted: bool = False
    gate: "ExitGate | None" = field(default=None, compare=False, repr=False)  # where the rule reads it
    per_slot: int = 1
    recurrent: bool = False  # a recurrent core's: read out once, after its loops (the plain program can too)

    @property
    def reads_gate(self) -> bool:
        return self.exit_threshold is not None or self.weighted

    @property
    def slots(self) -> int:
        """The pipeline slots a token's loops take (the last may run more than they: their state is not read)."""
        return -(-self.loops // self.per_slot)

    def loop_at(self, slot: int) -> int:
        """The loop (from 0) whose state slot SLOT's readout reads."""
        return min((slot + 1) * self.per_slot, self.loops) - 1

    @property
    def head_slots(self) -> range:
        """The slots whose readout a token may exit at (the gate's rules: every loop, reading the weights as they come)."""
        if self.exit_at_step is not None:
            return range(self.exit_at_step, self.exit_at_step + 1)
        return range(self.slots) if self.reads_gate else range(self.slots - 1, self.slots)

    @property
    def run_slots(self) -> int:
        """Slots every token runs: through the last a token may exit at, whose K/V later tokens read there. A
        fixed exit step reads no deeper loop at all (loop k attends only loop k's K/V), so none deeper runs."""
        return self.exit_at_step + 1 if self.exit_at_step is not None else self.slots

    def describe(self) -> str:
        rule = ("weighted exit" if self.weighted else f"exit at step {self.exit_at_step}" if self.exit_at_step is not None
                else f"exit threshold {self.exit_threshold:g}" if self.exit_threshold is not None else "last loop")
        return f"{self.loops} loop{'s' * (self.loops != 1)}, {rule}"


@dataclass(frozen=True)
class DepthRules:
    """What an artifact allows: its loops, whether each loop's state is a readout (the plan's loop_exits) and
    runs in its own pipeline slot, and its exit gate (None: none stored)."""
    family: str
    loops: int
    loop_exits: bool
    one_loop_a_slot: bool
    gate: "ExitGate | None"
    recurrent: bool = False  # a recurrent core (Huginn, Parcae): loops is its repeats, read out after the coda
    slots: int = 1  # the pipeline's P (1: a plain engine)

    @classmethod
    def of(cls, manifest) -> "DepthRules":
        """An artifact's (its Manifest): the depth plan's loops and loop_exits, its slots, the stored gate."""
        plan = manifest.depth_plan
        return cls(manifest.model.get("architecture", "this model"), plan.repeats, plan.loop_exits,
                   manifest.slots == plan.repeats, ExitGate.from_manifest(manifest.model.get("exit_gate")),
                   plan.recurrent, manifest.slots)

    def rule(self, loops=None, exit_at_step=None, exit_threshold=None, weighted_exit=False) -> DepthRule | None:
        """The checked rule of a request's settings (None: none given: the artifact's full depth as built)."""
        if loops is None and exit_at_step is None and exit_threshold is None and not weighted_exit:
            return None
        if self.recurrent:
            return self._recurrence(loops, exit_at_step, exit_threshold, weighted_exit)
        if not self.loop_exits:
            raise GenerationError(f"{self.family} has no per-request depth rules in speedc: loops, exit_at_step, "
                                  "exit_threshold and weighted_exit read a loop's state with the head as it is, which "
                                  "only a model normed after every loop has (Ouro, Nanbeige), and loops a recurrent "
                                  "core's repeats (Huginn, Parcae)")
        if not self.one_loop_a_slot:
            raise GenerationError(f"depth rules need one loop per pipeline slot; this artifact pipelines its {self.loops} "
                                  f"loops otherwise (rebuild with --slots {self.loops})")
        loops = self._loops(loops)
        if not isinstance(weighted_exit, bool):
            raise GenerationError(f"weighted_exit must be True or False, not {type(weighted_exit).__name__}")
        if sum((exit_at_step is not None, exit_threshold is not None, weighted_exit)) > 1:
            raise GenerationError("give one exit rule: exit_at_step, exit_threshold or weighted_exit")
        if exit_at_step is not None and (not is_integer(exit_at_step) or not 0 <= exit_at_step < loops):
            raise GenerationError(f"exit_at_step must be an integer in 0..{loops - 1} (loops count from 0), "
                                  f"not {exit_at_step!r:.20}")
        if exit_threshold is not None:
            if isinstance(exit_threshold, bool) or not isinstance(exit_threshold, (int, float, np.floating)) \
                    or not 0.0 <= float(exit_threshold) <= 1.0:
                raise GenerationError(f"exit_threshold must be a number in 0..1, not {exit_threshold!r:.20}")
            exit_threshold = float(exit_threshold)
        if (exit_threshold is not None or weighted_exit) and self.gate is None:
            raise GenerationError(f"exit_threshold and weighted_exit read an exit gate, which this {self.family} artifact "
                                  "does not hold (Ouro's checkpoints have one; loops and exit_at_step need none)")
        reads_gate = exit_threshold is not None or weighted_exit
        return DepthRule(loops, None if exit_at_step is None else int(exit_at_step), exit_threshold, weighted_exit,
                         self.gate if reads_gate else None)

    def _loops(self, loops) -> int:
        """A request's loop count: an integer in 1..the built loops (None: the built)."""
        if loops is not None and (not is_integer(loops) or not 1 <= loops <= self.loops):
            raise GenerationError(f"loops must be an integer in 1..{self.loops} (the artifact was built for {self.loops}), "
                                  f"not {loops!r:.20}")
        return self.loops if loops is None else int(loops)

    def _recurrence(self, loops, exit_at_step, exit_threshold, weighted_exit) -> DepthRule:
        """A recurrent core's rule (Huginn's num_steps, Parcae's recurrence): LOOPS repeats, then the readout."""
        if exit_at_step is not None or exit_threshold is not None or weighted_exit:
            raise GenerationError(f"{self.family} has no exit rules (exit_at_step, exit_threshold, weighted_exit need a "
                                  "model that reads out after every loop, as Ouro); give loops, its core's repeats")
        if self.slots < 2:
            raise GenerationError(f"this {self.family} artifact is plain (P = 1) and its loops per request are built "
                                  "for pipelined ones: rebuild it with --slots P (P > 1)")
        return DepthRule(self._loops(loops), per_slot=self.loops // self.slots, recurrent=True)


@dataclass(frozen=True)
class ExitGate:
    """model.early_exit_gate: Linear(H, 1) over a loop's normed state."""
    weight: np.ndarray  # [H] float32
    bias: float

    @classmethod
    def from_manifest(cls, stored: dict | None) -> "ExitGate | None":
        if not stored:
            return None
        return cls(np.asarray(stored["weight"], F32), float(stored["bias"]))

    def __call__(self, state: np.ndarray) -> F32:
        """lambda = sigmoid(w . h + b) of one state [H] (float32, as the published fp32 forward)."""
        logit = F32(np.dot(state.astype(F32), self.weight)) + F32(self.bias)
        return F32(1.0) / (F32(1.0) + np.exp(-logit, dtype=F32))


class TokenExit:
    """One token's way through its DepthRule, a loop at a time (loops in order 0, 1, ...)."""

    def __init__(self, rule: DepthRule) -> None:
        self.rule = rule
        self.remaining = F32(1.0)  # prod_{j<i} (1 - lambda_j)
        self.cumulative = F32(0.0)  # sum_{j<=i} p_j
        self.expected: np.ndarray | None = None  # the weighted exit's sum_i p_i * logits_i so far

    def after_loop(self, slot: int, gate: F32 | None, logits: np.ndarray | None) -> bool:
        """The loops of pipeline slot SLOT have run (one a slot where the rule reads the gate or a fixed step; GATE:
        its lambda where the rule reads the gate, but at the last loop; LOGITS: its [V] logits under the weighted
        exit). -> whether the token exits here (its logits: this slot's readout, or `expected`)."""
        rule, loop, last = self.rule, slot, slot == self.rule.slots - 1
        if rule.exit_at_step is not None:
            return loop == rule.exit_at_step
        if not rule.reads_gate:
            return last
        if last:
            p = self.remaining
        else:
            p, self.remaining = F32(gate * self.remaining), F32(self.remaining * (F32(1.0) - gate))
        self.cumulative = F32(self.cumulative + p)
        if rule.weighted:
            term = logits.astype(F32) * p
            self.expected = term if self.expected is None else self.expected + term
            return last
        return last or bool(self.cumulative >= F32(rule.exit_threshold))
