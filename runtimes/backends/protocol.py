"""What a batch backend provides to the scheduler (runtimes/batch.py), and the thread setting every
backend reads. runtimes/backends/onnx.py (ONNX Runtime) implements it; so does the PyTorch backend.

The scheduler keeps all bookkeeping (which slot holds which token, what to flush, who holds which
pool row); a backend owns the KV-cache pool [S, P, W, kvh, T+1, hd] (stage layer j, pipeline
slot s, pool row b, ...: logical layer s*S + j of sequence b is pool[j, s, b]), what each in-flight
token carries from step to step (its hidden row, its draft's candidates: DraftCandidates) and runs graphs:

    prefill(first, chunks, start, want_logits)   prompt chunks of pool rows first.. through all N layers
    plain_step(tokens, positions, valid, ...)    one token of each of sequences 0..n-1 through all N layers
    speed_step(entering, positions, valid, heads, ...)
                                                 one pipelined step of sequences 0..n-1 ([P, n] slot-major);
                                                 HeadRows.add places each sequence's heads, and
                                                 SpeedStepResult.of_sequence reads its outcome back
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from speedc.errors import GenerationError, OutOfMemory, SpeedcError
from speedc.format import contract
from speedc.models.sampling import is_integer


MIN_POOL_POSITIONS = 64  # the pool's smallest length T (a regrow copies the pool: not for every short request)
SHRINK_AFTER_STEPS = 64  # see next_pool_size


def resolve_threads(threads: int | None) -> int:
    """Intra-op threads: the argument, else $SPEEDC_THREADS, else default_threads() (None or 0: not given)."""
    if threads is not None and (not is_integer(threads) or threads < 0):
        raise SpeedcError(f"threads must be a positive integer (or None for one per physical core), not {threads!r:.20}")
    given = os.environ.get("SPEEDC_THREADS", "0").strip() or "0"
    if not given.isdigit():
        raise SpeedcError(f"SPEEDC_THREADS={given!r:.20} is not a number of threads")
    return threads or int(given) or default_threads()


def default_threads(cpus: set[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu"),
                    cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """One thread per physical core this process may run on: decoding reads every weight once a token,
    and a second hardware thread on a core shares that core's load ports and caches without adding
    bandwidth, while a thread with no core of its own stalls every product's join. The cores are those
    of the CPU affinity (CPUS, taskset / cpuset), SMT siblings counted once (sysfs topology), at most
    the cgroup's CPU quota (a container's cpu.max), which os.cpu_count() sees none of."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            topology = sysfs / f"cpu{cpu}" / "topology"
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology here: each logical CPU a core
    count = len(cores) or 1
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return count


def _pool_width(need: int, low: int, high: int) -> int:
    """The pool width for NEED pool rows: the smallest power of two >= need, at least LOW, at most HIGH
    (a pool swinging around one width is not copied back and forth)."""
    return min(high, max(low, 1 << max(need - 1, 0).bit_length()))


