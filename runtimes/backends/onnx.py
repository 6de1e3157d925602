"""The ONNX Runtime (CPU) backend: a KV-cache pool (a row per sequence) and the three graph runs the scheduler
(runtimes/batch.py) needs, for one sequence (Engine.generate / stream: a batch of one) and for continuous
batching alike. Imports numpy and onnxruntime only.

    pool K, V [S, P, W, kvh, T+1, hd]  (stage layer j, pipeline slot s, pool row b, ...)
    (a depth plan with a prelude / coda adds their pools beside it; speedc/format/cache_layout.py addresses all)

The pool's width W (pool rows) and length T (positions) follow the sequences in it (`reserve`):
W the smallest power of two >= the occupied pool rows, up to max_batch; T the smallest of 8, 9, ..., 15 x
2^k >= the longest prompt + max new tokens in it, at least MIN_POOL_POSITIONS, up to `capacity`
(--kv-cache-mb, else the context). The pool grows at once (and then takes the other axis's current need
too), and shrinks only after SHRINK_AFTER_STEPS steps in a row needed less (a burst of requests ending
together does not shrink it just before the next burst grows it again); an idle pool keeps its size.
- W: the fused batch step runs attention over all W pool rows, the free ones as padding rows; one
  client in a pool of 8 rows paid 8-16% more a step for them than in a pool of 1 (zoo:small).
- T: an Ouro-1.4B-shaped model keeps 1.5 MiB per position per sequence (96 logical layers = 24 blocks x
  4 loops, 16 KV heads x 128, K and V, fp32), so 8 rows of a 32K context would be 384 GiB before the
  first request; numpy refuses such an allocation on this machine (32 GiB of zeros raised MemoryError).
A pool that cannot grow is a one-line GenerationError, the old pool intact.

    prefill(b, chunks)  the engine graph's prefill, B rows: logical layer l = s*S + j reads pool[j, s, b:b+B]
    plain_step(n)       its prefill, n rows (one token per sequence): pool[j, s, :n]
    speed_step(n)       its batch step, P*n rows, slot-major (row s*n + b): slab (j, s) = pool[j, s, :n];
                        fused: stage layer j's whole pool[j] as one [P*W, ...] buffer (one attention a layer)

Every slab a graph reads is a contiguous view of the pool (sequences 0..n-1: the scheduler keeps the
occupied pool rows a prefix by moving the last one into a hole). Bubbles (empty pipeline slots,
sequences still prefilling) sit where the scheduler says: just past what their sequence may read
(runtimes/step_rows.py bubble_positions), at most row T (`length`), the scratch row each slab has. With the
fused graphs (GroupQueryAttention writes the cache in place, bound through IO binding) that is where
their K/V land (in the batch step, zeros: bubbles skip the layers and only attend), and no valid row
reads it before it is rewritten. With the standard graphs bubbles run at 0, new rows come back as
tensors and only valid rows are written here.

Fused steps run through a StepBinding per shape of step (its tensors bound once to buffers the step
writes and reads), so a step makes no binding call.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from speedc.format import contract
from speedc.format.initial_state import initial_states
from speedc.format.artifact import Manifest
from speedc.format.cache_layout import CacheLayout
from speedc.errors import GenerationError, SpeedcError
from speedc.runtimes.backends.kv_pool import MIN_POOL_POSITIONS, SHRINK_AFTER_STEPS, KVPool
from speedc.runtimes.backends.protocol import DraftCandidates, HeadRows, SpeedStepResult
from speedc.runtimes.backends.onnx_session import bound_address, onnxruntime_module, open_session, program_sessions
from speedc.runtimes.kernels.native import KV_BLOCK, KV_CACHES, kv_row_width

F32 = np.float32
MAX_STEP_BINDINGS = 1024  # fused step bindings kept (shapes seen: 54 at 8 sequences, 7 at one)
MAX_LAYOUTS = 4096  # valid-row patterns remembered (_layout); a few KB each at most



def pool_bytes_per_position(manifest: Manifest, value_bytes: float = 4) -> int:
    """K and V bytes one pool row needs per position (every cache entry: each logical layer, and a
    pipelined coda's second readout depth), at VALUE_BYTES a cached value (BatchBackend.cache_value_bytes)."""
    dims = manifest.dims
    entries = len(CacheLayout.from_manifest(manifest).entries)
    return math.ceil(2 * entries * dims.kv_heads * dims.head_dim * value_bytes)


def row_capacity(manifest: Manifest, max_batch: int, kv_cache_mb: float | None, value_bytes: float = 4) -> int:
    """Positions each of MAX_BATCH pool rows holds: KV_CACHE_MB shared among them (None: the model's
    whole context each), at most the context, at VALUE_BYTES a cached value. GenerationError when that
    leaves no room."""
    if max_batch < 1:
        raise GenerationError("max batch must be at least 1")
    context = manifest.dims.max_context
    if kv_cache_mb is None:
        return context
    if not 0 < kv_cache_mb < math.inf:  # also refuses nan
        raise GenerationError(f"--kv-cache-mb must be a finite number > 0, got {kv_cache_mb}")
    per_position = pool_bytes_per_position(manifest, value_bytes)
    capacity = min(context, int(kv_cache_mb * (1 << 20) / max_batch // per_position) - 1)  # - 1: the scratch row
    if capacity < 2:
        raise GenerationError(f"--kv-cache-mb {kv_cache_mb:g} leaves no room for {max_batch} sequences "
                              f"({per_position} bytes per position each)")
    return capacity


def kv_cache_choice(asked: str | None, native_cache: str | None, products: str, head_dim: int) -> str:
    """The KV pool's type (KV_CACHES): ASKED, else $SPEEDC_KV_CACHE, else NATIVE_CACHE (the twin's, where the
    session attends natively), else float32. Only a natively attending session keeps a float16 or int8 pool: asked
    elsewhere, a one-line GenerationError; from the environment, float32 there. int8 needs HEAD_DIM a multiple
    of its blocks (32)."""
    setting = os.environ.get("SPEEDC_KV_CACHE", "").strip()
    for name, where in ((asked, "the KV cache"), (setting, "SPEEDC_KV_CACHE")):
        if name and name not in KV_CACHES:
            raise GenerationError(f"{where} {name!r}: choose from {', '.join(KV_CACHES)}")
    if native_cache is None:
        if asked not in (None, "float32"):
            raise GenerationError(f"{asked} KV values need speedc's attention, which this session does not run "
                                  f"(products: {products}); it keeps a float32 cache")
        return "float32"
    chosen = asked or setting or native_cache
    if chosen == "int8" and head_dim % KV_BLOCK:
        raise GenerationError(f"an int8 KV cache needs head_dim a multiple of {KV_BLOCK} (this model's is {head_dim}); "
                              "float16 is the default")
    return chosen


def pool_binding(session, slabs: dict[str, np.ndarray]):
    """A new IO binding of SESSION (a ProgramSession) with each cache input of SLABS (name -> pool view) bound
    to its view, as past and as present: the same pool memory, written in place by GroupQueryAttention.
    A twin attending over the runtime's own pool (session.native_cache) takes them at each run instead."""
    binding = session.io_binding()
    if getattr(session, "native_cache", None) is not None:
        return binding
    for name, view in slabs.items():
        binding.bind_input(name, "cpu", 0, F32, list(view.shape), bound_address(binding, name, view, F32))
        present = contract.in_place_output(name)
        binding.bind_output(present, "cpu", 0, F32, list(view.shape), bound_address(binding, present, view, F32))
    return binding


class StepBinding:
    """One IO binding of a fused step graph for one shape of step: the cache slabs and every input and
    output bound to a buffer once, so a step writes its inputs into `inputs`, runs, and reads `outputs`
    (valid until the next run that binds the same buffers).

    Why one per shape and not one rebound as shapes change: rebinding a tensor of a binding that has
    run cost 80-100 us (ONNX Runtime 1.32, this machine), binding one on a fresh binding ~7 us; eight
    sequences' steps change their final or exit row counts almost every step (54 shapes in 101 steps,
    each seen again in later runs)."""

    def __init__(self, session, slabs: dict[str, np.ndarray], tensors: dict[str, tuple[np.ndarray, type, bool]]) -> None:
        """TENSORS: name -> (buffer, the dtype the graph takes or gives there, is output)."""
        self.session = session
        self.binding = pool_binding(session, slabs)
        # a twin attending over the runtime's own pool takes the slabs at each run (pool_binding bound none)
        self.caches = slabs if getattr(session, "native_cache", None) is not None else None
        self.inputs = {name: buffer for name, (buffer, _, output) in tensors.items() if not output}
        self.outputs = {name: buffer for name, (buffer, _, output) in tensors.items() if output}
        for name, (buffer, dtype, output) in tensors.items():
            bind = self.binding.bind_output if output else self.binding.bind_input
            bind(name, "cpu", 0, dtype, list(buffer.shape), bound_address(self.binding, name, buffer, dtype))

    def run(self) -> dict[str, np.ndarray]:
        if self.caches is None:
            self.session.run_with_iobinding(self.binding)
        else:
            self.session.run_with_iobinding(self.binding, self.caches)
        return self.outputs


class BatchBackend:
    name = "onnx-batch"

    def __init__(self, directory: Path, manifest: Manifest, max_batch: int, capacity: int, threads: int | None = None,
                 fused: bool | None = None, min_length: int = MIN_POOL_POSITIONS, shrink_after: int = SHRINK_AFTER_STEPS,
                 session=None, profile_prefix: str | None = None, kv_cache: str | None = None) -> None:
        """SESSION: another BatchBackend's session of this artifact (same fused choice), shared instead of
        opened again (a session is stateless between runs; the pool and its bindings stay this backend's).
        PROFILE_PREFIX: open the session profiling every run per op (end_profiling() names the file).
        KV_CACHE: the KV pool's type (runtimes/kernels/native.py KV_CACHES): "float32", or where the session's
        twin attends over the pool natively also "float16" or "int8" (None: $SPEEDC_KV_CACHE where it does,
        else the twin's float16; float32 where it does not)."""
        self.dims = dims = manifest.dims  # the model's sizes (read once at load: speedc/format/manifest_view.py)
        self.slots, self.stage_layers = manifest.slots, manifest.stage_layers
        self.vocab_size, self.max_context = dims.vocab_size, dims.max_context
        self.layout = CacheLayout.from_manifest(manifest)  # which pool slab each graph's cache input is
        self.check_width = contract.candidate_count(self.vocab_size)  # K of an early-flush check's candidates
        # a recurrent core's programs take the repeats each row's final readout follows (contract.READOUT_REPEATS)
        self.core_repeats = manifest.depth_plan.repeats if manifest.depth_plan.recurrent else None
        engine = contract.ENGINE
        if fused is None:
            fused = contract.fused(engine) in manifest.graphs
        self.fused = fused
        self.graph_name = contract.fused(engine) if fused else engine  # the one graph (and session) it runs
        self.session = session if session is not None else open_session(
            directory, manifest, self.graph_name, ["CPUExecutionProvider"], threads, profile_prefix)
        self.programs = program_sessions(self.session, self.graph_name, manifest)  # role -> its branch
        self.products = self.session.speedc_products
        self.hidden = np.zeros((self.slots, max_batch, dims.state_width), F32)  # last hidden_out, [slot, sequence]
        self.drafts = DraftCandidates(self.slots, max_batch, self.check_width)  # beside it, each token's draft's top K
        self._prefill_bindings: dict[tuple, tuple] = {}  # fused: (first pool row, count) -> (its prefill binding, slabs)
        self._steps: dict[tuple, StepBinding] = {}  # fused steps: (role, shape of the step) -> StepBinding, oldest first
        self._buffers: dict[tuple, np.ndarray] = {}  # (name, shape) -> the buffer every StepBinding binds NAME of SHAPE to
        self._layouts: dict[tuple, StepLayout] = {}  # (n, valid pattern, head rows) -> _layout's
        # the pool's type: float16 where the session's twin attends over it natively (passes/native_attention.py)
        self.kv_cache = kv_cache_choice(kv_cache, self.programs[contract.PREFILL].native_cache, self.products, dims.head_dim)
        self.cache_dtype = np.dtype(KV_CACHES[self.kv_cache][0])  # its buffers' numpy dtype
        self.cache_width = kv_row_width(self.kv_cache, dims.head_dim)  # the pool's last axis: one position's head
        self.cache_value_bytes = self.cache_width * self.cache_dtype.itemsize / dims.head_dim  # bytes a cached value
        self.pool = KVPool(self._pool_shapes, lambda shape: np.zeros(shape, self.cache_dtype), self.cache_dtype.itemsize,
                           max_batch=max_batch, capacity=capacity, min_length=min_length, shrink_after=shrink_after)
        self.reserve(0, 1)

    def _pool_shapes(self, length: int, width: int) -> dict[str, tuple]:
        return {phase: self.layout.pool_shape(phase, width, self.dims.kv_heads, length, self.cache_width)
                for phase in self.layout.phases}

    @property
    def keeps_prefixes(self) -> bool:
        """Whether pool rows can be copied out and back in (the prefix cache): the fused graphs' pool."""
        return self.fused

    @property
    def runner(self):
        return self.session

    @property
    def speculative(self) -> bool:
        return self.slots > 1

    def end_profiling(self) -> str:
        """The profile file of the engine session (a profiled backend): both programs' runs, their
        nodes named by program (speedc/bench/op_profile.py)."""
        return self.session.end_profiling()

    def reserve(self, positions: int, sequences: int | None = None) -> None:
        """The pool holds POSITIONS for each of SEQUENCES pool rows (KVPool.reserve, called once a step);
        where it was replaced, every binding into the old buffers is dropped."""
        if self.pool.reserve(positions, sequences):
            self._drop_bindings()

    def free_pool(self) -> None:
        """Drop the pool's buffers while no sequence holds a pool row (KVPool.free)."""
        self.pool.free()
        self._drop_bindings()

    def _drop_bindings(self) -> None:
        """Forget every binding into the pool (it was replaced or freed: they point into old buffers)."""
        self._prefill_bindings.clear()
        self._steps.clear()

    def move(self, source: int, target: int, length: int | None = None) -> None:
        """Pool row SOURCE's cache (its first LENGTH positions; None: all) and pipeline state now live
        in pool row TARGET."""
        self.pool.move(source, target, length)
        self.hidden[:, target] = self.hidden[:, source]
        self.drafts.move(source, target)

    # ---- running a graph -------------------------------------------------------------------------
    @property
    def early_checks(self) -> bool:
        """Whether the batch step can check a deeper slot's draft (early flush): a cycle's slots all read
        out at the same tap; a plan's prelude / coda readouts exist at slot 0 and slot P-1 only."""
        return self.speculative and not self.layout.pipelined_phases

    def carried_state(self, slot: int, row: int) -> np.ndarray:
        return self.hidden[slot, row].copy()

    def _logical_slabs(self, rows: slice) -> dict[str, np.ndarray]:
        """Prefill-graph cache inputs over pool rows ROWS (CacheLayout.prefill_slabs)."""
        return self.layout.prefill_slabs(self.pool.buffers, rows)

    def _stage_slabs(self, n: int) -> dict[str, np.ndarray]:
        """Batch-step cache inputs of sequences 0..n-1 (CacheLayout.step_slabs)."""
        return self.layout.step_slabs(self.pool.buffers, n, self.fused)

    def _new_rows(self, result: dict[str, np.ndarray]) -> dict:
        """A standard graph's new K/V rows by kind, and by (kind, phase) for a plan's prelude / coda."""
        rows = {kind: result[contract.new_rows(kind)] for kind in contract.KV_KINDS}
        rows.update({(kind, phase): result[contract.phase_new_rows(kind, phase)] for phase in self.pool.phase_buffers
                     for kind in contract.KV_KINDS if contract.phase_new_rows(kind, phase) in result})
        return rows

    def _step(self, role: str, shape: tuple, slabs: Callable[[], dict[str, np.ndarray]],
              tensors: Callable[[], dict[str, tuple]]) -> StepBinding:
        """The StepBinding of ROLE for SHAPE (made on first use; at most MAX_STEP_BINDINGS kept, the oldest
        dropped). TENSORS() -> name -> (shape, dtype, is output): each bound to this backend's buffer of
        that name and shape (steps run one at a time and their outputs are read before the next, so
        bindings share buffers)."""
        step = self._steps.get((role, shape))
        if step is None:
            bound = {}
            for name, (size, dtype, output) in tensors().items():
                buffer = self._buffers.get((name, size))
                if buffer is None:
                    buffer = self._buffers[name, size] = np.zeros(size, dtype)
                bound[name] = (buffer, dtype, output)
            if len(self._steps) >= MAX_STEP_BINDINGS:
                del self._steps[next(iter(self._steps))]
            step = self._steps[role, shape] = StepBinding(self.programs[role], slabs(), bound)
        return step

    def _initial_states(self, positions: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """[rows, H]: the drawn start state of each valid row's position (speedc/format/initial_state.py)."""
        if self.fused:  # no fused graph takes it (plans with an injection build standard graphs only)
            raise GenerationError("internal: a fused graph with a drawn initial state")
        return initial_states(self.dims.initial_state, positions, self.dims.hidden_size, valid)

    def _readout_repeats(self, rows: int, repeats: list | None = None) -> np.ndarray:
        """A recurrent core's programs' READOUT_REPEATS [ROWS]: row i reads out after REPEATS[i] core repeats
        (None, or an entry None: all of them). Only where the plan's core is recurrent (core_repeats)."""
        full = self.core_repeats
        return np.asarray([full if r is None else r for r in repeats or [None] * rows], np.int64)

    def _check_positions(self, positions: np.ndarray) -> None:
        """Fused graphs write K/V in place through raw pointers: a position past the scratch row T would
        write outside the pool, so it is refused, not run."""
        if positions.max(initial=0) > self.pool.length:
            raise GenerationError(f"internal: a row at position {int(positions.max())} in a pool of {self.pool.length} positions")

    def _run_standard(self, role: str, feeds: dict, slabs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """A standard graph: cache slabs fed as inputs, new K/V rows returned with OUTPUTS."""
        names = outputs + [contract.new_rows(kind) for kind in contract.KV_KINDS]
        if role == contract.BATCH_STEP:  # a depth plan's phases return their own new rows
            names += [contract.phase_new_rows(kind, phase) for phase in self.pool.phase_buffers for kind in contract.KV_KINDS]
        return dict(zip(names, self.programs[role].run(names, {**feeds, **slabs})))

    def prefill(self, first: int, chunks: list[list[int]], start: int, want_logits: bool,
                readout_repeats: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Run prompt chunks through all N layers: chunk i belongs to pool row first + i and starts at
        position START; a recurrent core's final readout of chunk i after READOUT_REPEATS[i] repeats (None: all). Several chunks only as first chunks (START 0): ONNX Runtime's GroupQueryAttention
        takes a batch of multi-token rows only without past context. They run as one [B, L] batch, right
        padded to the longest (chunk_lengths), so the B prompts share each weight read: on zoo:small one
        prefill of a few tokens costs about as much as one plain token (the weights streamed 16 times).
        -> (argmax next tokens [B], logits [B, V] or None) after each chunk's last token."""
        lengths = np.asarray([len(chunk) for chunk in chunks], np.int64)
        count, longest = len(chunks), int(lengths.max())
        if lengths.min() < 1:  # its head would read the row before it
            raise GenerationError("internal: an empty prefill chunk")
        if count > 1 and start and longest > 1:
            raise GenerationError("internal: a batched prefill of chunks that have past context")
        ids = np.zeros((count, longest), np.int64)  # the padding's id is never read back
        for row, chunk in enumerate(chunks):
            ids[row, :len(chunk)] = chunk
        feeds = {contract.INPUT_IDS: ids, contract.POSITIONS: np.full(count, start, np.int64), contract.CHUNK_LENGTHS: lengths}
        if self.dims.initial_state is not None:  # token (row, t) at position start + t; padding gets zeros
            token_positions = np.broadcast_to(start + np.arange(longest), (count, longest)).reshape(-1)
            real = (np.arange(longest)[None, :] < lengths[:, None]).reshape(-1)
            feeds[contract.INITIAL_STATE] = self._initial_states(token_positions, real)
        if self.core_repeats is not None:
            feeds[contract.READOUT_REPEATS] = self._readout_repeats(count, readout_repeats)
        outputs = [contract.NEXT_TOKEN] + ([contract.LOGITS] if want_logits else [])
        sequences = slice(first, first + count)
        if not self.fused:
            result = self._run_standard(contract.PREFILL, feeds, self._logical_slabs(sequences), outputs)
            self.layout.write_prefill_rows(self.pool.buffers, self._new_rows(result), first, start, lengths)
            return result[contract.NEXT_TOKEN], (result[contract.LOGITS] if want_logits else None)
        self._check_positions(np.asarray([start + longest - 1]))
        # The chunk length varies, so the ids are bound per call; the slabs' binding is kept per range of pool rows
        # (a padded token writes its K/V past its row's end, where nothing is read before it is rewritten).
        bound = self._prefill_bindings.get((first, count))
        if bound is None:
            slabs = self._logical_slabs(sequences)
            bound = self._prefill_bindings[first, count] = (pool_binding(self.programs[contract.PREFILL], slabs), slabs)
        binding, slabs = bound
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        token, logits = np.zeros(count, np.int64), np.zeros((count, self.vocab_size), F32)
        binding.bind_output(contract.NEXT_TOKEN, "cpu", 0, np.int64, [count],
                            bound_address(binding, contract.NEXT_TOKEN, token, np.int64))
        binding.bind_output(contract.LOGITS, "cpu", 0, F32, list(logits.shape),
                            bound_address(binding, contract.LOGITS, logits, F32))
        self.programs[contract.PREFILL].run_with_iobinding(binding, slabs)
        return token, (logits if want_logits else None)

    def plain_step(self, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
                   readout_repeats: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Plain decoding of sequences 0..n-1 at once: row b's token at positions[b] through all N layers (a
        recurrent core's final readout after READOUT_REPEATS[b] repeats: prefill's).
        -> (argmax next tokens [n], logits [n, V] or None). Invalid rows are bubbles: fused, they run at
        positions[b] (the scheduler's choice, where their K/V land); standard graphs, at 0 (not written)."""
        n = len(tokens)
        if not self.fused:
            feeds = {contract.INPUT_IDS: np.asarray(tokens, np.int64).reshape(n, 1),
                     contract.POSITIONS: np.where(valid, positions, 0).astype(np.int64), contract.CHUNK_LENGTHS: np.ones(n, np.int64)}
            if self.dims.initial_state is not None:
                feeds[contract.INITIAL_STATE] = self._initial_states(positions, valid)
            if self.core_repeats is not None:
                feeds[contract.READOUT_REPEATS] = self._readout_repeats(n, readout_repeats)
            outputs = [contract.NEXT_TOKEN] + ([contract.LOGITS] if want_logits else [])
            result = self._run_standard(contract.PREFILL, feeds, self._logical_slabs(slice(0, n)), outputs)
            self.layout.write_token_rows(self.pool.buffers, self._new_rows(result), np.flatnonzero(valid), positions)
            return result[contract.NEXT_TOKEN], (result[contract.LOGITS] if want_logits else None)
        self._check_positions(positions)

        def tensors():
            return {contract.INPUT_IDS: ((n, 1), np.int64, False), contract.POSITIONS: ((n,), np.int64, False),
                    contract.CHUNK_LENGTHS: ((n,), np.int64, False), contract.NEXT_TOKEN: ((n,), np.int64, True),
                    **({contract.READOUT_REPEATS: ((n,), np.int64, False)} if self.core_repeats is not None else {}),
                    **({contract.LOGITS: ((n, self.vocab_size), F32, True)} if want_logits else {})}

        step = self._step(contract.PREFILL, (n, want_logits), lambda: self._logical_slabs(slice(0, n)), tensors)
        step.inputs[contract.INPUT_IDS][:, 0] = tokens
        step.inputs[contract.POSITIONS][:] = positions
        step.inputs[contract.CHUNK_LENGTHS][:] = 1
        if self.core_repeats is not None:
            step.inputs[contract.READOUT_REPEATS][:] = self._readout_repeats(n, readout_repeats)
        result = step.run()
        return result[contract.NEXT_TOKEN], (result[contract.LOGITS] if want_logits else None)

    def speed_step(self, entering: np.ndarray, positions: np.ndarray, valid: np.ndarray, heads: HeadRows,
                   want_logits: bool) -> SpeedStepResult:
        """One pipelined step of sequences 0..n-1: entering [n] tokens enter slot 0; positions/valid [P, n]
        (slot, sequence; bubbles as plain_step says); HEADS: the rows (row = s*n + b) whose heads run."""
        slots, n = positions.shape
        rows, finals, exits, checks = slots * n, len(heads.final), len(heads.exit), len(heads.check)
        width = self.check_width
        if not self.fused:  # every row runs, bubbles too
            feeds = {contract.INPUT_IDS: np.asarray(entering, np.int64).reshape(n, 1),
                     contract.POSITIONS: np.where(valid, positions, 0).astype(np.int64).reshape(rows),
                     contract.HIDDEN_IN: np.ascontiguousarray(self.hidden[:slots - 1, :n]).reshape((slots - 1) * n, 1, -1),
                     contract.FINAL_ROWS: np.asarray(heads.final, np.int64), contract.EXIT_ROWS: np.asarray(heads.exit, np.int64),
                     contract.CHECK_ROWS: np.asarray(heads.check, np.int64),
                     contract.CHECK_CANDIDATES: self.drafts.checks(heads.check, n)}
            if self.dims.initial_state is not None:  # the entering tokens: slot 0's rows
                feeds[contract.INITIAL_STATE] = self._initial_states(positions[0], valid[0])
            readout_slots = None
            if self.core_repeats is not None:  # each sequence's final head row is in the slot of its last repeat
                repeats = self._readout_repeats(n, [heads.readout_repeats.get(b) for b in range(n)])
                feeds[contract.READOUT_REPEATS] = repeats
                readout_slots = (repeats - 1) // (self.core_repeats // slots)
            outputs = [contract.FINAL_TOKEN, contract.EXIT_TOKENS, contract.EXIT_CANDIDATES, contract.CHECK_TOKENS,
                       contract.HIDDEN_OUT] + ([contract.FINAL_LOGITS] if want_logits else [])
            result = self._run_standard(contract.BATCH_STEP, feeds, self._stage_slabs(n), outputs)
            self.layout.write_step_rows(self.pool.buffers, self._new_rows(result), slots, n, valid, positions, readout_slots)
            self.hidden[:, :n] = result[contract.HIDDEN_OUT].reshape(slots, n, self.dims.state_width)
            self.drafts.stepped(heads.exit, result[contract.EXIT_CANDIDATES])
            return SpeedStepResult.of(result, want_logits)
        # Fused: only the valid rows run (computed_rows, slot-major indices); the head rows are given as
        # indices among them, and hidden_out comes back for them alone.
        self._check_positions(positions)
        layout = self._layout(valid, heads)
        count = len(layout.computed)

        def tensors():
            return {contract.INPUT_IDS: ((n, 1), np.int64, False), contract.POSITIONS: ((rows,), np.int64, False),
                    contract.HIDDEN_IN: (((slots - 1) * n, 1, self.dims.state_width), F32, False),
                    contract.COMPUTED_ROWS: ((count,), np.int64, False),
                    contract.FINAL_ROWS: ((finals,), np.int64, False), contract.EXIT_ROWS: ((exits,), np.int64, False),
                    contract.CHECK_ROWS: ((checks,), np.int64, False),
                    contract.CHECK_CANDIDATES: ((checks, width), np.int64, False),
                    contract.FINAL_TOKEN: ((finals,), np.int64, True), contract.EXIT_TOKENS: ((exits,), np.int64, True),
                    contract.EXIT_CANDIDATES: ((exits, width), np.int64, True),
                    contract.CHECK_TOKENS: ((checks,), np.int64, True),
                    contract.HIDDEN_OUT: ((count, 1, self.dims.state_width), F32, True),
                    **({contract.FINAL_LOGITS: ((finals, self.vocab_size), F32, True)} if want_logits else {})}

        step = self._step(contract.BATCH_STEP, (n, count, finals, exits, checks, want_logits), lambda: self._stage_slabs(n),
                          tensors)
        inputs = step.inputs
        inputs[contract.INPUT_IDS][:, 0] = entering
        inputs[contract.POSITIONS].reshape(slots, n)[:] = positions
        inputs[contract.HIDDEN_IN].reshape(slots - 1, n, -1)[:] = self.hidden[:slots - 1, :n]
        inputs[contract.COMPUTED_ROWS][:] = layout.computed
        inputs[contract.FINAL_ROWS][:] = layout.final
        inputs[contract.EXIT_ROWS][:] = layout.exit
        inputs[contract.CHECK_ROWS][:] = layout.check
        if checks:
            inputs[contract.CHECK_CANDIDATES][:] = self.drafts.checks(heads.check, n)
        result = step.run()
        self.hidden[layout.slot, layout.sequence] = result[contract.HIDDEN_OUT][:, 0]
        self.drafts.stepped(heads.exit, result[contract.EXIT_CANDIDATES])
        return SpeedStepResult.of(result, want_logits)

    def _layout(self, valid: np.ndarray, heads: HeadRows) -> "StepLayout":
        """The StepLayout of VALID [P, n] and HEADS' rows, remembered per pattern: a pipeline's occupancy
        repeats (16 patterns at one sequence), and these numpy calls were a third of a step's Python."""
        key = (valid.shape[1], valid.tobytes(), tuple(heads.final), tuple(heads.exit), tuple(heads.check))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            slot, sequence = np.nonzero(valid)  # row-major: slot-major rows, ascending
            among = np.cumsum(valid) - 1  # each slot-major row's index among the computed ones
            layout = self._layouts[key] = StepLayout(slot * valid.shape[1] + sequence, among[heads.final],
                                                    among[heads.exit], among[heads.check], slot, sequence)
        return layout


@dataclass(frozen=True)
class StepLayout:
    """The row indices of one fused speed step's pattern (valid rows, head rows)."""
    computed: np.ndarray  # [C] slot-major rows s*n + b that hold a token, ascending
    final: np.ndarray  # the final head's rows, as indices among the computed ones
    exit: np.ndarray
    check: np.ndarray
    slot: np.ndarray  # [C] each computed row's pipeline slot
    sequence: np.ndarray  # [C] and its pool row


BATCHING_BACKENDS = ("onnx", "onnx-numpy")  # Engine backends that batch many sequences (on the engine's sessions)


def make_batch_backend(directory: Path, manifest: Manifest, max_batch: int, capacity: int, device: str = "cpu",
                       threads: int | None = None, fused: bool | None = None, session=None,
                       kv_cache: str | None = None) -> BatchBackend:
    if device != "cpu":
        raise SpeedcError(f"device {device!r}: the ONNX Runtime backends run on the CPU in this version "
                          "(--backend torch runs on CUDA)")
    onnxruntime_module()
    return BatchBackend(directory, manifest, max_batch, capacity, threads=threads, fused=fused, session=session,
                        kv_cache=kv_cache)
