"""One request as the scheduler (runtimes/batch.py) carries it: its pool row, its SPEED pipeline, its output
and stats, and where it is in its life:

    waiting -> prefill (chunks of its prompt) -> decode (speed or plain steps) -> done
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from speedc.runtimes.decode import DecodeStats, InFlightToken, Pipeline, Request

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


@dataclass
class Sequence:
    """One request in the batch: its pool row, pipeline, output and stats."""
    id: int
    request: Request
    early_flush: bool
    stats: DecodeStats
    state: str = WAITING
    row: int = -1  # its row in the KV-cache pool (-1: none yet)
    prefilled: int = 0
    out: list[int] = field(default_factory=list)
    pipeline: Pipeline | None = None  # its in-flight tokens (decode.py's rules), set when it gets a pool row
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_seconds: float | None = None  # submit -> first confirmed token
    acceptance: object = None  # its record in the scheduler's acceptance policy
    error: Exception | None = None  # why it ended without finishing (stop_reason "error"), e.g. OutOfMemory
    drafts: bool = True  # under a depth rule (whose pipeline runs every slot): drafts enter behind a token
    # (SPEED), else only emitted tokens (plain decoding)

    @property
    def positions(self) -> int:
        """Cache positions it may ever hold: prompt + max new tokens."""
        return len(self.request.prompt) + self.request.max_new_tokens

    @property
    def last_useful(self) -> int:
        """A token at position q is worth computing only if position q+1 may still be emitted."""
        return self.positions - 2

    @property
    def prefill_target(self) -> int:
        """Prompt tokens prefilled. Under an exit rule all but the last: the prefill reads out the last loop, so
        the last prompt token runs its loops as the decode steps run a token's (decode.absorb_exits). A recurrent
        core's count is read out by the prefill as by the steps (readout_repeats): the whole prompt."""
        rule = self.request.depth_rule
        return len(self.request.prompt) - (rule is not None and not rule.recurrent)

    @property
    def readout_loops(self) -> int | None:
        """The loops a recurrent core's count reads out after (readout_repeats; None: the artifact's all)."""
        rule = self.request.depth_rule
        return rule.loops if rule is not None and rule.recurrent else None

    @property
    def on_plain_steps(self) -> bool:
        """Its rule's plain decoding runs on plain steps: a recurrent core reads out once, after its loops, which the
        plain program does too (readout_repeats); an exit rule reads out a loop at a time, on the pipeline's steps."""
        rule = self.request.depth_rule
        return rule is not None and rule.recurrent and not self.drafts

    def follow_rule(self, drafts: bool) -> None:
        """Its request has a depth rule: DRAFTS or not (plain decoding), no early-flush checks (the exit verifies)."""
        self.drafts, self.early_flush, self.stats.depth_rule = drafts, False, self.request.depth_rule.describe()
        self.stats.policy = ("depth rule: a draft behind every token, verified at its exit" if drafts
                             else "depth rule: plain decoding (the plain program, read out after its loops)"
                             if self.on_plain_steps else "depth rule: plain decoding (a token enters at its predecessor's exit)")

    def start_decoding(self) -> None:
        """Its prompt is prefilled (all but the last token under an exit rule): its history starts there."""
        self.request.history = list(self.request.prompt)
        self.stats.prompt_tokens = len(self.request.prompt)
        self.state = DECODE

    def fail_alone(self, error: Exception) -> "Event":
        """An error of its own (its grammar, sampling, stop rule, or an admission it cannot get): it ends with
        ERROR (stop_reason "error") and the step goes on for the others, whose outputs do not depend on it.
        Only a failed graph run (the shared step) fails them all (EngineLoop). -> its event."""
        self.error = error
        self.stats.stop_reason, self.state = "error", DONE
        return self, None

    def frontier(self) -> InFlightToken:
        """The last confirmed token (the last prompt token before any) at its position: what decoding runs next."""
        return InFlightToken(self.out[-1] if self.out else self.request.prompt[-1],
                             len(self.request.prompt) + len(self.out) - 1)


Event = tuple[Sequence, int | None]  # (sequence, confirmed token) or (sequence, None) when it finished
