"""What a batch backend provides to the scheduler (runtimes/batch.py), and the thread setting every
backend reads. runtimes/backends/onnx.py (ONNX Runtime) implements it; so does the PyTorch backend.

The scheduler keeps all bookkeeping (which slot holds which token, what to flush, who holds which
pool row); a backend owns the KV-cache pool [S, P, W, kvh, T+1, hd] (stage layer j, pipeline
slot s, pool row b, ...: logical layer s*S + j of sequence b is pool[j, s, b]) and runs graphs:

    prefill(first, chunks, start, want_logits)   prompt chunks of pool rows first.. through all N layers
    plain_step(tokens, positions, valid, ...)    one token of each of sequences 0..n-1 through all N layers
    speed_step(entering, positions, valid, heads, ...)
                                                 one pipelined step of sequences 0..n-1 ([P, n] slot-major)
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from speedc.errors import SpeedcError
from speedc.models.sampling import is_integer


def resolve_threads(threads: int | None) -> int:
    """Intra-op threads: the argument, else $SPEEDC_THREADS, else every core (None or 0: not given)."""
    if threads is not None and (not is_integer(threads) or threads < 0):
        raise SpeedcError(f"threads must be a positive integer (or None for every core), not {threads!r:.20}")
    given = os.environ.get("SPEEDC_THREADS", "0").strip() or "0"
    if not given.isdigit():
        raise SpeedcError(f"SPEEDC_THREADS={given!r:.20} is not a number of threads")
    return threads or int(given) or (os.cpu_count() or 1)


class BatchBackendProtocol(Protocol):
    slots: int  # P (1 for a plain engine)
    stage_layers: int  # S
    vocab_size: int
    max_context: int
    max_batch: int  # pool rows the pool may grow to
    capacity: int  # positions a pool row may grow to
    length: int  # positions T the pool holds now (row T: the scratch row bubbles may write)
    width: int  # pool rows W the pool holds now
    check_width: int  # K: candidate ids an early-flush check scores
    products: str  # what runs the weight products ("speedc kernel (avx2, 2 threads)", "MatMulNBits (why)", ...)

    @property
    def speculative(self) -> bool:
        """P > 1: the backend runs speed steps."""

    @property
    def early_checks(self) -> bool:
        """Whether a speed step can check a deeper slot's draft (early flush)."""

    def reserve(self, positions: int, sequences: int | None = None) -> None:
        """Make the pool hold POSITIONS positions for SEQUENCES pool rows (OutOfMemory when it cannot)."""

    def would_grow(self, positions: int, sequences: int) -> bool:
        """Whether reserve(POSITIONS, SEQUENCES) allocates a larger pool."""

    def free_pool(self) -> None:
        """Drop the pool while no sequence holds a pool row."""

    def move(self, source: int, target: int, length: int | None = None) -> None:
        """Pool row SOURCE's cache (its first LENGTH positions) and pipeline state now live in TARGET."""

    def prefill(self, first: int, chunks: list[list[int]], start: int,
                want_logits: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (argmax next tokens [B], logits [B, V] or None) after each chunk's last token."""

    def plain_step(self, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                   want_logits: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (argmax next tokens [n], logits [n, V] or None)."""

    def speed_step(self, entering: np.ndarray, positions: np.ndarray, valid: np.ndarray, heads,
                   want_logits: bool):
        """-> SpeedStepResult (runtimes/backends/onnx.py) for the HeadRows HEADS."""
