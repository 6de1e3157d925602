"""What a backend provides to the decode loop, and the KV-cache layout they share.

The decode loop (runtimes/decode.py) is backend-agnostic: it asks a backend to prefill a chunk of
tokens through all N layers, or to run one pipelined step over the P slots, and keeps all
bookkeeping (which slot holds which token, what to flush) itself.

Cache layout (both backends): K and V are [S, P, kv_heads, T, head_dim]: stage layer j, slot s holds
logical layer s*S + j. A step reads cache[j] ([P, kvh, T, hd], one contiguous slab per stage layer)
and writes row positions[s] of each valid slot; prefill writes rows start..start+L-1 of every layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from speedc.errors import SpeedcError
from speedc.models.sampling import is_integer


def cache_slab(layer: int, stage_layers: int) -> tuple[int, int]:
    """(stage layer j, slot s) of the cache slab holding logical layer `layer` = s * S + j."""
    slot, stage_layer = divmod(layer, stage_layers)
    return stage_layer, slot


def resolve_threads(threads: int | None) -> int:
    """Intra-op threads: the argument, else $SPEEDC_THREADS, else every core (None or 0: not given)."""
    if threads is not None and (not is_integer(threads) or threads < 0):
        raise SpeedcError(f"threads must be a positive integer (or None for every core), not {threads!r:.20}")
    given = os.environ.get("SPEEDC_THREADS", "0").strip() or "0"
    if not given.isdigit():
        raise SpeedcError(f"SPEEDC_THREADS={given!r:.20} is not a number of threads")
    return threads or int(given) or (os.cpu_count() or 1)


@dataclass
class StepResult:
    final_token: int  # argmax of the oldest slot's final logits (meaningful when that slot is valid)
    final_logits: np.ndarray | None  # [V], only when asked for (sampling)
    exit_tokens: np.ndarray  # early-exit argmax: [1] (slot 0, the speculation) or [P] (all slots, when asked)


class Backend(Protocol):
    name: str
    slots: int  # P (1 for a plain engine)
    stage_layers: int  # S
    vocab_size: int
    max_context: int

    def reset(self, capacity: int) -> None:
        """Allocate (or clear) the cache for a request of at most `capacity` positions."""

    def prefill(self, ids: list[int], start: int, want_logits: bool) -> tuple[int, np.ndarray | None]:
        """Run ids at positions start.. through all N layers; return (argmax next token, logits [V] or None)."""

    def step(self, token: int, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
             all_exits: bool = False) -> StepResult:
        """One pipelined step: `token` enters slot 0; slot s is at positions[s]; invalid slots are bubbles.
        all_exits: return every slot's exit token (the early-flush check), not only slot 0's."""

