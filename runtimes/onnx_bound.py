"""ONNX Runtime backend with IO binding: the cache, hidden states and new K/V rows stay in device
buffers (CUDA with onnxruntime-gpu, or CPU); per step only the token ids and positions cross to the
host, plus the logits when sampling. Imports numpy and onnxruntime only.

Two artifact layouts, same buffers:
- fused (`*.gqa` graphs, passes/gqa_attention.py): each layer's GroupQueryAttention reads and writes
  the cache in place (past and present bound to one buffer); nothing else to do.
- standard graphs: new K/V rows go to device buffers, then the cache_write_* graphs scatter them into
  the cache in place (passes/cache_writer.py).

    cache [S, P, kvh, T+1, hd]   step views: [j] -> [P, kvh, T+1, hd]; prefill views: [j, s] -> [1, ...]
    hidden: two [P, 1, H] buffers, ping-pong (slot s's output is slot s+1's input next step)

Row T (one past the request's capacity) is scratch: bubbles (invalid slots) run at that position and
write there, and no row ever reads it (each row reads keys below its own position).
"""

from __future__ import annotations

import numpy as np

from speedc import contract
from speedc.artifact import Manifest
from speedc.errors import ArtifactError, SpeedcError
from speedc.runtimes.backend import StepResult, cache_slab
from speedc.runtimes.onnx_session import bound_address, onnxruntime_module, open_sessions, providers_for, take_dimensions

F32 = np.dtype(np.float32).itemsize


def io_binding_graphs(manifest: Manifest) -> bool:
    """Whether the artifact has what this backend needs (artifacts built before it lack the graphs)."""
    return contract.CACHE_WRITE_PREFILL in manifest.graphs or contract.fused(contract.PREFILL) in manifest.graphs


