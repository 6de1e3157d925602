"""PyTorch backend for the continuous-batching scheduler (runtimes/batch.py): the contract of
runtimes/backends/protocol.py, as the ONNX backend (a KV-cache pool with a row per sequence; prefill, plain_step,
speed_step), computed with the model code itself (models/row_layer.py, the heads of models/llama.py)
from the artifact's weights or an in-memory model, on CPU or CUDA. Needs torch (the compiler extra).

    pool K, V [S, P, W, kvh, T+1, hd]  (stage layer j, pipeline slot s, pool row b, ...)

    prefill(b, chunks)  B chunks at START: logical layer l = s*S + j reads pool[j, s, b:b+B, :, :START]
    plain_step(n)       n rows, one token per sequence: logical layer l reads pool[j, s, :n]
    speed_step(n)       P*W rows, row s*W + b: stage layer j reads pool[j] as one [P*W, kvh, T+1, hd] view
                        (the W - n free pool rows run as bubbles: a contiguous view, never a copy)

Bubbles (empty pipeline slots, sequences not decoding, free pool rows) run at position 0 and
write their K/V into the scratch row T, which no row reads (every valid position is below T), so every
write has a fixed shape. Eagerly, every past is cut to the largest position a row attends below; with
cuda_graphs (CUDA), each step's layers replay a graph captured once per row count and pool, attending
over all T+1 rows (masked: the same softmax). The pool and the carried hidden states stay on the device;
one copy brings the step's ids in, one takes every head's ids back (logits too when sampling).
Precision: the model's (a bf16 model keeps a bf16 pool and computes in bf16).

The pool is a KVPool (runtimes/backends/kv_pool.py), sized by the same rules as the ONNX backend's: width a
power of two, length within an eighth of the need, at least min_length positions, at most `capacity`; a
shrink waits SHRINK_AFTER_STEPS calls; a pool that cannot grow is a one-line OutOfMemory with the old pool intact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from speedc.format import contract
from speedc.format.cache_layout import CORE, CacheLayout
from speedc.format.artifact import (CONFIG, Manifest, checkpoint_tensor_names, dequantized_weights, is_quantized,
                             read_weight)
from speedc.errors import GenerationError, OutOfMemory, SpeedcError
from speedc.models.families import load_config
from speedc.models.llama import SharedLlama
from speedc.models.row_layer import (CrossRead, RowContext, RowOps, layer_over_rows, rotary_inv_freq, row_context,
                                     step_cross_read)
from speedc.models.sampling import is_integer
from speedc.models.trip import walk
from speedc.runtimes.backends.kv_pool import MIN_POOL_POSITIONS, SHRINK_AFTER_STEPS, KVPool
from speedc.runtimes.backends.protocol import DraftCandidates, HeadRows, SpeedStepResult, resolve_threads


def load_model_from_artifact(directory: Path, manifest: Manifest) -> SharedLlama:
    """The artifact's weights as a PyTorch SharedLlama, with the layer map and exit the compiler chose."""
    from speedc.models.checkpoint.torch_io import model_from_state  # imports safetensors: not needed by from_model

    base = load_config(directory / CONFIG)
    # The artifact's layer map is the one the share pass derived from the weights.
    cfg = dataclasses.replace(base.with_layer_map(manifest.layer_map), exit_layer=manifest.exit_layer,
                              exit_norm=manifest.dims.exit_norm)
    tensors = {name: torch.from_numpy(np.array(read_weight(directory, manifest, name), dtype=np.float32))
               for name in checkpoint_tensor_names(manifest)}
    if is_quantized(manifest):  # the dequantized weights (peers and sweeps rebuild from these; not a backend)
        tensors.update({name: torch.from_numpy(np.array(values)) for name, values in dequantized_weights(directory, manifest).items()})
    return model_from_state(cfg, tensors)


def top_candidates(logits: torch.Tensor, count: int) -> torch.Tensor:
    """logits [E, V] -> the COUNT best ids of each row [E, K], ties to the lower id (as ONNX Runtime's
    TopK and every argmax here): a stable descending sort, where torch.topk's order of ties is unspecified."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :count]


def best_candidate(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """logits [C, V], candidates [C, K] -> each row's highest-scoring candidate [C] (ties: the first listed)."""
    scores = logits.gather(1, candidates)  # [C, K]
    return candidates.gather(1, scores.argmax(1, keepdim=True))[:, 0]


