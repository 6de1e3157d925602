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

    @property
    def positions(self) -> int:
        """Cache positions it may ever hold: prompt + max new tokens."""
        return len(self.request.prompt) + self.request.max_new_tokens

    @property
    def last_useful(self) -> int:
        """A token at position q is worth computing only if position q+1 may still be emitted."""
        return self.positions - 2

    def frontier(self) -> InFlightToken:
        """The last confirmed token at its position: what plain decoding runs next."""
        return InFlightToken(self.out[-1], len(self.request.prompt) + len(self.out) - 1)


Event = tuple[Sequence, int | None]  # (sequence, confirmed token) or (sequence, None) when it finished