class OnnxBoundBackend:
    name = "onnx"

    def __init__(self, directory, manifest: Manifest, device: str = "cpu", threads: int | None = None,
                 fused: bool | None = None, profile_prefix: str | None = None) -> None:
        """FUSED: use the *.gqa graphs (None: on the CPU when the artifact has them).
        PROFILE_PREFIX: profile every run per op (ONNX Runtime profiling; end_profiling() names the files)."""
        providers, self.ort_device, self.device_id = providers_for(device)
        available = manifest.graphs
        # Fused attention on the CPU only: the graphs compute in fp32, and ONNX Runtime's CUDA
        # GroupQueryAttention kernels are registered for fp16/bf16 (to our knowledge; not run here),
        # so on CUDA the standard graphs and the cache writers are used.
        if fused is None:
            fused = self.ort_device == "cpu" and contract.fused(contract.PREFILL) in available
        self.fused = fused
        if self.fused and contract.fused(contract.PREFILL) not in available:
            raise ArtifactError(f"{directory}: has no fused-attention graphs (built for another target?)")
        if not self.fused and contract.CACHE_WRITE_PREFILL not in available:
            raise ArtifactError(f"{directory}: built without the cache-write graphs IO binding needs; rebuild it "
                                "with this speedc (speedc build ... --force)")
        take_dimensions(self, manifest)
        # role (the contract's program name) -> the graph that plays it here
        self.graph = {name: contract.fused(name) if self.fused else name for name in contract.PROGRAMS}
        writers = () if self.fused else (contract.CACHE_WRITE_STEP, contract.CACHE_WRITE_PREFILL)
        names = tuple(self.graph.values()) + writers
        self.sessions = open_sessions(directory, manifest, names, providers, threads, profile_prefix)
        self.capacity = None
        # Host buffers the token outputs are bound to: reading them is the only per-step transfer.
        self.next_token, self.final_token = np.zeros(1, np.int64), np.zeros(1, np.int64)
        self.exit_tokens = {contract.STEP: np.zeros(1, np.int64), contract.STEP_FLUSH: np.zeros(self.slots, np.int64)}
        self.logits = np.zeros((1, self.vocab_size), np.float32)  # bound only when sampling needs them

    def end_profiling(self) -> dict[str, str]:
        """Role (prefill, step, ...) -> the profile file of the graph that plays it (profiled backends)."""
        return {role: self.sessions[graph].end_profiling() for role, graph in self.graph.items() if graph in self.sessions}

    # ---- buffers and bindings (made once per capacity) -------------------------------------------
    def _device_zeros(self, shape: tuple[int, ...]):
        return onnxruntime_module().OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), self.ort_device, self.device_id)

    def _bind(self, binding, name: str, address: int, shape, *, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, self.ort_device, self.device_id, np.float32, list(shape), address)

    @staticmethod
    def _bind_host(binding, name: str, array: np.ndarray, dtype) -> None:
        """Output NAME (of DTYPE) written straight into the host array ARRAY."""
        binding.bind_output(name, "cpu", 0, dtype, list(array.shape), bound_address(binding, name, array, dtype))

    def reset(self, capacity: int) -> None:
        if self.capacity != capacity:
            # Set again once every buffer and binding below exists: a failure part way (out of memory, say)
            # must not leave a capacity that the next request of that length would trust.
            self.capacity = None
            rows = capacity + 1  # + the scratch row bubbles write to
            shape = (self.stage_layers, self.slots, self.kv_heads, rows, self.head_dim)
            # Zeroed once: masked keys get weight 0, and 0 * garbage could be NaN.
            self.key, self.value = self._device_zeros(shape), self._device_zeros(shape)
            self.hidden = [self._device_zeros((self.slots, 1, self.hidden_size)) for _ in range(2)]
            row_shape = (self.stage_layers, self.slots, self.kv_heads, 1, self.head_dim)
            self.new_rows = {"key": self._device_zeros(row_shape), "value": self._device_zeros(row_shape)}
            self._make_bindings(rows)
            self.capacity = capacity
        self.current = 0  # hidden[current] holds the last step's hidden_out
        for buffer in self.hidden:  # a fresh request starts from empty slots
            buffer.update_inplace(np.zeros((self.slots, 1, self.hidden_size), np.float32))

    def _cache_views(self, role: str, base: int, rows: int) -> list[tuple[int, int, tuple]]:
        """(input index, address, shape) of each cache view a graph reads: a step reads one
        [P, kvh, T, hd] slab per stage layer; prefill one [1, kvh, T, hd] slab per logical layer."""
        slab = self.kv_heads * rows * self.head_dim * F32  # bytes of one (stage layer, slot) slab
        if role != contract.PREFILL:
            return [(j, base + j * self.slots * slab, (self.slots, self.kv_heads, rows, self.head_dim))
                    for j in range(self.stage_layers)]
        views = []
        for layer in range(self.num_layers):
            j, slot = cache_slab(layer, self.stage_layers)
            views.append((layer, base + (j * self.slots + slot) * slab, (1, self.kv_heads, rows, self.head_dim)))
        return views

    def _make_bindings(self, rows: int) -> None:
        """One binding per (graph, with logits?): cache views and fixed outputs bound here, once."""
        self.bindings = {}
        for role, graph in self.graph.items():
            if graph not in self.sessions:
                continue  # a plain engine has no step graphs
            for with_logits in (False, True):
                binding = self.sessions[graph].io_binding()
                for kind, buffer in (("key", self.key), ("value", self.value)):
                    for index, address, view in self._cache_views(role, buffer.data_ptr(), rows):
                        self._bind(binding, contract.cache_input(kind, index), address, view)
                        if self.fused:  # present = past: GroupQueryAttention writes the new rows in place
                            self._bind(binding, contract.cache_output(kind, index), address, view, output=True)
                if role == contract.PREFILL:
                    self._bind_host(binding, contract.NEXT_TOKEN, self.next_token, np.int64)
                else:
                    self._bind_host(binding, contract.FINAL_TOKEN, self.final_token, np.int64)
                    self._bind_host(binding, contract.EXIT_TOKENS, self.exit_tokens[role], np.int64)
                    if not self.fused:
                        for kind in ("key", "value"):
                            self._bind(binding, contract.new_rows(kind), self.new_rows[kind].data_ptr(), self.new_rows[kind].shape(),
                                       output=True)
                if with_logits:
                    self._bind_host(binding, contract.LOGITS if role == contract.PREFILL else contract.FINAL_LOGITS, self.logits,
                                    np.float32)
                self.bindings[role, with_logits] = binding
        if not self.fused:
            full = (self.stage_layers, self.slots, self.kv_heads, rows, self.head_dim)
            for name in (contract.CACHE_WRITE_STEP, contract.CACHE_WRITE_PREFILL):
                if name not in self.sessions:
                    continue
                binding = self.bindings[name] = self.sessions[name].io_binding()
                for kind, buffer in (("key", self.key), ("value", self.value)):  # in and out: ScatterND in place
                    self._bind(binding, contract.cache_buffer(kind), buffer.data_ptr(), full)
                    self._bind(binding, contract.cache_buffer_out(kind), buffer.data_ptr(), full, output=True)
                    if name == contract.CACHE_WRITE_STEP:
                        self._bind(binding, contract.new_rows(kind), self.new_rows[kind].data_ptr(), self.new_rows[kind].shape())

    # ---- graphs ----------------------------------------------------------------------------------
    def prefill(self, ids: list[int], start: int, want_logits: bool) -> tuple[int, np.ndarray | None]:
        binding = self.bindings[contract.PREFILL, want_logits]
        binding.bind_cpu_input(contract.INPUT_IDS, np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input(contract.POSITIONS, np.asarray([start], dtype=np.int64))
        binding.bind_cpu_input(contract.CHUNK_LENGTHS, np.asarray([len(ids)], dtype=np.int64))
        new_rows = {}
        if not self.fused:  # [N, 1, kvh, L, hd]: L varies, so a buffer per call
            for kind in ("key", "value"):
                new_rows[kind] = onnxruntime_module().OrtValue.ortvalue_from_shape_and_type(
                    [self.num_layers, 1, self.kv_heads, len(ids), self.head_dim], np.float32, self.ort_device, self.device_id)
                self._bind(binding, contract.new_rows(kind), new_rows[kind].data_ptr(), new_rows[kind].shape(), output=True)
        self.sessions[self.graph[contract.PREFILL]].run_with_iobinding(binding)
        if not self.fused:
            writer = self.bindings[contract.CACHE_WRITE_PREFILL]
            shape = (self.slots, self.stage_layers, self.kv_heads, len(ids), self.head_dim)  # same bytes as [N, 1, ...]
            for kind in ("key", "value"):
                self._bind(writer, contract.new_rows(kind), new_rows[kind].data_ptr(), shape)
            writer.bind_cpu_input(contract.WRITE_START, np.full(self.slots, start, dtype=np.int64))
            self.sessions[contract.CACHE_WRITE_PREFILL].run_with_iobinding(writer)
        return int(self.next_token[0]), (self.logits[0].copy() if want_logits else None)

    def step(self, token: int, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
             all_exits: bool = False) -> StepResult:
        role = contract.STEP_FLUSH if all_exits else contract.STEP
        binding = self.bindings[role, want_logits]
        previous, nxt = self.hidden[self.current], self.hidden[1 - self.current]
        # Bubbles run at the scratch row: with fused attention that is where their K/V land.
        write_at = np.where(valid, positions, self.capacity).astype(np.int64)
        binding.bind_cpu_input(contract.INPUT_IDS, np.asarray([[token]], dtype=np.int64))
        binding.bind_cpu_input(contract.POSITIONS, write_at if self.fused else np.asarray(positions, dtype=np.int64))
        # slot s's output is slot s+1's input: the first P-1 rows of the last hidden_out, in place
        self._bind(binding, contract.HIDDEN_IN, previous.data_ptr(), (self.slots - 1, 1, self.hidden_size))
        self._bind(binding, contract.HIDDEN_OUT, nxt.data_ptr(), (self.slots, 1, self.hidden_size), output=True)
        self.sessions[self.graph[role]].run_with_iobinding(binding)
        self.current = 1 - self.current
        if not self.fused:
            writer = self.bindings[contract.CACHE_WRITE_STEP]
            writer.bind_cpu_input(contract.WRITE_START, write_at)
            self.sessions[contract.CACHE_WRITE_STEP].run_with_iobinding(writer)
        return StepResult(int(self.final_token[0]), self.logits[0].copy() if want_logits else None,
                          self.exit_tokens[role].copy())
