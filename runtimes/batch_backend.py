"""ONNX Runtime (CPU) backend for continuous batching: a KV-cache pool of sequence slots and the three
graph runs the batch scheduler (runtimes/batch.py) needs. Imports numpy and onnxruntime only.

    pool K, V [S, P, B, kvh, T+1, hd]  (stage layer j, pipeline slot s, sequence slot b, ...)

T (`length`) follows the sequences in the pool (`reserve`: a power of two >= the longest prompt + max
new tokens in it, at least MIN_POOL_POSITIONS), up to `capacity` (--kv-cache-mb, else the context)
rather than holding every slot's whole context from the start: an Ouro-1.4B-shaped model keeps 1.5 MiB
per position per sequence (96 logical layers = 24 blocks x 4 loops, 16 KV heads x 128, K and V, fp32),
so 8 slots of a 32K context would be 384 GiB before the first request; numpy refuses such an allocation
on this machine (32 GiB of zeros raised MemoryError). A pool that cannot grow is a one-line
GenerationError, the old pool intact.

    prefill(b, chunk)   prefill graph, 1 row:  logical layer l = s*S + j reads pool[j, s, b][None]
    plain_step(n)       prefill graph, n rows (one token per sequence): pool[j, s, :n]
    speed_step(n)       batch_step graph, P*n rows, slot-major (row s*n + b): slab (j, s) = pool[j, s, :n];
                        fused: stage layer j's whole pool[j] as one [P*B, ...] buffer (one attention a layer)

Every slab a graph reads is a contiguous view of the pool (sequences 0..n-1: the scheduler keeps the
occupied sequence slots a prefix by moving the last one into a hole). Bubbles (empty pipeline slots,
sequences still prefilling) run where the scheduler says: just past what their sequence may read
(runtimes/batch.py _bubble_positions), or at row T (`length`), the scratch row each slab has; with the
fused graphs (GroupQueryAttention writes the cache in place, bound through IO binding) that is where
their K/V land, and no valid row reads it before it is rewritten. With the standard graphs new rows come
back as tensors and only valid rows are written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from speedc import contract
from speedc.artifact import Manifest
from speedc.errors import ArtifactError, GenerationError, SpeedcError
from speedc.runtimes.onnx_session import onnxruntime_module, open_sessions, take_dimensions

F32 = np.float32
MIN_POOL_POSITIONS = 256  # the pool's smallest length T (a regrow copies the pool: not for every request)


def batch_ready(manifest: Manifest) -> bool:
    """Whether the artifact can batch: its prefill graph takes many rows, and (P > 1) it has the batch step."""
    spec = manifest.graphs.get(contract.PREFILL, {})
    token = next((t for t in spec.get("outputs", []) if t["name"] == contract.NEXT_TOKEN), None)
    rows_dynamic = token is not None and not isinstance(token["shape"][0], int)
    return rows_dynamic and (manifest.slots == 1 or contract.BATCH_STEP in manifest.graphs)


def pool_bytes_per_position(manifest: Manifest) -> int:
    """K and V bytes one sequence slot needs per position (every logical layer)."""
    model = manifest.model
    return 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * np.dtype(F32).itemsize


def slot_capacity(manifest: Manifest, max_batch: int, kv_cache_mb: float | None) -> int:
    """Positions each of MAX_BATCH sequence slots holds: KV_CACHE_MB shared among them (None: the model's
    whole context each), at most the context. GenerationError when that leaves no room."""
    if max_batch < 1:
        raise GenerationError("max batch must be at least 1")
    context = manifest.model["max_context"]
    if kv_cache_mb is None:
        return context
    per_position = pool_bytes_per_position(manifest)
    capacity = min(context, int(kv_cache_mb * (1 << 20) / max_batch // per_position) - 1)  # - 1: the scratch row
    if capacity < 2:
        raise GenerationError(f"--kv-cache-mb {kv_cache_mb:g} leaves no room for {max_batch} sequences "
                              f"({per_position} bytes per position each)")
    return capacity


class BatchBackend:
    name = "onnx-batch"

    def __init__(self, directory: Path, manifest: Manifest, max_batch: int, capacity: int, threads: int | None = None,
                 fused: bool | None = None, min_length: int = MIN_POOL_POSITIONS) -> None:
        if not batch_ready(manifest):
            raise ArtifactError(f"{directory}: built before continuous batching (no batch_step graph); rebuild it with "
                                "this speedc (speedc build ... --force)")
        take_dimensions(self, manifest)
        programs = (contract.PREFILL, contract.BATCH_STEP) if self.slots > 1 else (contract.PREFILL,)
        if fused is None:
            fused = all(contract.fused(name) in manifest.graphs for name in programs)
        self.fused = fused
        self.graph = {name: contract.fused(name) if fused else name for name in programs}
        self.sessions = open_sessions(directory, manifest, tuple(self.graph.values()), ["CPUExecutionProvider"], threads)
        missing = [g for g in self.graph.values() if g not in self.sessions]
        if missing:
            raise ArtifactError(f"{directory}: has no {missing[0]} graph")
        self.max_batch, self.capacity = max_batch, capacity
        self.hidden = np.zeros((self.slots, max_batch, self.hidden_size), F32)  # last hidden_out, [slot, sequence]
        self._bindings: dict[tuple, object] = {}  # (role, rows, output names) -> IO binding with the slabs bound (fused)
        self.min_length = min_length
        self.length = 0  # positions T the pool holds per sequence slot now (reserve), at most capacity
        self.key = self.value = None
        self.reserve(0)

    @property
    def speculative(self) -> bool:
        return self.slots > 1

    def reserve(self, positions: int) -> None:
        """Make the pool hold POSITIONS (<= capacity) positions per sequence slot: T becomes the smallest
        power of two >= POSITIONS (at least min_length, at most capacity) when that is larger than
        T, or at most T / 4 (a batch swinging around one size does not copy back and forth). Every
        position below min(old T, new T) keeps its K/V (the scratch row T never matters)."""
        if positions > self.capacity:
            raise GenerationError(f"{positions} positions exceed the KV-cache slot of {self.capacity}")
        want = min(self.capacity, max(self.min_length, 1 << max(positions - 1, 0).bit_length()))
        if want == self.length or self.length // 4 < want < self.length:
            return
        keep = min(self.length, want)
        shape = (self.stage_layers, self.slots, self.max_batch, self.kv_heads, want + 1, self.head_dim)
        try:  # both new buffers first: if they do not fit, the pool stays as it was
            key, value = np.zeros(shape, F32), np.zeros(shape, F32)
        except MemoryError:
            mib = 2 * np.prod(shape, dtype=np.float64) * np.dtype(F32).itemsize / (1 << 20)
            raise GenerationError(f"the KV-cache pool cannot grow to {want} positions x {self.max_batch} sequences "
                                  f"({mib:,.0f} MiB): out of memory; set --kv-cache-mb or lower --max-batch") from None
        if keep:
            key[..., :keep, :], value[..., :keep, :] = self.key[..., :keep, :], self.value[..., :keep, :]
        self.key, self.value = key, value
        self.length = want
        self._bindings.clear()  # they point into the old pool

    def move(self, source: int, target: int, length: int | None = None) -> None:
        """Sequence slot SOURCE's cache (its first LENGTH positions; None: all) and pipeline state now live
        in slot TARGET."""
        cut = slice(None, length)
        for pool in (self.key, self.value):
            pool[:, :, target, :, cut] = pool[:, :, source, :, cut]
        self.hidden[:, target] = self.hidden[:, source]

    # ---- running a graph -------------------------------------------------------------------------
    def _run(self, role: str, feeds: dict, rows: tuple[int, int], slabs_of: Callable[[], dict[str, np.ndarray]],
             outputs: dict[str, tuple]) -> dict[str, np.ndarray]:
        """Run ROLE's graph over sequence slots ROWS = (first, end). SLABS_OF(): cache input name -> pool view
        (read, and written in place when fused). OUTPUTS: name -> (shape, dtype) of what to return.
        Standard graphs also return new_key/new_value.

        Fused: the pool never moves, so the IO binding of the cache slabs (2 x slabs binds, the bulk of a
        binding) is made once per (role, rows, output names) and kept; each run rebinds only the feeds and
        the outputs it returns (the same names every time for one key, so nothing stale stays bound)."""
        session = self.sessions[self.graph[role]]
        if not self.fused:
            names = list(outputs) + [contract.new_rows(kind) for kind in contract.KV_KINDS]
            return dict(zip(names, session.run(names, {**feeds, **slabs_of()})))
        key = (role, rows, tuple(outputs))
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = session.io_binding()
            for name, view in slabs_of().items():  # past and present: the same pool memory (written in place)
                binding.bind_input(name, "cpu", 0, F32, list(view.shape), view.ctypes.data)
                binding.bind_output(name + ".out", "cpu", 0, F32, list(view.shape), view.ctypes.data)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        results = {}
        for name, (shape, dtype) in outputs.items():
            results[name] = np.empty(shape, dtype)
            binding.bind_output(name, "cpu", 0, dtype, list(shape), results[name].ctypes.data)
        session.run_with_iobinding(binding)
        return results

    def _scratch(self, positions: np.ndarray, valid: np.ndarray, bubble_at: np.ndarray | None) -> np.ndarray:
        """Bubbles run at BUBBLE_AT [n] (per sequence slot, a position no row reads before it is rewritten;
        None: the scratch row T) when fused, as they write there; standard graphs: at 0 (never written)."""
        if not self.fused:
            return np.where(valid, positions, 0).astype(np.int64)
        at = self.length if bubble_at is None else np.minimum(bubble_at, self.length)
        return np.where(valid, positions, at).astype(np.int64)

    def _logical_slabs(self, rows: slice) -> dict[str, np.ndarray]:
        """Prefill-graph cache inputs: logical layer l = s*S + j reads pool[j, s, rows]."""
        slabs = {}
        for layer in range(self.num_layers):
            slot, j = divmod(layer, self.stage_layers)
            slabs[contract.cache_input("key", layer)] = self.key[j, slot, rows]
            slabs[contract.cache_input("value", layer)] = self.value[j, slot, rows]
        return slabs

    def prefill(self, sequence: int, ids: list[int], start: int, want_logits: bool) -> tuple[int, np.ndarray | None]:
        """Run a prompt chunk of sequence slot SEQUENCE through all N layers at positions start.."""
        feeds = {contract.INPUT_IDS: np.asarray([ids], np.int64), contract.POSITIONS: np.asarray([start], np.int64)}
        outputs = {contract.NEXT_TOKEN: ((1,), np.int64)}
        if want_logits:
            outputs[contract.LOGITS] = ((1, self.vocab_size), F32)
        result = self._run(contract.PREFILL, feeds, (sequence, sequence + 1),
                           lambda: self._logical_slabs(slice(sequence, sequence + 1)), outputs)
        if not self.fused:  # new rows [N, 1, kvh, L, hd] -> pool[j, s, sequence, :, start:start+L]
            for kind, pool in (("key", self.key), ("value", self.value)):
                new = result[contract.new_rows(kind)][:, 0]
                pool[:, :, sequence, :, start:start + len(ids)] = new.reshape(
                    self.slots, self.stage_layers, *new.shape[1:]).transpose(1, 0, 2, 3, 4)
        return int(result[contract.NEXT_TOKEN][0]), (result[contract.LOGITS][0] if want_logits else None)

    def plain_step(self, tokens: np.ndarray, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
                   bubble_at: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Plain decoding of sequences 0..n-1 at once: row b's token at positions[b] through all N layers.
        -> (argmax next tokens [n], logits [n, V] or None); invalid rows are bubbles (at bubble_at[b])."""
        n = len(tokens)
        feeds = {contract.INPUT_IDS: np.asarray(tokens, np.int64).reshape(n, 1),
                 contract.POSITIONS: self._scratch(positions, valid, bubble_at)}
        outputs = {contract.NEXT_TOKEN: ((n,), np.int64)}
        if want_logits:
            outputs[contract.LOGITS] = ((n, self.vocab_size), F32)
        result = self._run(contract.PREFILL, feeds, (0, n), lambda: self._logical_slabs(slice(0, n)), outputs)
        if not self.fused:  # new rows [N, n, kvh, 1, hd]; row b of layer s*S + j -> pool[j, s, b, :, positions[b]]
            rows = np.flatnonzero(valid)
            for kind, pool in (("key", self.key), ("value", self.value)):
                new = result[contract.new_rows(kind)][:, :, :, 0]  # [N, n, kvh, hd]
                new = new.reshape(self.slots, self.stage_layers, *new.shape[1:]).transpose(1, 0, 2, 3, 4)  # [S, P, n, kvh, hd]
                # advanced indices (rows, positions) split by a slice: the target is [k, S, P, kvh, hd]
                pool[:, :, rows, :, positions[rows]] = new[:, :, rows].transpose(2, 0, 1, 3, 4)
        return result[contract.NEXT_TOKEN], (result[contract.LOGITS] if want_logits else None)

    def speed_step(self, entering: np.ndarray, positions: np.ndarray, valid: np.ndarray, final_rows: np.ndarray,
                   exit_rows: np.ndarray, want_logits: bool,
                   bubble_at: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """One pipelined step of sequences 0..n-1: entering [n] tokens enter slot 0; positions/valid [P, n]
        (slot, sequence); bubbles of sequence b at bubble_at[b]. -> (final tokens [F], final logits [F, V] or
        None, exit tokens [E]) for the rows final_rows / exit_rows (row = s*n + b)."""
        slots, n = positions.shape
        rows = slots * n
        feeds = {contract.INPUT_IDS: np.asarray(entering, np.int64).reshape(n, 1),
                 contract.POSITIONS: self._scratch(positions, valid, None if bubble_at is None else bubble_at[None, :]).reshape(rows),
                 contract.HIDDEN_IN: np.ascontiguousarray(self.hidden[:slots - 1, :n]).reshape((slots - 1) * n, 1, -1),
                 contract.FINAL_ROWS: np.asarray(final_rows, np.int64), contract.EXIT_ROWS: np.asarray(exit_rows, np.int64)}
        def slabs():
            views = {}
            for j in range(self.stage_layers):
                for kind, pool in (("key", self.key), ("value", self.value)):
                    if self.fused:  # the stage layer's whole pool, one buffer [P*B, kvh, T+1, hd]
                        views[contract.cache_input(kind, j)] = pool[j].reshape(-1, *pool.shape[3:])
                    else:
                        for s in range(slots):
                            views[contract.batch_cache_input(kind, j, s)] = pool[j, s, :n]
            return views

        outputs = {contract.FINAL_TOKEN: ((len(final_rows),), np.int64), contract.EXIT_TOKENS: ((len(exit_rows),), np.int64),
                   contract.HIDDEN_OUT: ((rows, 1, self.hidden_size), F32)}
        if want_logits:
            outputs[contract.FINAL_LOGITS] = ((len(final_rows), self.vocab_size), F32)
        # fused: the whole pool is bound whatever n is, so one binding serves every n
        result = self._run(contract.BATCH_STEP, feeds, (0, self.max_batch if self.fused else n), slabs, outputs)
        self.hidden[:, :n] = result[contract.HIDDEN_OUT].reshape(slots, n, self.hidden_size)
        if not self.fused:  # new rows [S, R, kvh, 1, hd] -> pool[j, s, b, :, positions[s, b]] for valid (s, b)
            s_index, b_index = np.nonzero(valid)
            at = positions[s_index, b_index]
            for kind, pool in (("key", self.key), ("value", self.value)):
                new = result[contract.new_rows(kind)][:, :, :, 0].reshape(self.stage_layers, slots, n, self.kv_heads, -1)
                pool[:, s_index, b_index, :, at] = new[:, s_index, b_index].transpose(1, 0, 2, 3)
        return (result[contract.FINAL_TOKEN], result[contract.FINAL_LOGITS] if want_logits else None,
                result[contract.EXIT_TOKENS])


def make_batch_backend(directory: Path, manifest: Manifest, max_batch: int, capacity: int, device: str = "cpu",
                       threads: int | None = None, fused: bool | None = None) -> BatchBackend:
    if device != "cpu":
        raise SpeedcError(f"device {device!r}: continuous batching runs on the CPU in this version")
    onnxruntime_module()
    return BatchBackend(directory, manifest, max_batch, capacity, threads=threads, fused=fused)