def _pool_length(need: int, low: int, high: int) -> int:
    """The pool length T for NEED positions: the smallest of 8, 9, ..., 15 x 2^k >= need (at most an eighth
    more than asked), at least LOW, at most HIGH. Attention costs by T, not by the positions in use
    (ONNX Runtime's GroupQueryAttention runs over the whole bound buffer: zoo:small's step 2.66 ms at
    T = 256 and 3.32 at T = 512 for the same 128 positions), so a 131-position request takes 144, not 256."""
    need = max(need, low, 1)
    step = 1 << max(need.bit_length() - 4, 0)  # an eighth of the power of two at or below need
    return min(high, -(-need // step) * step)


def next_pool_size(pool, positions: int, sequences: int | None) -> tuple[int, int, bool] | None:
    """(length T, width W, whether it grows) a pool (BatchBackend, TorchBackend) is to take for POSITIONS
    x SEQUENCES (None: its width now), or None where it stays as it is: it grows at once, and shrinks only
    once POOL.shrink_after calls in a row asked for less (counted in POOL._shrink_pending)."""
    if positions > pool.capacity:
        raise GenerationError(f"{positions} positions exceed the KV-cache row of {pool.capacity}")
    sequences = pool.width if sequences is None else sequences
    if not 0 < sequences <= pool.max_batch:
        raise GenerationError(f"internal: {sequences} sequences for a pool of {pool.max_batch}")
    length = _pool_length(positions, pool.min_length, pool.capacity)
    width = _pool_width(sequences, 1, pool.max_batch)
    grow = length > pool.length or width > pool.width
    if not grow and (length, width) == (pool.length, pool.width):
        pool._shrink_pending = 0
        return None
    if not grow:  # a shrink waits until the need has stayed low for shrink_after calls
        pool._shrink_pending += 1
        if pool._shrink_pending < pool.shrink_after:
            return None
    return length, width, grow


def new_pool_buffers(pool, positions: int, sequences: int | None, allocate: Callable[[int, int], object],
                     mib: Callable[[int, int], float], where: str = ""):
    """(length T, width W, allocate(T, W)) where POOL (BatchBackend, TorchBackend) is to be resized for
    POSITIONS x SEQUENCES (next_pool_size's rules), else None. Every new buffer is allocated before the
    caller replaces the old ones, so a growth that does not fit is an OutOfMemory with the pool intact;
    a shrink that does not fit is simply retried later (the pool in place still holds what is needed)."""
    size = next_pool_size(pool, positions, sequences)
    if size is None:
        return None
    length, width, grow = size
    try:
        buffers = allocate(length, width)
    except (MemoryError, OutOfMemory):
        if not grow:
            pool._shrink_pending = 0
            return None
        raise OutOfMemory(f"the KV-cache pool cannot grow to {length} positions x {width} pool rows "
                          f"({mib(length, width):,.0f} MiB{where}): out of memory; a smaller KV-cache budget or "
                          "fewer sequences (kv_cache_mb / max_batch, --kv-cache-mb / --max-batch)") from None
    return length, width, buffers


def pool_would_grow(pool, positions: int, sequences: int) -> bool:
    """Whether POOL (BatchBackend, TorchBackend) has to allocate a larger pool for POSITIONS x SEQUENCES."""
    return (_pool_length(positions, pool.min_length, pool.capacity) > pool.length
            or _pool_width(sequences, 1, pool.max_batch) > pool.width)


@dataclass(frozen=True)
class SequenceHeads:
    """Where one sequence's heads sit in a speed step's results (HeadRows.add)."""
    final: int | None  # index into final_tokens / final_logits (None: its oldest slot is a bubble)
    exit: int | None  # index into exit_tokens / exit_candidates (None: its slot 0 is a bubble)
    checks: dict[int, int]  # checked slot -> index into check_tokens


@dataclass
class HeadRows:
    """The heads one speed step runs, by row (s*n + b): the final head (FINAL), the exit head over the
    whole vocabulary (EXIT), and early-flush checks (CHECK), each scored over the top K ids its token's
    own draft gave (the backend keeps them: DraftCandidates)."""
    final: list[int] = field(default_factory=list)
    exit: list[int] = field(default_factory=list)
    check: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        """Head rows the step runs (what its cost follows beside its rows: runtimes/step_costs.py)."""
        return len(self.final) + len(self.exit) + len(self.check)

    def add(self, row: int, sequences: int, filled: list[bool], checked: list[int]) -> SequenceHeads:
        """Pool row ROW's heads among SEQUENCES: the final head where its oldest slot holds a token (FILLED:
        per slot), the draft where slot 0 does, a check at each slot in CHECKED. -> where they come back
        in the step's result (SpeedStepResult.of_sequence)."""
        final = exit = None
        if filled[-1]:
            final = len(self.final)
            self.final.append((len(filled) - 1) * sequences + row)
        if filled[0]:
            exit = len(self.exit)
            self.exit.append(row)
        checks = {}
        for depth in checked:
            checks[depth] = len(self.check)
            self.check.append(depth * sequences + row)
        return SequenceHeads(final, exit, checks)


@dataclass
class SequenceOutcome:
    """What one speed step gave one sequence."""
    final_token: int | None  # argmax of the final head (None: no token left the last slot)
    final_logits: np.ndarray | None  # [V] when asked for
    guesses: dict[int, int]  # slot -> the exit head's token there (0: the draft; deeper: early-flush checks)
    draft_candidates: np.ndarray | None  # [K] the draft's top K ids (valid until the next step)


@dataclass
class SpeedStepResult:
    """What one speed step returns, in HeadRows' order (each array valid until the next step: bound buffers)."""
    final_tokens: np.ndarray  # [F] argmax of the final head
    final_logits: np.ndarray | None  # [F, V] when asked for
    exit_tokens: np.ndarray  # [E] argmax of the exit head
    exit_candidates: np.ndarray  # [E, K] its top K ids (what later checks of that token score)
    check_tokens: np.ndarray  # [C] the best of each check's candidates

    @classmethod
    def of(cls, outputs: dict[str, np.ndarray], want_logits: bool) -> "SpeedStepResult":
        return cls(outputs[contract.FINAL_TOKEN], outputs[contract.FINAL_LOGITS] if want_logits else None,
                   outputs[contract.EXIT_TOKENS], outputs[contract.EXIT_CANDIDATES], outputs[contract.CHECK_TOKENS])

    def of_sequence(self, heads: SequenceHeads) -> SequenceOutcome:
        """The outcome of the heads HeadRows.add placed for one sequence."""
        final = heads.final
        guesses = {depth: int(self.check_tokens[i]) for depth, i in heads.checks.items()}
        if heads.exit is not None:
            guesses[0] = int(self.exit_tokens[heads.exit])
        return SequenceOutcome(None if final is None else int(self.final_tokens[final]),
                               None if final is None or self.final_logits is None else self.final_logits[final],
                               guesses, None if heads.exit is None else self.exit_candidates[heads.exit])


class DraftCandidates:
    """The top K ids each in-flight token's draft gave, kept by the backend beside its hidden row: a check of
    that token in a deeper slot scores only these (contract.CHECK_CANDIDATES). ids[s, b] belongs to the
    token that ran slot s of pool row b in the last speed step; every token moves one slot deeper a step.

        checks(rows, n)           [C, K] for check rows s*n + b: ids[s - 1, b] (one slot shallower last step)
        stepped(exit_rows, ids)   after a step: every entry one slot deeper, slot 0 from this step's drafts
        move(source, target)      with the pool row"""

    def __init__(self, slots: int, max_batch: int, count: int) -> None:
        self.ids = np.zeros((slots, max_batch, count), np.int64)  # [P, B, K]

    def checks(self, rows: list[int], sequences: int) -> np.ndarray:
        depth, row = np.divmod(np.asarray(rows, np.int64), sequences)
        return self.ids[depth - 1, row]  # [C, K]

    def stepped(self, exit_rows: list[int], drafts: np.ndarray) -> None:
        self.ids[1:] = self.ids[:-1].copy()
        self.ids[0, exit_rows] = drafts  # exit rows are slot 0's: s*n + b with s = 0

    def move(self, source: int, target: int) -> None:
        self.ids[:, target] = self.ids[:, source]


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

    def speed_step(self, entering: np.ndarray, positions: np.ndarray, valid: np.ndarray, heads: HeadRows,
                   want_logits: bool) -> SpeedStepResult:
        """-> SpeedStepResult for the HeadRows HEADS."""
