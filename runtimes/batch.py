"""Continuous batching: many sequences, each with its own P-slot SPEED pipeline and sampling stream,
advanced together one step at a time by any backend that provides runtimes/backends/protocol.py
(ONNX Runtime: runtimes/backends/onnx.py; PyTorch: runtimes/backends/torch_backend.py).

One scheduler iteration (`BatchScheduler.step`):

    1. cancelled sequences leave; waiting requests take free pool rows (FIFO; a request waits
       while none is free or the pool cannot grow to hold it (out of memory) beside the running ones,
       one longer than a pool row's capacity is refused at submit, never cut); the pool's width follows
       the occupied pool rows, its length the longest request (BatchBackend.reserve)
    2. prefill: one chunk (<= prefill_chunk tokens) of one sequence still prefilling, each in turn (in order
       of arrival: a long prompt never holds a later one's first token for more than one chunk a turn);
       when that chunk starts its prompt, batched with the first chunks of the sequences in the pool rows
       right after it that start theirs too (one run, right padded, within prefill_chunk tokens in all);
       a sequence's last chunk yields its first token
    3. decode: ONE graph run for every decoding sequence, speed or plain: the acceptance policy weighs
       each sequence's own acceptance (runtimes/acceptance_policy.py) at what a step costs on this host
       (runtimes/step_costs.py: every decode step is timed, per batch size and context band), the row
       policy the step's rows:
         speed: P*n rows; each sequence's pipeline by runtimes/decode.py Pipeline's rules
                (enter, verify at the last slot, flush on a miss, optional early flush); an early-flush
                check scores only the top K ids its token's first exit gave (the backend keeps
                them beside the token's hidden row: DraftCandidates)
         plain: n rows; each sequence's last confirmed token through all N layers
    4. finished sequences (EOS, stop string, max tokens, cancelled) free their pool row at once; the last
       occupied pool row moves into the hole so the occupied rows stay a prefix (contiguous cache views).
       A sequence whose own work fails (its grammar, its picker) ends alone with its error; only a failed
       graph run fails the step's sequences (EngineLoop)

Lossless: every emitted token of a sequence is picked by its own TokenPicker from the final logits of
its verified predecessor, whatever else shares the step; a switch between speed and plain steps only
flushes in-flight (unverified) work. So each sequence's output equals plain decoding of it alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from speedc.errors import GenerationError, OutOfMemory
from speedc.runtimes.acceptance_policy import AcceptancePolicy, AlwaysSpeculate
from speedc.runtimes.speculation import RowPolicy, SpeculationController
from speedc.runtimes.step_costs import StepCosts
from speedc.runtimes.backends.protocol import BatchBackendProtocol, HeadRows, SequenceHeads, SequenceOutcome
from speedc.models.sampling import token_logprob
from speedc.runtimes.decode import DecodeStats, InFlightToken, Pipeline, Request, emit_token
from speedc.runtimes.prefix_cache import PrefixCache

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
ROW_TILE = 64  # rows ONNX Runtime's fused prefill computes together (_chunk_size)


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


class BatchScheduler:
    """Owns a BatchBackend's pool; `submit` and `cancel` may be called from any thread, `step` from one."""

    def __init__(self, backend: BatchBackendProtocol, *, policy: RowPolicy | None = None,
                 acceptance: AcceptancePolicy | AlwaysSpeculate | None = None, prefill_chunk: int = 128,
                 first_token_alone: bool = False, costs: StepCosts | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        """FIRST_TOKEN_ALONE: an iteration whose prefill confirms a first token returns before decoding, so
        a stream of one sequence shows that token before the next graph run (a batch keeps its decode
        in the same iteration: the others are waiting for it). COSTS: where decode steps' times are kept
        (the engine's, shared by its schedulers on one session; None: this scheduler's own, seeded with the
        acceptance policy's c(P)). PREFIX_CACHE: where sequences that end leave their K/V rows and new ones
        take the rows of their prompt's longest cached prefix."""
        self.backend = backend
        # only where a prompt's rows do not depend on its chunking (the fused graphs; the standard ones' chunked
        # prefill differs ~1e-6 by where chunks begin), so a hit changes no output
        self.prefix_cache = prefix_cache if backend.keeps_prefixes else None
        self.first_token_alone = first_token_alone
        self.controller = SpeculationController(backend.slots, backend.speculative, policy=policy,
                                                acceptance=acceptance, costs=costs)
        self.acceptance, self.costs = self.controller.acceptance, self.controller.costs
        self.prefill_chunk = prefill_chunk
        self._prefill_turn = -1  # the id of the sequence the last prefill chunk was for (_prefill_group)
        self.waiting: deque[Sequence] = deque()
        self.occupied: list[Sequence] = []  # index = pool row
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.speculating = backend.speculative
        self.mode_switches = 0
        self.steps = {"speed": 0, "plain": 0, "prefill": 0}
        self.decode_steps: Counter[int] = Counter()  # sequences decoded together -> decode steps so far

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, request: Request, *, early_flush: bool = True) -> Sequence:
        if not request.prompt:
            raise GenerationError("empty prompt: give at least one token")
        need = len(request.prompt) + request.max_new_tokens
        if need > self.backend.pool.capacity:
            raise GenerationError(f"prompt ({len(request.prompt)} tokens) + max new tokens ({request.max_new_tokens}) "
                                  f"exceeds the KV-cache row of {self.backend.pool.capacity} positions (a larger KV-cache "
                                  "budget or fewer sequences: kv_cache_mb / max_batch, --kv-cache-mb / --max-batch)")
        mode = "batch speed" if self.backend.speculative and self.controller.policy.row_budget != 0 else "batch autoregressive"
        # a constrained draft masks slot 0's exit only (Pipeline via _absorb): no early-flush checks
        early_flush = early_flush and self.backend.early_checks and request.picker.constraint is None
        sequence = Sequence(next(self._ids), request, early_flush, DecodeStats(mode),
                            acceptance=self.acceptance.start("sampled" if request.picker.params.temperature > 0 else "greedy"))
        sequence.stats.policy = self.acceptance.describe()
        with self._lock:
            self.waiting.append(sequence)
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop SEQUENCE at the next step boundary (its pool row is freed then)."""
        sequence.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.occupied)

    # ---- one iteration ---------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events: list[Event] = []
        for sequence in [s for s in self.occupied if s.cancelled]:
            self._finish(sequence, "cancelled", events)
        if self.waiting:  # (checked without the lock first: a step of a full batch takes it not at all)
            with self._lock:
                for sequence in [s for s in self.waiting if s.cancelled]:
                    self.waiting.remove(sequence)
                    sequence.stats.stop_reason, sequence.state = "cancelled", DONE
                    events.append((sequence, None))
            self._admit(events)
        if self.occupied:  # the pool's width and length follow its requests (BatchBackend.reserve)
            self.backend.reserve(max(s.positions for s in self.occupied), len(self.occupied))
        if any(s.state == PREFILL for s in self.occupied):
            self._prefill_chunk(events)
        first_token = any(token is not None for _, token in events)  # only a prefill confirms one so far
        decoding = [s for s in self.occupied if s.state == DECODE]
        if decoding and not (first_token and self.first_token_alone):
            plan = self.controller.decide(decoding, self.backend.pool.length, self.backend.pool.width)
            if plan.speculate != self.speculating:
                self.mode_switches += 1
                self.speculating = plan.speculate
                if not plan.speculate:  # leaving speed mode: in-flight work is unverified
                    for sequence in decoding:
                        sequence.pipeline.flush_from(0)
                        sequence.pipeline.pending = None
            if plan.burst:
                for sequence in decoding:
                    sequence.stats.cost_samples += 1
            start = time.perf_counter()
            kind, heads = (self._speed_step(decoding, events, plan.depth) if plan.speculate
                           else self._plain_step(decoding, events))
            self.controller.record(kind, len(decoding), time.perf_counter() - start, plan, heads)
            self.decode_steps[len(decoding)] += 1
        for sequence in [s for s in self.occupied if s.state == DONE]:
            self._release(sequence)
        return events

    def _admit(self, events: list[Event]) -> None:
        """Waiting requests take free pool rows, first come first served, while the pool can grow to
        hold them. One whose cache the pool cannot grow to hold (out of memory) waits, and the requests
        behind it too, until running sequences leave; when none is left and it still does not fit, it
        ends alone with that error (Sequence.error), never cut short and never failing the others."""
        while len(self.occupied) < self.backend.pool.max_batch:
            with self._lock:
                if not self.waiting:
                    return
                sequence = self.waiting[0]
            try:
                self._grow_pool(self.occupied + [sequence])
            except OutOfMemory as error:
                if self.occupied:
                    return
                self._refuse(sequence, error, events)
                continue
            except Exception as error:  # e.g. a request the checks let through: it alone ends, rather than
                self._refuse(sequence, error, events)  # failing every step while it heads the queue
                continue
            with self._lock:
                self.waiting.popleft()
            sequence.row, sequence.state = len(self.occupied), PREFILL
            sequence.pipeline = Pipeline(self.backend.slots, sequence.stats)
            self.occupied.append(sequence)
            self._reuse_prefix(sequence)

    def _reuse_prefix(self, sequence: Sequence) -> None:
        """Its prompt's longest cached prefix goes into its pool row: prefill starts after it, with at least two
        tokens (_chunk_size). (A prompt whose log-probabilities are asked runs whole: each of its tokens'
        logits is needed.)"""
        if self.prefix_cache is None or sequence.request.prompt_logprobs is not None:
            return
        entry, reuse = self.prefix_cache.lookup(sequence.request.prompt, keep=2)
        if entry is not None:
            self.backend.pool.write_rows(sequence.row, entry.rows, reuse)
            sequence.prefilled = sequence.stats.cached_tokens = reuse

    def _keep_prefix(self, sequence: Sequence) -> None:
        """SEQUENCE is leaving: its prompt's rows (those prefilled) go to the prefix cache. Not the generated
        tokens' rows: a decode step computes a token's rows a run of one (not bitwise a prefill's, see
        _chunk_size); a chat's next turn holds them in its prompt, prefilled then and kept after it. Nor
        the rows of a prompt prefilled a token a run (its log-probabilities asked)."""
        if self.prefix_cache is None or sequence.row < 0 or sequence.request.prompt_logprobs is not None:
            return
        tokens = sequence.request.prompt[:sequence.prefilled]
        if len(tokens) > 1:
            self.prefix_cache.store(tokens, self.backend.pool.read_rows(sequence.row, len(tokens)))

    def _refuse(self, sequence: Sequence, error: Exception, events: list[Event]) -> None:
        """SEQUENCE, at the head of the queue, cannot be admitted: it ends alone with ERROR (Sequence.error)."""
        with self._lock:
            self.waiting.popleft()
        self._fail_alone(sequence, error, events)

    @staticmethod
    def _fail_alone(sequence: Sequence, error: Exception, events: list[Event]) -> None:
        """An error of SEQUENCE's own (its grammar, sampling, stop rule, or an admission it cannot get): it ends
        with ERROR (Sequence.error, stop_reason "error") and the step goes on for the others, whose outputs do
        not depend on it. Only a failed graph run (the shared step) fails them all (EngineLoop)."""
        sequence.error = error
        sequence.stats.stop_reason, sequence.state = "error", DONE
        events.append((sequence, None))

    def _grow_pool(self, sequences: list[Sequence]) -> None:
        """Grow the pool to hold SEQUENCES at their longest (no-op when it does); OutOfMemory when it cannot."""
        positions = max(s.positions for s in sequences)
        if not self.backend.pool.would_grow(positions, len(sequences)):
            return
        try:
            self.backend.reserve(positions, len(sequences))
        except OutOfMemory:
            if self.occupied:
                raise
            self.backend.free_pool()  # nothing in it to keep: try again without the old buffers held
            self.backend.reserve(positions, len(sequences))

    def run(self) -> None:
        while self.busy:
            self.step()

    def drop_running(self) -> list[Sequence]:
        """Forget every sequence holding a pool row and return them: after a step failed part way their state
        is unknown. Their pool rows are free for new requests (a prefill overwrites the cache); the waiting
        requests have not started and stay queued."""
        with self._lock:
            dropped = list(self.occupied)
            self.occupied.clear()
        for sequence in dropped:
            sequence.state, sequence.row = DONE, -1
        return dropped

    # ---- parts -----------------------------------------------------------------------------------
    def _emit(self, sequence: Sequence, token: int, events: list[Event]) -> bool:
        done = emit_token(sequence.request, sequence.out, token, sequence.stats)
        if sequence.first_token_seconds is None:
            sequence.first_token_seconds = time.perf_counter() - sequence.submitted
        events.append((sequence, token))
        if done:
            sequence.state = DONE
            events.append((sequence, None))
        return done

    def _finish(self, sequence: Sequence, reason: str, events: list[Event]) -> None:
        sequence.stats.stop_reason, sequence.state = reason, DONE
        events.append((sequence, None))
        self._release(sequence)

    def _release(self, sequence: Sequence) -> None:
        """Free SEQUENCE's pool row now; the last occupied row moves into the hole."""
        if sequence not in self.occupied:
            return
        if sequence.error is None:
            self._keep_prefix(sequence)
        hole, last = sequence.row, len(self.occupied) - 1
        if hole != last:
            mover = self.occupied[last]
            self.backend.move(last, hole, self._cached(mover))  # positions beyond are never read
            mover.row = hole
            self.occupied[hole] = mover
        self.occupied.pop()
        sequence.row = -1
        sequence.stats.host_costs = self.costs.report()

    def _cached(self, sequence: Sequence) -> int:
        """Cache positions of SEQUENCE that may hold K/V it will read: prompt, emitted tokens, in-flight ones."""
        return min(self.backend.pool.capacity, len(sequence.request.prompt) + len(sequence.out) + self.backend.slots)

    def _bubble_positions(self) -> list[int]:
        """Where each occupied sequence's bubbles run (index: pool row): just past what it may read
        (_cached), at most the pool's scratch row T. A bubble attends to every key below its position,
        so at T each cost an attention over the whole row (measured: the batch step's attention 3.5x
        the single-sequence step's at zoo:small, whose row holds its 1,024-token context); what it
        writes there is overwritten before any row reads it (every position a row reads is below _cached)."""
        return [min(self._cached(sequence), self.backend.pool.length) for sequence in self.occupied]

    def _prefill_group(self) -> list[Sequence]:
        """The sequences prefilled in this iteration: the one in the lowest pool row still prefilling, and when it starts
        its prompt, the sequences in the rows after it that start theirs too, while the padded batch
        (sequences x longest first chunk) stays within prefill_chunk tokens: requests arriving together
        share each weight read of their prefill (one run), and a decode step still waits for at most
        prefill_chunk tokens of prefill. Only first chunks batch (BatchBackend.prefill says why)."""
        prefilling = sorted((s for s in self.occupied if s.state == PREFILL), key=lambda s: s.id)
        if not prefilling:
            return []
        # turns go round the prefilling sequences in order of arrival: a long prompt (or one prefilled a token a run
        # for its log-probabilities) takes one chunk in turn, never every chunk before a later request's first
        head = next((s for s in prefilling if s.id > self._prefill_turn), prefilling[0])
        self._prefill_turn = head.id
        group = [head]
        if head.prefilled == 0 and head.request.prompt_logprobs is None:
            longest = min(len(head.request.prompt), self.prefill_chunk)
            for sequence in self.occupied[head.row + 1:]:
                if sequence.state != PREFILL or sequence.prefilled or sequence.request.prompt_logprobs is not None:
                    break
                length = max(longest, min(len(sequence.request.prompt), self.prefill_chunk))
                if (len(group) + 1) * length > self.prefill_chunk:
                    break
                group.append(sequence)
                longest = length
        return group

    def _prefill_chunk(self, events: list[Event]) -> None:
        group = self._prefill_group()
        if not group:
            return
        start = time.perf_counter()
        chunks = [s.request.prompt[s.prefilled:s.prefilled + self._chunk_size(s)] for s in group]
        last = [s.prefilled + len(chunk) == len(s.request.prompt) for s, chunk in zip(group, chunks)]
        want = any(done and s.request.picker.needs_logits for s, done in zip(group, last))
        echo = group[0].request.prompt_logprobs is not None  # a group of one (_prefill_group)
        argmax, logits = self.backend.prefill(group[0].row, chunks, group[0].prefilled, want or echo)
        if echo and not last[0]:
            request = group[0].request
            try:
                request.prompt_logprob_values.append(
                    token_logprob(logits[0], request.prompt[group[0].prefilled + 1], request.prompt_logprobs))
            except Exception as error:
                self._fail_alone(group[0], error, events)
                return
        self.steps["prefill"] += 1
        elapsed = time.perf_counter() - start
        for row, (sequence, chunk, done) in enumerate(zip(group, chunks, last)):
            request = sequence.request
            sequence.prefilled += len(chunk)
            sequence.stats.prefill_seconds += elapsed
            if done:
                request.history = list(request.prompt)
                sequence.stats.prompt_tokens = len(request.prompt)
                sequence.state = DECODE
                try:
                    token = request.picker.pick(logits[row] if want else None, int(argmax[row]), request.history)
                    self._emit(sequence, token, events)
                except Exception as error:
                    self._fail_alone(sequence, error, events)

    def _chunk_size(self, sequence: Sequence) -> int:
        """A sequence whose prompt's log-probabilities are asked prefills a token a run: the prefill graph's
        logits are those after a chunk's last token. Otherwise no chunk is ROW_TILE * k + 1 tokens long
        (one token among them) unless the prompt is one token: ONNX Runtime's fused prefill computes the
        rows of a chunk in tiles of ROW_TILE, and a tile of one row ~1e-6 apart from a longer tile, whose
        rows do not depend on where the chunk begins (measured at 1-130 tokens). So a prompt's K/V rows
        are bitwise the same however it is chunked, and whether a prefix came from the prefix cache."""
        if sequence.request.prompt_logprobs is not None:
            return 1
        remaining = len(sequence.request.prompt) - sequence.prefilled
        first = min(self.prefill_chunk, remaining)
        for size in range(first, max(first - ROW_TILE, 1), -1):
            rest = remaining - size
            if size % ROW_TILE != 1 and (rest == 0 or rest > self.prefill_chunk or rest % ROW_TILE != 1):
                return size
        return first

    def _plain_rows(self, decoding: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """A plain step's inputs: each decoding sequence's frontier token at its position, bubbles elsewhere;
        whether any wants logits."""
        n = len(self.occupied)
        tokens, positions, valid = np.zeros(n, np.int64), np.asarray(self._bubble_positions(), np.int64), np.zeros(n, bool)
        for sequence in decoding:
            frontier = sequence.frontier()
            tokens[sequence.row], positions[sequence.row], valid[sequence.row] = frontier.token, frontier.pos, True
        return tokens, positions, valid, any(s.request.picker.needs_logits for s in decoding)

    def _plain_step(self, decoding: list[Sequence], events: list[Event]) -> tuple[str, int]:
        """One plain step of DECODING. -> ("plain", 0: every plain step runs the same heads)."""
        tokens, positions, valid, want = self._plain_rows(decoding)
        start = time.perf_counter()
        argmax, logits = self.backend.plain_step(tokens, positions, valid, want)
        self.steps["plain"] += 1
        for sequence in decoding:
            sequence.stats.steps += 1
            sequence.stats.plain_steps += 1
            b = sequence.row
            try:
                token = sequence.request.picker.pick(logits[b] if want else None, int(argmax[b]), sequence.request.history)
                self.acceptance.waited(sequence.acceptance)
                self._emit(sequence, token, events)
            except Exception as error:
                self._fail_alone(sequence, error, events)
            sequence.stats.decode_seconds += time.perf_counter() - start
        return "plain", 0

    def _speed_step(self, decoding: list[Sequence], events: list[Event], pipeline_depth: int) -> tuple[str | None, int]:
        """One speed step with the P slots run as a pipeline of PIPELINE_DEPTH slots (slot spacing
        P / PIPELINE_DEPTH: decode.Pipeline.shift). -> ("full" when every stepping pipeline held PIPELINE_DEPTH
        tokens, "speed" else, None when no sequence stepped; the head rows it ran: step_costs groups by them)."""
        spacing = self.backend.slots // pipeline_depth
        slots, n = self.backend.slots, len(self.occupied)
        entering = np.zeros(n, np.int64)
        positions = np.empty((slots, n), np.int64)
        positions[:] = self._bubble_positions()  # [P, n]: bubbles' rows, each sequence's bubbles where _bubble_positions says
        valid = np.zeros((slots, n), bool)
        heads = HeadRows()
        stepping: list[tuple[Sequence, SequenceHeads]] = []  # each stepping sequence and where its heads' results sit
        for sequence in decoding:
            pipeline = sequence.pipeline
            if pipeline.pending is None and pipeline.empty:
                pipeline.pending = sequence.frontier()  # (re)entering speculation after prefill or plain steps
            enter = pipeline.shift(sequence.last_useful, spacing)
            if pipeline.empty:  # nothing left that could lead to another emission
                sequence.stats.stop_reason = sequence.stats.stop_reason or "max_new_tokens"
                sequence.state = DONE  # released after the step, with the others that finished
                events.append((sequence, None))
                continue
            b = sequence.row
            entering[b] = enter.token if enter is not None else 0
            for s, slot in enumerate(pipeline.slots):
                if slot is not None:
                    positions[s, b], valid[s, b] = slot.pos, True
            # The exit head drafts slot 0's successor over the whole vocabulary; an early-flush check of a
            # deeper slot scores only the candidates that token's own draft gave (kept by the backend).
            checked = [d for d in range(1, slots - 1) if pipeline.slots[d] is not None] if sequence.early_flush else []
            stepping.append((sequence, heads.add(b, n, [slot is not None for slot in pipeline.slots], checked)))
        if not stepping:
            return None, 0
        full = bool((valid[:, [s.row for s, _ in stepping]].sum(axis=0) == pipeline_depth).all())
        want = any(places.final is not None and s.request.picker.needs_logits for s, places in stepping)
        start = time.perf_counter()
        result = self.backend.speed_step(entering, positions, valid, heads, want)
        self.steps["speed"] += 1
        for sequence, places in stepping:
            stats = sequence.stats
            stats.steps += 1
            stats.speed_steps += 1
            stats.depth_steps[pipeline_depth] = stats.depth_steps.get(pipeline_depth, 0) + 1
            accepted, failed, emitted = stats.accepted, stats.failed_speculations, len(sequence.out)
            try:
                self._absorb(sequence, result.of_sequence(places), events)
            except Exception as error:
                self._fail_alone(sequence, error, events)
                continue
            self.acceptance.stepped(sequence.acceptance, stats.accepted - accepted, stats.failed_speculations - failed,
                                    len(sequence.out) - emitted, pipeline_depth)
            stats.decode_seconds += time.perf_counter() - start
        return "full" if full else "speed", len(heads)

    def _absorb(self, sequence: Sequence, outcome: SequenceOutcome, events: list[Event]) -> None:
        """The bookkeeping after one step, for one sequence (decode.Pipeline's rules)."""
        pipeline, guesses = sequence.pipeline, outcome.guesses
        oldest = pipeline.slots[-1]
        if oldest is not None:
            request = sequence.request
            y = request.picker.pick(outcome.final_logits, outcome.final_token, request.history)
            if self._emit(sequence, y, events):
                return
            pipeline.confirm(oldest.pos + 1, y)
        constraint = sequence.request.picker.constraint
        if constraint is None:
            pipeline.speculate(guesses.__getitem__, sequence.early_flush)
            return
        confirmed = len(sequence.request.prompt) + len(sequence.out) - 1  # the position of the last emitted token

        def draft(depth: int) -> int:
            """Slot 0's exit, masked by the grammar after the confirmed and in-flight tokens (runtimes/constraint.py)."""
            in_flight = sorted((s for s in pipeline.slots if s is not None and s.pos > confirmed), key=lambda s: s.pos)
            candidates = outcome.draft_candidates if outcome.draft_candidates is not None else [guesses[depth]]
            masked = constraint.draft(candidates, [s.token for s in in_flight])
            return guesses[depth] if masked is None else masked

        pipeline.speculate(draft, False)
