"""The KV-cache pool a batch backend holds (runtimes/backends/onnx.py, torch_backend.py): its buffers, its
size now, and the rules by which it grows and shrinks. One object, so both backends size, move and copy
their caches alike; a backend says only what its buffers are (their shapes per phase, how to make one).

    buffers[phase] = (K, V), each [..., W, kvh, T+1, hd]: pool row b at axis 2, position t at axis 4
    (the core pool [S, P, W, kvh, T+1, hd]: stage layer j, slot s; a depth plan's prelude / coda pools
    alike, speedc/format/cache_layout.py). Row T is scratch: bubbles write it, nothing reads it.

Sizes: the width W is a power of two >= the pool rows in use; the length T within an eighth of the longest
need, at least MIN_POOL_POSITIONS, at most `capacity`. The pool grows at once and shrinks only after
`shrink_after` reserve calls in a row asked for less (a burst of requests ending together does not shrink
it just before the next burst grows it again, each time copying it). A growth that does not fit is an
OutOfMemory with the pool intact: every new buffer is allocated before the old ones are let go.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from speedc.errors import GenerationError, OutOfMemory
from speedc.format.cache_layout import CORE

MIN_POOL_POSITIONS = 64  # the pool's smallest length T (a regrow copies the pool: not for every short request)
SHRINK_AFTER_STEPS = 64  # reserve calls in a row asking for less before the pool shrinks


def pool_width(need: int, low: int, high: int) -> int:
    """The pool width for NEED pool rows: the smallest power of two >= need, at least LOW, at most HIGH
    (a pool swinging around one width is not copied back and forth)."""
    return min(high, max(low, 1 << max(need - 1, 0).bit_length()))


def pool_length(need: int, low: int, high: int) -> int:
    """The pool length T for NEED positions: the smallest of 8, 9, ..., 15 x 2^k >= need (at most an eighth
    more than asked), at least LOW, at most HIGH. Attention costs by T, not by the positions in use
    (ONNX Runtime's GroupQueryAttention runs over the whole bound buffer: zoo:small's step 2.66 ms at
    T = 256 and 3.32 at T = 512 for the same 128 positions), so a 131-position request takes 144, not 256."""
    need = max(need, low, 1)
    step = 1 << max(need.bit_length() - 4, 0)  # an eighth of the power of two at or below need
    return min(high, -(-need // step) * step)


class KVPool:
    """SHAPES(T, W) -> {phase: shape of its K (and V) buffer}; ZEROS(shape) -> a zeroed buffer (OutOfMemory
    where it cannot be had); ITEMSIZE: bytes a value (for the error's size); WHERE: the device, for it."""

    def __init__(self, shapes: Callable[[int, int], dict[str, tuple]], zeros: Callable[[tuple], Any], itemsize: int, *,
                 max_batch: int, capacity: int, min_length: int = MIN_POOL_POSITIONS,
                 shrink_after: int = SHRINK_AFTER_STEPS, where: str = "") -> None:
        self.shapes, self.zeros, self.itemsize, self.where = shapes, zeros, itemsize, where
        self.max_batch, self.capacity = max_batch, capacity  # pool rows / positions it may grow to
        self.min_length, self.shrink_after = min_length, shrink_after
        self.length = 0  # positions T it holds per pool row now, at most capacity
        self.width = 0  # pool rows W it holds now, at most max_batch
        self.buffers: dict[str, tuple[Any, Any]] = {}  # phase -> (K, V); empty while freed
        self._shrink_pending = 0  # reserve calls in a row that asked for a smaller pool

    @property
    def key(self):
        """The core pool's K [S, P, W, kvh, T+1, hd] (None while freed)."""
        return self.buffers[CORE][0] if self.buffers else None

    @property
    def value(self):
        return self.buffers[CORE][1] if self.buffers else None

    @property
    def phase_buffers(self) -> dict[str, tuple[Any, Any]]:
        """A depth plan's prelude / coda pools (empty for a cycle)."""
        return {phase: pair for phase, pair in self.buffers.items() if phase != CORE}

    def would_grow(self, positions: int, sequences: int) -> bool:
        """Whether reserve(POSITIONS, SEQUENCES) has to allocate a larger pool."""
        return (pool_length(positions, self.min_length, self.capacity) > self.length
                or pool_width(sequences, 1, self.max_batch) > self.width)

    def reserve(self, positions: int, sequences: int | None = None) -> bool:
        """Make the pool hold POSITIONS (<= capacity) positions for each of SEQUENCES (<= max_batch; None: as
        now) pool rows. The occupied pool rows (a prefix) keep every position below min(old T, new T).
        -> whether the buffers were replaced (what was bound to the old ones is stale)."""
        size = self._next_size(positions, sequences)
        if size is None:
            return False
        length, width, grow = size
        try:
            buffers = {phase: (self.zeros(shape), self.zeros(shape)) for phase, shape in self.shapes(length, width).items()}
        except (MemoryError, OutOfMemory):
            self._shrink_pending = 0
            if not grow:  # a shrink that does not fit is retried later: the pool in place holds what is needed
                return False
            raise OutOfMemory(f"the KV-cache pool cannot grow to {length} positions x {width} pool rows "
                              f"({self._mib(length, width):,.0f} MiB{self.where}): out of memory; a smaller KV-cache "
                              "budget or fewer sequences (kv_cache_mb / max_batch, --kv-cache-mb / --max-batch)") from None
        keep, kept = min(self.length, length), min(self.width, width)
        if keep and kept:
            for phase, old in self.buffers.items():
                for new, pool in zip(buffers[phase], old):
                    new[:, :, :kept, :, :keep] = pool[:, :, :kept, :, :keep]
        self.buffers, self.length, self.width = buffers, length, width
        self._shrink_pending = 0
        return True

    def free(self) -> None:
        """Drop the buffers while no sequence holds a pool row: reserve then allocates the new pool without
        the old one beside it (a grow copies the old pool, so both are held at once)."""
        self.buffers = {}
        self.length = self.width = 0
        self._shrink_pending = 0

    def move(self, source: int, target: int, length: int | None = None) -> None:
        """Pool row SOURCE's cache (its first LENGTH positions; None: all) now lives in pool row TARGET."""
        cut = slice(None, length)
        for pair in self.buffers.values():
            for pool in pair:
                pool[:, :, target, :, cut] = pool[:, :, source, :, cut]

    def read_rows(self, row: int, length: int) -> list:
        """Copies of pool row ROW's first LENGTH positions, every buffer's (the prefix cache's entry)."""
        return [pool[:, :, row, :, :length].copy() for pair in self.buffers.values() for pool in pair]

    def write_rows(self, row: int, rows: list, length: int) -> None:
        """Pool row ROW's first LENGTH positions from ROWS (read_rows' list, of at least LENGTH positions)."""
        pools = [pool for pair in self.buffers.values() for pool in pair]
        for pool, saved in zip(pools, rows, strict=True):
            pool[:, :, row, :, :length] = saved[:, :, :, :length]

    def _next_size(self, positions: int, sequences: int | None) -> tuple[int, int, bool] | None:
        """(length T, width W, whether it grows) to take for POSITIONS x SEQUENCES, or None to stay as it is."""
        if positions > self.capacity:
            raise GenerationError(f"{positions} positions exceed the KV-cache row of {self.capacity}")
        sequences = self.width if sequences is None else sequences
        if not 0 < sequences <= self.max_batch:
            raise GenerationError(f"internal: {sequences} sequences for a pool of {self.max_batch}")
        length = pool_length(positions, self.min_length, self.capacity)
        width = pool_width(sequences, 1, self.max_batch)
        grow = length > self.length or width > self.width
        if not grow and (length, width) == (self.length, self.width):
            self._shrink_pending = 0
            return None
        if not grow:  # a shrink waits until the need has stayed low for shrink_after calls
            self._shrink_pending += 1
            if self._shrink_pending < self.shrink_after:
                return None
        return length, width, grow

    def _mib(self, length: int, width: int) -> float:
        return sum(2 * np.prod(shape, dtype=np.float64) for shape in self.shapes(length, width).values()) * self.itemsize / (1 << 20)
