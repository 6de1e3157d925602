"""What a batch backend provides to the scheduler (runtimes/batch.py), and the thread setting every
backend reads. runtimes/backends/onnx.py (ONNX Runtime) implements it; so does the PyTorch backend.

The scheduler keeps all bookkeeping (which slot holds which token, what to flush, who holds which
pool row); a backend holds the KV-cache pool (a KVPool, runtimes/backends/kv_pool.py: [S, P, W, kvh, T+1, hd],
stage layer j, pipeline slot s, pool row b, ...: logical layer s*S + j of sequence b is pool[j, s, b]), what each in-flight
token carries from step to step (its hidden row, its draft's candidates: DraftCandidates) and runs graphs:

    prefill(first, chunks, start, want_logits[, readout_repeats])
                                                 prompt chunks of pool rows first.. through all N layers
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
from typing import Protocol

import numpy as np

from speedc.errors import SpeedcError
from speedc.format import contract
from speedc.models.sampling import is_integer
from speedc.runtimes.backends.kv_pool import KVPool


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


@dataclass(frozen=True)
class SequenceHeads:
    """Where one sequence's heads sit in a speed step's results (HeadRows.add)."""
    final: int | None  # index into final_tokens / final_logits (None: its oldest slot is a bubble)
    exit: int | None  # index into exit_tokens / exit_candidates (None: its slot 0 is a bubble)
    checks: dict[int, int]  # checked slot -> index into check_tokens
    loop_finals: dict[int, int] = field(default_factory=dict)  # under a depth rule: slot -> index into final_*


@dataclass
class HeadRows:
    """The heads one speed step runs, by row (s*n + b): the final head (FINAL), the exit head over the
    whole vocabulary (EXIT), and early-flush checks (CHECK), each scored over the top K ids its token's
    own draft gave (the backend keeps them: DraftCandidates)."""
    final: list[int] = field(default_factory=list)
    exit: list[int] = field(default_factory=list)
    check: list[int] = field(default_factory=list)
    readout_repeats: dict[int, int] = field(default_factory=dict)  # pool row -> the loops its final readout follows

    def __len__(self) -> int:
        """Head rows the step runs (what its cost follows beside its rows: runtimes/step_costs.py)."""
        return len(self.final) + len(self.exit) + len(self.check)

    def add(self, row: int, sequences: int, filled: list[bool], checked: list[int],
            loop_slots: list[int] | None = None, drafts: bool = True, readout_repeats: int | None = None) -> SequenceHeads:
        """Pool row ROW's heads among SEQUENCES: the final head where its oldest slot holds a token (FILLED:
        per slot), the draft where slot 0 does (and the sequence DRAFTS), a check at each slot in CHECKED. Under
        a depth rule the final head runs at LOOP_SLOTS instead (decode.exit_heads_wanted: each slot a readout),
        after READOUT_REPEATS loops where a recurrent core's readout reads within a slot (None: as built).
        -> where they come back in the step's result (SpeedStepResult.of_sequence)."""
        final = exit = None
        if readout_repeats is not None:
            self.readout_repeats[row] = readout_repeats
        loop_finals = {}
        for slot in loop_slots or []:
            loop_finals[slot] = len(self.final)
            self.final.append(slot * sequences + row)
        if filled[-1] and loop_slots is None:
            final = len(self.final)
            self.final.append((len(filled) - 1) * sequences + row)
        if filled[0] and drafts:
            exit = len(self.exit)
            self.exit.append(row)
        checks = {}
        for slot in checked:
            checks[slot] = len(self.check)
            self.check.append(slot * sequences + row)
        return SequenceHeads(final, exit, checks, loop_finals)


@dataclass
class SequenceOutcome:
    """What one speed step gave one sequence."""
    final_token: int | None  # argmax of the final head (None: no token left the last slot)
    final_logits: np.ndarray | None  # [V] when asked for
    guesses: dict[int, int]  # slot -> the exit head's token there (0: the draft; deeper: early-flush checks)
    draft_candidates: np.ndarray | None  # [K] the draft's top K ids (valid until the next step)
    loop_heads: dict[int, tuple] = field(default_factory=dict)  # under a depth rule: slot -> (argmax, logits or None)


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
        guesses = {slot: int(self.check_tokens[i]) for slot, i in heads.checks.items()}
        if heads.exit is not None:
            guesses[0] = int(self.exit_tokens[heads.exit])
        loop_heads = {slot: (int(self.final_tokens[i]), None if self.final_logits is None else self.final_logits[i])
                      for slot, i in heads.loop_finals.items()}
        return SequenceOutcome(None if final is None else int(self.final_tokens[final]),
                               None if final is None or self.final_logits is None else self.final_logits[final],
                               guesses, None if heads.exit is None else self.exit_candidates[heads.exit], loop_heads)


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
        slot, row = np.divmod(np.asarray(rows, np.int64), sequences)
        return self.ids[slot - 1, row]  # [C, K]

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
    pool: KVPool  # its size now (length T: row T is the scratch row bubbles may write; width W) and limits
    check_width: int  # K: candidate ids an early-flush check scores
    products: str  # what runs the weight products ("speedc kernel (avx2, 2 threads)", "MatMulNBits (why)", ...)

    @property
    def keeps_prefixes(self) -> bool:
        """Whether pool rows may be copied out and back in (pool.read_rows / write_rows: the prefix cache)."""

    @property
    def runner(self) -> object:
        """What runs the steps (an ONNX Runtime session, shared by the backends of one engine): step times
        measured on one backend hold for every backend of the same runner (runtimes/step_costs.py)."""

    @property
    def speculative(self) -> bool:
        """P > 1: the backend runs speed steps."""

    @property
    def early_checks(self) -> bool:
        """Whether a speed step can check a deeper slot's draft (early flush)."""

    def reserve(self, positions: int, sequences: int | None = None) -> None:
        """Make the pool hold POSITIONS positions for SEQUENCES pool rows (OutOfMemory when it cannot;
        pool.would_grow says whether it must grow)."""

    def free_pool(self) -> None:
        """Drop the pool while no sequence holds a pool row."""

    def move(self, source: int, target: int, length: int | None = None) -> None:
        """Pool row SOURCE's cache (its first LENGTH positions) and pipeline state now live in TARGET."""

    def prefill(self, first: int, chunks: list[list[int]], start: int, want_logits: bool,
                readout_repeats: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (argmax next tokens [B], logits [B, V] or None) after each chunk's last token. READOUT_REPEATS: chunk
        i's loops (None or an entry None: all), where its request runs fewer (a recurrent core's final readout)."""

    def plain_step(self, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
                   readout_repeats: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """-> (argmax next tokens [n], logits [n, V] or None). READOUT_REPEATS: as prefill's, per pool row."""

    def carried_state(self, slot: int, row: int) -> np.ndarray:
        """The state [H] slot SLOT of pool row ROW ended the last speed step with (float32; its readout's input
        where the slot ends in one: a depth rule's gate reads it)."""

    def speed_step(self, entering: np.ndarray, positions: np.ndarray, valid: np.ndarray, heads: HeadRows,
                   want_logits: bool) -> SpeedStepResult:
        """-> SpeedStepResult for the HeadRows HEADS."""