TORCH_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an allocation error means the device (or host) memory is exhausted."""
    if isinstance(error, (MemoryError, TORCH_OUT_OF_MEMORY)):
        return True
    text = str(error).lower()  # CPU: "DefaultCPUAllocator: can't allocate memory"; CUDA: "CUDA out of memory"
    return isinstance(error, RuntimeError) and ("out of memory" in text or "allocate memory" in text)


MAX_GRAPHS = 64  # captured step graphs kept (one sequence: a speed and a plain one per pool)


class TorchBackend:
    name = "torch"

    def __init__(self, directory: Path, manifest: Manifest, max_batch: int = 1, capacity: int | None = None,
                 **options) -> None:
        """CAPACITY: positions each of MAX_BATCH pool rows may hold (None: the model's context). OPTIONS: _setup's
        (device, threads, min_length, shrink_after, cuda_graphs, exact, compile_step)."""
        if is_quantized(manifest):
            raise SpeedcError(f"{directory}: the PyTorch backend runs float artifacts; this one stores {manifest.dtype} "
                              "weights for ONNX Runtime's MatMulNBits: use --backend onnx, or build with --weights fp32/fp16/bf16")
        if CacheLayout.from_manifest(manifest).pipelined_phases:  # its stages are one cycle's layers
            raise SpeedcError(f"{directory}: the PyTorch backend pipelines one repeated cycle; this artifact's depth plan "
                              "has a prelude / coda: use --backend onnx-numpy")
        self._setup(load_model_from_artifact(directory, manifest), manifest.slots, max_batch, capacity, **options)

    @classmethod
    def from_model(cls, model: SharedLlama, slots: int, max_batch: int = 1, capacity: int | None = None,
                   **options) -> "TorchBackend":
        """A backend over an in-memory model (no artifact): what the GPU check uses where only torch is
        installed. SLOTS (P) must be a valid slot count of its depth plan (DepthPlan.valid_slots)."""
        if slots not in model.cfg.depth_plan.valid_slots(model.cfg.exit_layer):
            raise SpeedcError(f"{slots} slots do not fit the layer map {model.cfg.layer_map} (exit after {model.cfg.exit_layer})")
        backend = cls.__new__(cls)
        backend._setup(model, slots, max_batch, capacity, **options)
        return backend

    def _setup(self, model: SharedLlama, slots: int, max_batch: int, capacity: int | None, *, device: str = "cpu",
               threads: int | None = None, min_length: int = MIN_POOL_POSITIONS, shrink_after: int = SHRINK_AFTER_STEPS,
               cuda_graphs: bool = False, exact: bool = False, compile_step: bool = False) -> None:
        """CUDA_GRAPHS (device cuda): each step's layers replay a captured CUDA graph; COMPILE_STEP: they run
        through torch.compile (LayerExecutor). EXACT: batch-invariant decoding, SPEED's logits bitwise plain
        decoding's (see plain_step)."""
        cfg = model.cfg
        plan = cfg.depth_plan
        if plan.injection or plan.readout_norm or cfg.embed_scale != 1.0:  # its trip loop is the layer map's alone
            raise SpeedcError(f"the PyTorch backend runs a layer map's layers in order; this model's depth plan "
                              f"({plan.describe()}) injects its entry state or norms at the readout: use --backend onnx")
        self.device = _device(device)
        if cuda_graphs and self.device.type != "cuda":
            raise SpeedcError(f"CUDA graphs need a CUDA device, not {device!r}")
        self.exact = bool(exact)
        self.executor = LayerExecutor(bool(cuda_graphs), bool(compile_step), full_past=bool(cuda_graphs or exact))
        if threads:
            torch.set_num_threads(resolve_threads(threads))
        if not is_integer(max_batch) or max_batch < 1:
            raise GenerationError(f"max batch must be an integer of at least 1, not {max_batch!r:.20}")
        context = cfg.max_position_embeddings
        capacity = context if capacity is None else capacity
        if not is_integer(capacity) or not 2 <= capacity <= context:
            raise GenerationError(f"a KV-cache row of {capacity!r:.20} positions: it must be 2..{context} (the context)")
        if compile_step:  # the pool at its full length from the start: a compiled step has one shape per row count
            min_length = capacity
        self.model = model.to(self.device).eval()
        self.cfg = cfg
        self.dtype = next(self.model.parameters()).dtype  # the pool and every product in the weights' precision
        pipeline = cfg.depth_plan.pipeline(slots, cfg.exit_layer)
        self.slots, self.stage_layers, self.num_layers = slots, pipeline.stage_layers, cfg.num_hidden_layers
        self.layout = CacheLayout.cycle(self.stage_layers, slots)  # logical layer -> its [stage layer, slot] slab
        self.trip_steps, self.stage_steps = tuple(cfg.depth_plan.trip()), pipeline.entry_steps()  # once: walked every step
        self.vocab_size, self.max_context = cfg.vocab_size, context
        self.kv_heads, self.head_dim, self.hidden_size = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.check_width = contract.candidate_count(self.vocab_size)  # K of an early-flush check's candidates
        self.products = f"PyTorch ({self.device})"
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.inv_freq = rotary_inv_freq(cfg, self.device)
        self.hidden = torch.zeros(slots, max_batch, cfg.hidden_size, dtype=self.dtype, device=self.device)  # [P, B, H]
        self.drafts = DraftCandidates(slots, max_batch, self.check_width)  # beside it, each token's draft's top K
        self.pool = KVPool(self._pool_shapes, self._zeros, self.hidden.element_size(), max_batch=max_batch, capacity=capacity,
                           min_length=min_length, shrink_after=shrink_after, where=f" on {self.device}")
        self.reserve(0, 1)

    @property
    def speculative(self) -> bool:
        return self.slots > 1

    @property
    def early_checks(self) -> bool:  # every slot of a cycle reads out at the same tap (depth plans are refused)
        return self.speculative

    def carried_state(self, slot: int, row: int) -> np.ndarray:
        return self.hidden[slot, row].float().cpu().numpy()

    # ---- the pool --------------------------------------------------------------------------------
    @property
    def keeps_prefixes(self) -> bool:  # the prefix cache copies rows of the ONNX backend's host pool only
        return False

    @property
    def runner(self):  # its own modules: nothing shared with another backend
        return self

    def _pool_shapes(self, length: int, width: int) -> dict[str, tuple]:
        return {CORE: (self.stage_layers, self.slots, width, self.kv_heads, length + 1, self.head_dim)}

    def reserve(self, positions: int, sequences: int | None = None) -> None:
        """The pool holds POSITIONS for each of SEQUENCES pool rows (KVPool.reserve); where it was replaced,
        the graphs captured over the old buffers are dropped."""
        if self.pool.reserve(positions, sequences):
            self.executor.forget()

    def _zeros(self, shape: tuple) -> torch.Tensor:
        """A zeroed pool buffer; OutOfMemory (caught by reserve) where the device cannot hold it."""
        try:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (MemoryError, RuntimeError) as error:
            if is_out_of_memory(error):
                raise OutOfMemory(str(error).splitlines()[0] if str(error) else "out of memory") from None
            raise

    def free_pool(self) -> None:
        """Drop the pool while no sequence holds a pool row (KVPool.free)."""
        self.pool.free()
        self.executor.forget()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the blocks back, so the next allocation may take them whole

    def move(self, source: int, target: int, length: int | None = None) -> None:
        """Pool row SOURCE's cache (its first LENGTH positions; None: all) and pipeline state now live
        in pool row TARGET."""
        self.pool.move(source, target, length)
        self.hidden[:, target] = self.hidden[:, source]
        self.drafts.move(source, target)

    # ---- helpers ---------------------------------------------------------------------------------
    def _ints(self, *arrays) -> list[torch.Tensor]:
        """Integer arrays -> int64 tensors on the device, flat, in one host-to-device copy."""
        flat = [np.asarray(a, np.int64).reshape(-1) for a in arrays]
        joined = torch.from_numpy(np.concatenate(flat)).to(self.device)
        return list(torch.split(joined, [a.size for a in flat]))

    def _context(self, starts: torch.Tensor, length: int, past_len: int) -> RowContext:
        """row_context, its tables in the weights' precision (a bf16 product of a float32 table is float32)."""
        ctx = row_context(starts, length, past_len, self.inv_freq, self.groups, self.cfg.depth_plan.cross_window)
        if self.dtype == torch.float32:
            return ctx
        windowed = {} if ctx.window_past_mask is None else dict(window_past_mask=ctx.window_past_mask.to(self.dtype),
                                                                 window_chunk_mask=ctx.window_chunk_mask.to(self.dtype))
        return dataclasses.replace(ctx, cos=ctx.cos.to(self.dtype), sin=ctx.sin.to(self.dtype),
                                   past_mask=ctx.past_mask.to(self.dtype), chunk_mask=ctx.chunk_mask.to(self.dtype), **windowed)

    def _check_positions(self, positions: np.ndarray) -> None:
        """Rows that hold a token sit below the scratch row T (bubbles write there; past it a write would
        index outside the pool, a device assert on CUDA): anything else is refused, not run."""
        if positions.size and (positions.max() >= self.pool.length or positions.min() < 0):
            raise GenerationError(f"internal: a row at position {int(positions.max())} in a pool of {self.pool.length} positions")

    def _heads_out(self, logits: torch.Tensor, want_logits: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """logits [B, V] -> (argmax [B], logits [B, V] float32 or None) on the host."""
        tokens = logits.argmax(-1).cpu().numpy()
        return tokens, (logits.float().cpu().numpy() if want_logits else None)

    # ---- the three runs --------------------------------------------------------------------------
    def _full_depth_only(self, readout_repeats: list | None) -> None:
        """READOUT_REPEATS (prefill's, plain_step's): a recurrent core reads out after all its repeats here (its
        plans with a prelude / coda are refused at load: no depth rule of theirs reaches this backend)."""
        plan = self.cfg.depth_plan
        if plan.recurrent and any(r not in (None, plan.repeats) for r in readout_repeats or []):
            raise GenerationError("internal: the PyTorch backend reads a recurrent core out after all its repeats")

    @torch.no_grad()
    def prefill(self, first: int, chunks: list[list[int]], start: int, want_logits: bool,
                readout_repeats: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Prompt chunks through all N layers: chunk i belongs to pool row first + i and starts at
        position START; several run as one [B, L] batch, right padded to the longest.
        -> (argmax next tokens [B], logits [B, V] or None) after each chunk's last token."""
        cfg, model = self.cfg, self.model
        self._full_depth_only(readout_repeats)
        lengths = np.asarray([len(chunk) for chunk in chunks], np.int64)
        count, longest = len(chunks), int(lengths.max())
        if lengths.min() < 1:  # its head would read the row before it
            raise GenerationError("internal: an empty prefill chunk")
        self._check_positions(np.asarray([start + longest - 1]))
        ids = np.zeros((count, longest), np.int64)  # the padding's id: its rows are never read back
        for row, chunk in enumerate(chunks):
            ids[row, :len(chunk)] = chunk
        last = np.arange(count) * longest + lengths - 1  # each chunk's last real token among the B*L rows
        ids, last, starts = self._ints(ids, last, np.full(count, start))
        x = model.model.embed_tokens(ids)  # [B*L, H]
        ctx = self._context(starts, longest, start)
        ops = _PlainOps(self, ctx, slice(first, first + count), start, write=True)
        x = walk(cfg.depth_plan, self.trip_steps, ops, x)  # models/trip.py
        return self._heads_out(model.final_head(x[last]), want_logits)  # [B, V]

    @torch.no_grad()
    def plain_step(self, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
                   readout_repeats: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Plain decoding of sequences 0..n-1 at once: row b's token at positions[b] through all N layers.
        -> (argmax next tokens [n], logits [n, V] or None). Invalid rows (bubbles) run at 0 and write the
        scratch row T.

        EXACT: the token runs through the speed step's layers instead, P passes of P*W rows (pass s: it is
        the one token in slot s; the same weight reads as N layers of n rows, P times the rows), so each of
        its products has the shape SPEED's has for it: torch's CPU and GPU kernels pick different ones for
        1 and P rows (measured: a 1-row and a 4-row F.linear differ in the last bits on this CPU), and this
        keeps SPEED's logits bitwise plain decoding's, as ONNX Runtime's CPU kernels do without it."""
        self._full_depth_only(readout_repeats)
        at = np.where(valid, positions, 0).astype(np.int64)
        self._check_positions(at[valid])
        if self.exact:
            return self._plain_as_speed_passes(tokens, at, valid, want_logits)
        inputs = self._ints(tokens, at, np.where(valid, at, self.pool.length))
        x = self.executor.run(("plain", len(tokens)), self._plain_layers, self._write_plain_rows, inputs, int(at.max(initial=0)),
                              self.pool.length)
        return self._heads_out(self.model.final_head(x), want_logits)  # [n, V]

    def _plain_as_speed_passes(self, tokens: np.ndarray, at: np.ndarray, valid: np.ndarray,
                               want_logits: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """plain_step (EXACT): pass s runs the tokens in slot s of _speed_layers, every other row a bubble;
        slot s+1 of the next pass reads what slot s wrote to self.hidden. Leaves self.hidden as SPEED
        would find it after a flush: nothing it reads (a plain step follows a flush of every pipeline)."""
        slots, width, n = self.slots, self.pool.width, len(tokens)
        entering = np.zeros(width, np.int64)
        entering[:n] = tokens
        x = None
        for slot in range(slots):
            grid = np.zeros((slots, width), np.int64)  # [P, W]: the tokens in slot SLOT, bubbles at 0
            grid[slot, :n] = at
            written = np.full((slots, width), self.pool.length, np.int64)  # bubbles write the scratch row T
            written[slot, :n] = np.where(valid, at, self.pool.length)
            inputs = self._ints(entering, grid, written)
            x, _ = self.executor.run(("speed", width), self._speed_layers, self._write_speed_rows, inputs, int(at.max(initial=0)),
                                    self.pool.length)
            self.hidden[:, :width] = x.view(slots, width, -1)
        last = torch.arange(n, device=self.device) + (slots - 1) * width  # the last slot's rows
        return self._heads_out(self._final_head_rows(x, last), want_logits)  # [n, V]

    def _final_head_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final head of ROWS of x ([P*W, H], a speed pass's) -> [len(rows), V]; EXACT: computed over
        all W rows of the last slot (where every final row is but a depth rule's), then picked: the head's
        product has one shape at every step, however many sequences have a token leaving; over all P*W
        rows where a depth rule reads a shallower slot."""
        if not self.exact:
            return self.model.final_head(x[rows])
        first = (self.slots - 1) * self.pool.width
        if len(rows) and int(rows.min()) < first:
            return self.model.final_head(x)[rows]  # [P*W, V] -> [F, V]
        return self.model.final_head(x[first:])[rows - first]  # [W, V] -> [F, V]

    def _plain_layers(self, tokens: torch.Tensor, starts: torch.Tensor, past: int) -> tuple[torch.Tensor, list]:
        """The N layers over n rows of one token (row b: pool row b) at STARTS, attending to the first
        PAST positions. -> (hidden [n, H], each logical layer's new K/V rows ([n, kvh, hd] each): pure, the pool
        unchanged; _write_plain_rows stores them)."""
        cfg, model = self.cfg, self.model
        n = tokens.shape[0]
        x = model.model.embed_tokens(tokens)  # [n, H]
        ops = _PlainOps(self, self._context(starts, 1, past), slice(0, n), past)
        x = walk(cfg.depth_plan, self.trip_steps, ops, x)  # models/trip.py
        return x, [(k[:, :, 0], v[:, :, 0]) for k, v in ops.present.values()]

    def _write_plain_rows(self, new: list, written: torch.Tensor) -> None:
        """NEW (_plain_layers' K/V rows, one pair per logical layer) into the pool: row b's at WRITTEN[b]."""
        n = written.shape[0]
        rows = torch.arange(n, device=self.device)
        for layer, (k, v) in enumerate(new):
            slab = self.layout.locate(layer)
            key, value = self.pool.key[slab.layer, slab.column, :n], self.pool.value[slab.layer, slab.column, :n]  # [n, kvh, T+1, hd]
            key[rows, :, written], value[rows, :, written] = k, v  # the indexed target is [n, kvh, hd]

    @torch.no_grad()
    def speed_step(self, entering: np.ndarray, positions: np.ndarray, valid: np.ndarray, heads: HeadRows,
                   want_logits: bool) -> SpeedStepResult:
        """One pipelined step of sequences 0..n-1: entering [n] tokens enter slot 0; positions/valid [P, n]
        (slot, sequence); HEADS: the rows (row = s*n + b) whose heads run. The step runs all W sequence
        slots (row s*W + b); bubbles run at 0 and write the scratch row T."""
        model, slots, width = self.model, self.slots, self.pool.width
        n = positions.shape[1]
        grid = np.zeros((slots, width), np.int64)  # [P, W] each row's position, bubbles (and free pool rows) at 0
        grid[:, :n] = np.where(valid, positions, 0)
        self._check_positions(positions[valid])
        written = np.full((slots, width), self.pool.length, np.int64)  # [P, W]: bubbles write the scratch row T
        written[:, :n] = np.where(valid, positions, self.pool.length)
        entering_w = np.zeros(width, np.int64)
        entering_w[:n] = entering
        candidates = self.drafts.checks(heads.check, n)  # [C, K]
        *inputs, final_rows, exit_rows, candidates = self._ints(entering_w, grid, written, _on_grid(heads.final, n, width),
                                                                 _on_grid(heads.exit + heads.check, n, width), candidates)
        x, tap = self.executor.run(("speed", width), self._speed_layers, self._write_speed_rows, inputs, int(grid.max()),
                                  self.pool.length)
        self.hidden[:, :width] = x.view(slots, width, -1)  # each slot's state, read by the next slot next step
        final_logits = self._final_head_rows(x, final_rows)  # [F, V]
        exit_logits = model.exit_head(tap[exit_rows])  # [E + C, V]: drafts, then early-flush checks
        finals, exits, width_k = len(heads.final), len(heads.exit), self.check_width
        drafts = top_candidates(exit_logits[:exits], width_k)  # [E, K]
        checks = best_candidate(exit_logits[exits:], candidates.view(-1, width_k))  # [C]
        ids = torch.cat((final_logits.argmax(-1), drafts.reshape(-1), checks)).cpu().numpy()  # one copy back
        exit_candidates = ids[finals:finals + exits * width_k].reshape(exits, width_k)
        self.drafts.stepped(heads.exit, exit_candidates)
        return SpeedStepResult(ids[:finals], final_logits.float().cpu().numpy() if want_logits else None,
                               exit_candidates[:, 0], exit_candidates, ids[finals + exits * width_k:])

    def _speed_layers(self, entering: torch.Tensor, starts: torch.Tensor,
                      past: int) -> tuple[tuple[torch.Tensor, torch.Tensor], list]:
        """The S stage layers over P*W rows (row s*W + b: slot s of pool row b; slot 0 enters ENTERING,
        slots 1..P-1 carry on from self.hidden) at STARTS, attending to the first PAST positions.
        -> ((hidden [P*W, H], exit tap [P*W, H]), each stage layer's new K/V rows ([P*W, kvh, hd] each)): pure, the
        pool and self.hidden unchanged (_write_speed_rows stores the rows; the caller moves self.hidden on).
        No row reads a row written in its own step: each attends below its own position, its own K/V from
        the chunk, and a cross read (slots 1..) repeat 0's rows, written when its token was in slot 0."""
        cfg, model, slots = self.cfg, self.model, self.slots
        width = entering.shape[0]
        behind = self.hidden[:slots - 1, :width].reshape((slots - 1) * width, -1)  # slots 1..P-1 [(P-1)W, H]
        x = torch.cat((model.model.embed_tokens(entering), behind))  # [P*W, H]
        ops = _StageOps(self, self._context(starts, 1, past), starts, past, width, x)
        x = walk(cfg.depth_plan, self.stage_steps, ops, x)  # stage j of every slot: the same loop position (models/trip.py)
        return (x, ops.tap), ops.new

    def _write_speed_rows(self, new: list, written: torch.Tensor) -> None:
        """NEW (_speed_layers' K/V rows, one pair per stage layer) into the pool: row r's at WRITTEN[r]."""
        rows = torch.arange(written.shape[0], device=self.device)
        for j, (k, v) in enumerate(new):
            key = self.pool.key[j].view(written.shape[0], *self.pool.key.shape[3:])  # [P*W, kvh, T+1, hd], a view
            value = self.pool.value[j].view(written.shape[0], *self.pool.value.shape[3:])
            key[rows, :, written], value[rows, :, written] = k, v


class LayerExecutor:
    """How a step's layers run: eagerly over the positions in use; through torch.compile (COMPILE_STEP) over
    cache buckets; or (CUDA_GRAPHS) over the whole pool, layers and writes in one CUDA graph captured once per
    role and pool (one launch a step). FULL_PAST: attend over the whole pool (fixed shapes; every row's softmax
    and products the same length), not up to the newest position."""

    def __init__(self, cuda_graphs: bool, compile_step: bool, full_past: bool) -> None:
        self.cuda_graphs, self.compile_step, self.full_past = cuda_graphs, compile_step, full_past
        self._graphs: dict[tuple, StepGraph] = {}  # (role, rows) -> its captured graph over the current pool
        self._compiled: dict[str, object] = {}  # a step's layers function -> it through torch.compile

    def forget(self) -> None:
        """The pool was replaced or freed: graphs captured over its buffers are stale."""
        self._graphs.clear()

    def run(self, role: tuple, layers, write, inputs: list[torch.Tensor], past: int, length: int):
        """LAYERS(ids, starts, past) -> (result, new K/V rows), then WRITE(new rows, written): INPUTS are ids, starts,
        written; LENGTH: the pool's T. Eagerly over the first PAST positions; through torch.compile over PAST
        rounded up to a power of two (a cache bucket: positions past PAST are masked, the same softmax), one
        compile per row count and bucket, the pool written after the compiled graph (written inside it, torch
        copies the whole pool each step: measured 4x the step on zoo:small); or over the whole pool in a
        captured CUDA graph. -> result."""
        run = self._compiled_layers(layers) if self.compile_step else layers
        if self.full_past:
            past = length + 1
        elif self.compile_step:  # a few attention lengths, each compiled once, rather than one per position
            past = min(length + 1, max(MIN_POOL_POSITIONS, 1 << (past - 1).bit_length()))

        def step(ids: torch.Tensor, starts: torch.Tensor, written: torch.Tensor):
            result, new = run(ids, starts, past)
            write(new, written)
            return result

        if not self.cuda_graphs:
            return step(*inputs)
        graph = self._graphs.get(role)
        if graph is None:
            if len(self._graphs) >= MAX_GRAPHS:
                del self._graphs[next(iter(self._graphs))]
            graph = self._graphs[role] = StepGraph(step, inputs)
        return graph(inputs)

    def _compiled_layers(self, layers):
        """LAYERS (a bound _plain_layers or _speed_layers) through torch.compile: fullgraph, so a graph break is an
        error rather than a silent fall-back to Python; static shapes, so torch compiles once per row count (the
        pool keeps its full length: _setup) and every later step reuses it."""
        compiled = self._compiled.get(layers.__name__)
        if compiled is None:
            compiled = self._compiled[layers.__name__] = torch.compile(layers, fullgraph=True, dynamic=False)
        return compiled


class StepGraph:
    """One CUDA graph of a step's layers: inputs copied into its static tensors, one replay, outputs in
    its static tensors (valid until the next replay of this graph)."""

    def __init__(self, run, inputs: list[torch.Tensor]) -> None:
        self.inputs = [tensor.clone() for tensor in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: kernels picked, workspaces allocated
            run(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = run(*self.inputs)

    def __call__(self, inputs: list[torch.Tensor]):
        for static, value in zip(self.inputs, inputs):
            static.copy_(value)
        self.graph.replay()
        return self.outputs


class _PlainOps(RowOps):
    """The walker's ops for plain decoding and prefill: logical layer l reads its slab of pool rows SEQUENCES
    below PAST; its new rows are kept (self.present: a cross-repeat layer reads repeat 0's) and, with WRITE,
    stored at PAST.. at once (prefill: a padded token's K/V land past its chunk's end, where its own token
    writes before anything reads)."""

    def __init__(self, backend: TorchBackend, ctx: RowContext, sequences: slice, past: int, write: bool = False) -> None:
        super().__init__(backend.model.model, backend.cfg)
        self.backend, self.ctx, self.sequences, self.past, self.write = backend, ctx, sequences, past, write
        self.present: dict[int, tuple] = {}  # logical layer -> its new rows (k, v) [B, kvh, L, hd]

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        backend, past = self.backend, self.past
        slab = backend.layout.locate(step.layer)
        key = backend.pool.key[slab.layer, slab.column, self.sequences]  # [B, kvh, T+1, hd]
        value = backend.pool.value[slab.layer, slab.column, self.sequences]
        cross = self._cross_read(step.layer)
        x, k, v = layer_over_rows(self.decoder.blocks[step.block], x, self.ctx, key[:, :, :past], value[:, :, :past],
                                  self.cfg, cross=cross)
        self.present[step.layer] = (k, v)
        if self.write:
            key[:, :, past:past + k.shape[2]], value[:, :, past:past + k.shape[2]] = k, v  # [B, kvh, L, hd]
        return x

    def _cross_read(self, layer: int) -> CrossRead | None:
        """Logical layer LAYER's read of repeat 0's K/V (cross-repeat attention): that layer's slab of the pool
        rows below PAST, and the rows it returned this call (self.present)."""
        source = self.cfg.depth_plan.cross_source(layer)
        if source is None:
            return None
        pool, slab = self.backend.pool, self.backend.layout.locate(source)
        key, value = pool.key[slab.layer, slab.column, self.sequences], pool.value[slab.layer, slab.column, self.sequences]
        gate = self.decoder.gate_projections[source]
        return CrossRead(key[:, :, :self.past], value[:, :, :self.past], self.ctx.past_mask, *self.present[source],
                         self.ctx.chunk_mask, gate.weight, gate.bias)


class _StageOps(RowOps):
    """The walker's ops for a speed step's stage over P*W rows: stage layer j reads every slot's slab of j
    at once (a view of the pool); its new rows are kept (self.new), the exit tap after exit_layer layers."""

    def __init__(self, backend: TorchBackend, ctx: RowContext, starts: torch.Tensor, past: int, width: int,
                 x: torch.Tensor) -> None:
        super().__init__(backend.model.model, backend.cfg)
        self.backend, self.ctx, self.starts, self.past, self.width = backend, ctx, starts, past, width
        self.new: list[tuple] = []  # per stage layer: (k, v) [P*W, kvh, hd]
        self.tap = x

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        backend, j, rows, past = self.backend, step.layer, x.shape[0], self.past
        key = backend.pool.key[j].view(rows, *backend.pool.key.shape[3:])  # [P*W, kvh, T+1, hd], a view
        value = backend.pool.value[j].view(rows, *backend.pool.value.shape[3:])
        cross = None
        if self.cfg.depth_plan.cross_window:  # slot 0's slab of j, read in place by every slot's rows (step_cross_read)
            length = min(past + 1, backend.pool.key.shape[4])  # slot 1.. rows read the row at their own position too
            gate = self.decoder.gate_projections[j % len(self.cfg.depth_plan.core)]
            cross = step_cross_read(backend.pool.key[j, 0, :self.width, :, :length],
                                    backend.pool.value[j, 0, :self.width, :, :length], self.starts, backend.slots, gate)
        x, k, v = layer_over_rows(self.decoder.blocks[step.block], x, self.ctx, key[:, :, :past], value[:, :, :past],
                                  self.cfg, cross=cross)
        self.new.append((k[:, :, 0], v[:, :, 0]))
        return x

    def after(self, step, x: torch.Tensor) -> None:
        if step.layer + 1 == self.cfg.exit_layer:
            self.tap = x


def _on_grid(rows: list[int], n: int, width: int) -> np.ndarray:
    """Rows numbered s*n + b (the scheduler's) -> s*W + b (the step's rows over all W pool rows)."""
    rows = np.asarray(rows, np.int64)
    return rows // n * width + rows % n


def _device(device: str) -> torch.device:
    """torch.device of DEVICE ("cpu", "cuda", "cuda:N"), or a one-line SpeedcError."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpeedcError(f"device {device!r}: use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise SpeedcError(f"device {device!r}: CUDA is not available to torch on this machine")
    if resolved.type not in ("cpu", "cuda"):
        raise SpeedcError(f"device {device!r}: the PyTorch backend runs on cpu or cuda")
    return resolved
