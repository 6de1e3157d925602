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
    3. decode: ONE graph run for every decoding sequence, speed or plain, as the speculation controller
       decides (runtimes/speculation.py); its rows assembled by runtimes/step_rows.py:
         speed: P*n rows; each sequence's pipeline by runtimes/decode.py Pipeline's rules
                (enter, verify at the last slot, flush on a miss, optional early flush)
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

import functools
import itertools
import threading
import time
from collections import Counter, deque

from speedc.errors import GenerationError, OutOfMemory
from speedc.runtimes.acceptance_policy import AcceptancePolicy, AlwaysSpeculate
from speedc.runtimes.speculation import RowPolicy, SpeculationController
from speedc.runtimes.step_costs import StepCosts
from speedc.runtimes.backends.protocol import BatchBackendProtocol
from speedc.models.sampling import token_logprob
from speedc.runtimes.decode import DecodeStats, Pipeline, Request, absorb, absorb_exits, emit_token
from speedc.runtimes.prefill import PrefillTurns
from speedc.runtimes.prefix_cache import PrefixCache
from speedc.runtimes.sequence import DECODE, DONE, PREFILL, Event, Sequence
from speedc.runtimes.step_rows import bubble_positions, cached_positions, plain_rows, speed_rows


class BatchScheduler:
    """Owns a BatchBackend's pool; `submit` and `cancel` may be called from any thread, `step` from one."""

    def __init__(self, backend: BatchBackendProtocol, *, policy: RowPolicy | None = None,
                 acceptance: AcceptancePolicy | AlwaysSpeculate | None = None, prefill_chunk: int = 128,
                 first_token_alone: bool = False, costs: StepCosts | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        """FIRST_TOKEN_ALONE: an iteration whose prefill confirms a first token returns before decoding, so
        a stream of one sequence shows that token before the next graph run. COSTS: where decode steps' times
        are kept (SpeculationController). PREFIX_CACHE: where sequences that end leave their K/V rows and new
        ones take the rows of their prompt's longest cached prefix (where a prompt's rows do not depend on its
        chunking, so a hit changes no output: backend.keeps_prefixes)."""
        self.backend = backend
        self.prefix_cache = prefix_cache if backend.keeps_prefixes else None
        self.first_token_alone = first_token_alone
        self.controller = SpeculationController(backend.slots, backend.speculative, policy=policy,
                                                acceptance=acceptance, costs=costs)
        self.acceptance, self.costs = self.controller.acceptance, self.controller.costs
        self.prefill = PrefillTurns(prefill_chunk)
        self.waiting: deque[Sequence] = deque()
        self.occupied: list[Sequence] = []  # index = pool row
        self._ids = itertools.count()
        self._lock = threading.Lock()
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
        # a constrained draft masks slot 0's exit only (decode.absorb): no early-flush checks
        early_flush = early_flush and self.backend.early_checks and request.picker.constraint is None
        sequence = Sequence(next(self._ids), request, early_flush, DecodeStats(mode),
                            acceptance=self.acceptance.start("sampled" if request.picker.params.temperature > 0 else "greedy"))
        sequence.stats.policy = self.acceptance.describe()
        if request.depth_rule is not None:  # always on speed steps, one loop a slot
            if not self.backend.speculative:
                raise GenerationError("a depth rule runs on the pipeline's steps; this backend runs plain steps only")
            sequence.follow_rule(drafts=self.controller.policy.row_budget != 0)  # (the mode never speculates: none)
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
            self._decode(decoding, events)
        for sequence in [s for s in self.occupied if s.state == DONE]:
            self._release(sequence)
        return events

    def _decode(self, decoding: list[Sequence], events: list[Event]) -> None:
        """Step 3: the controller's step for the sequences without a depth rule; those with one take speed steps
        (a readout at each slot's end), or plain steps where their rule's plain decoding runs there (a recurrent
        core's), in the same run where the others take that kind, else in a run of their own."""
        plain_ruled = [s for s in decoding if s.on_plain_steps]
        ruled = [s for s in decoding if s.request.depth_rule is not None and not s.on_plain_steps]
        free = [s for s in decoding if s.request.depth_rule is None]
        if free:
            plan = self.controller.decide(free, self.backend.pool.length, self.backend.pool.width)
            if plan.leaves_speed:
                for sequence in free:
                    sequence.pipeline.drain()
            if plan.burst:
                for sequence in free:
                    sequence.stats.cost_samples += 1
            start = time.perf_counter()
            together = ruled if plan.speculate else plain_ruled
            kind, heads = (self._speed_step(free + together, events, plan.depth) if plan.speculate
                           else self._plain_step(free + together, events))
            self.controller.record(kind, len(free + together), time.perf_counter() - start, plan, heads)
            self.decode_steps[len(free + together)] += 1
            ruled, plain_ruled = ([], plain_ruled) if plan.speculate else (ruled, [])
        if ruled:
            self._speed_step(ruled, events, self.backend.slots)
            self.decode_steps[len(ruled)] += 1
        if plain_ruled:
            self._plain_step(plain_ruled, events)
            self.decode_steps[len(plain_ruled)] += 1

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
            start = time.perf_counter()
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
            if self.prefix_cache is not None:
                self.prefix_cache.reuse(sequence, self.backend.pool)
            # growing the pool for its cache (about a second a GB: new pages are zeroed) and copying a cached
            # prefix in are its prompt's cost, paid before its first token: not its decoding's
            sequence.stats.prefill_seconds += time.perf_counter() - start
            if sequence.prefill_target == 0:  # a one-token prompt under an exit rule: nothing to prefill
                sequence.start_decoding()

    def _refuse(self, sequence: Sequence, error: Exception, events: list[Event]) -> None:
        """SEQUENCE, at the head of the queue, cannot be admitted: it ends alone with ERROR (Sequence.error)."""
        with self._lock:
            self.waiting.popleft()
        events.append(sequence.fail_alone(error))

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

    @property
    def mode_switches(self) -> int:
        return self.controller.mode_switches

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
        if sequence.error is None and self.prefix_cache is not None:
            self.prefix_cache.keep(sequence, self.backend.pool)
        hole, last = sequence.row, len(self.occupied) - 1
        if hole != last:
            mover = self.occupied[last]
            self.backend.move(last, hole, cached_positions(mover, self.backend.pool.capacity, self.backend.slots))  # beyond: never read
            mover.row = hole
            self.occupied[hole] = mover
        self.occupied.pop()
        sequence.row = -1
        sequence.stats.host_costs = self.costs.report()

    def _bubbles(self) -> list[int]:
        return bubble_positions(self.occupied, self.backend.pool.capacity, self.backend.slots, self.backend.pool.length)

    def _prefill_chunk(self, events: list[Event]) -> None:
        group = self.prefill.group(self.occupied)
        if not group:
            return
        start = time.perf_counter()
        chunks = [s.request.prompt[s.prefilled:s.prefilled + self.prefill.chunk_size(s)] for s in group]
        last = [s.prefilled + len(chunk) == s.prefill_target for s, chunk in zip(group, chunks)]
        want = any(done and s.request.picker.needs_logits for s, done in zip(group, last))
        echo = group[0].request.prompt_logprobs is not None  # a group of one (PrefillTurns.group)
        readout = [s.readout_loops for s in group]
        argmax, logits = self.backend.prefill(group[0].row, chunks, group[0].prefilled, want or echo,
                                              None if readout == [None] * len(group) else readout)
        if echo and not last[0]:
            request = group[0].request
            try:
                request.prompt_logprob_values.append(
                    token_logprob(logits[0], request.prompt[group[0].prefilled + 1], request.prompt_logprobs))
            except Exception as error:
                events.append(group[0].fail_alone(error))
                return
        self.steps["prefill"] += 1
        elapsed = time.perf_counter() - start
        for row, (sequence, chunk, done) in enumerate(zip(group, chunks, last)):
            request = sequence.request
            sequence.prefilled += len(chunk)
            sequence.stats.prefill_seconds += elapsed
            if done:
                sequence.start_decoding()
                if sequence.prefill_target < len(request.prompt):  # its last prompt token runs on the decode steps
                    continue
                try:
                    token = request.picker.pick(logits[row] if want else None, int(argmax[row]), request.history)
                    if request.depth_rule is not None:  # a recurrent core's: read out after its loops, as in the steps
                        sequence.stats.exited(request.depth_rule.loops - 1)
                    self._emit(sequence, token, events)
                except Exception as error:
                    events.append(sequence.fail_alone(error))

    def _plain_step(self, decoding: list[Sequence], events: list[Event]) -> tuple[str, int]:
        """One plain step of DECODING. -> ("plain", 0: every plain step runs the same heads)."""
        tokens, positions, valid, want, readout = plain_rows(decoding, self._bubbles())
        start = time.perf_counter()
        argmax, logits = self.backend.plain_step(tokens, positions, valid, want, readout)
        self.steps["plain"] += 1
        for sequence in decoding:
            sequence.stats.steps += 1
            sequence.stats.plain_steps += 1
            b, rule = sequence.row, sequence.request.depth_rule
            try:
                token = sequence.request.picker.pick(logits[b] if want else None, int(argmax[b]), sequence.request.history)
                if rule is None:
                    self.acceptance.waited(sequence.acceptance)
                else:  # a recurrent core's rule: read out after its last loop
                    sequence.stats.exited(rule.loops - 1)
                self._emit(sequence, token, events)
            except Exception as error:
                events.append(sequence.fail_alone(error))
            sequence.stats.decode_seconds += time.perf_counter() - start
        return "plain", 0

    def _speed_step(self, decoding: list[Sequence], events: list[Event], pipeline_depth: int) -> tuple[str | None, int]:
        """One speed step with the P slots run as a pipeline of PIPELINE_DEPTH slots (slot spacing
        P / PIPELINE_DEPTH: decode.Pipeline.shift). -> ("full" when every stepping pipeline held PIPELINE_DEPTH
        tokens, "speed" else, None when no sequence stepped; the head rows it ran: step_costs groups by them)."""
        rows = speed_rows(decoding, self._bubbles(), self.backend.slots, pipeline_depth, events)
        if not rows.stepping:
            return None, 0
        start = time.perf_counter()
        result = self.backend.speed_step(rows.entering, rows.positions, rows.valid, rows.heads, rows.want_logits)
        self.steps["speed"] += 1
        for sequence, places in rows.stepping:
            stats = sequence.stats
            stats.steps += 1
            stats.speed_steps += 1
            depth = self.backend.slots if sequence.request.depth_rule else pipeline_depth
            stats.depth_steps[depth] = stats.depth_steps.get(depth, 0) + 1
            accepted, failed, emitted = stats.accepted, stats.failed_speculations, len(sequence.out)
            try:
                self._absorb(sequence, result.of_sequence(places), events)
            except Exception as error:
                events.append(sequence.fail_alone(error))
                continue
            if sequence.request.depth_rule is None:  # (a rule's sequence speculates whatever its acceptance)
                self.acceptance.stepped(sequence.acceptance, stats.accepted - accepted, stats.failed_speculations - failed,
                                        len(sequence.out) - emitted, pipeline_depth)
            stats.decode_seconds += time.perf_counter() - start
        return "full" if rows.full else "speed", len(rows.heads)

    def _absorb(self, sequence: Sequence, outcome, events: list[Event]) -> None:
        """One sequence's share of a speed step: decode.absorb, or absorb_exits under a depth rule."""
        request, row = sequence.request, sequence.row
        emit = functools.partial(self._emit, sequence, events=events)  # token -> whether the sequence is done
        if request.depth_rule is None:
            absorb(sequence.pipeline, request, sequence.out, outcome, sequence.early_flush, emit)
        else:
            absorb_exits(sequence.pipeline, request, sequence.out, outcome, request.depth_rule,
                         lambda slot: self.backend.carried_state(slot, row), emit, sequence.drafts)
