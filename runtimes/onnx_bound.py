"""ONNX Runtime backend with IO binding: the cache, hidden states and new K/V rows stay in device
buffers (CUDA with onnxruntime-gpu, or CPU); per step only the token ids (and positions) cross to the
host, plus the logits when sampling. Imports numpy and onnxruntime only.

    step graph:    cache.{key,value}.{j} = views of the cache buffers (bound by address at reset)
                   hidden_in = first P-1 rows of the previous step's hidden_out (ping-pong buffers)
                   new_key/new_value -> device row buffers -> cache_write_step (ScatterND, in place)
    prefill graph: cache views per layer; new rows (ORT-allocated on the device) -> cache_write_prefill

The cache has one scratch row past the request's capacity: bubbles write there, and no attention
mask ever reads it (keys are read below each row's own position).
"""

from __future__ import annotations

import numpy as np

from speedc.artifact import Manifest
from speedc.errors import ArtifactError, SpeedcError
from speedc.runtimes.backend import StepResult
from speedc.runtimes.onnx_backend import _ort, open_sessions

F32 = np.dtype(np.float32).itemsize


def _providers(device: str) -> tuple[list, str, int]:
    """(ORT providers, ORT device name, device id) for "cpu", "cuda" or "cuda:N"."""
    ort = _ort()
    if device == "cpu":
        return ["CPUExecutionProvider"], "cpu", 0
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise SpeedcError(f"device {device!r}: use cpu, cuda or cuda:N")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise SpeedcError(f"device {device!r}: this onnxruntime has no CUDA provider "
                          "(pip install 'speedc[gpu]', i.e. onnxruntime-gpu, on a machine with an NVIDIA GPU)")
    device_id = int(index or 0)
    return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"], "cuda", device_id


class OnnxBoundBackend:
    name = "onnx-bound"

    def __init__(self, directory, manifest: Manifest, device: str = "cpu", threads: int | None = None) -> None:
        providers, self.ort_device, self.device_id = _providers(device)
        if "cache_write_prefill" not in manifest.graphs:
            raise ArtifactError(f"{directory}: built without the cache-write graphs IO binding needs; rebuild it "
                                "with this speedc (speedc build ... --force)")
        model = manifest.model
        self.slots, self.stage_layers = manifest.slots, manifest.stage_layers
        self.num_layers = model["num_layers"]
        self.vocab_size, self.max_context = model["vocab_size"], model["max_context"]
        self.kv_heads, self.head_dim, self.hidden_size = model["num_kv_heads"], model["head_dim"], model["hidden_size"]
        self.sessions = open_sessions(directory, manifest, ("prefill", "step", "step_flush", "cache_write_step",
                                                            "cache_write_prefill"), providers, threads)
        self.bindings = {name: session.io_binding() for name, session in self.sessions.items()}
        self.capacity = None
        # Host buffers the token outputs are bound to: reading them is the only per-step transfer.
        self.final_token = np.zeros(1, np.int64)
        self.exit_tokens = {"step": np.zeros(1, np.int64), "step_flush": np.zeros(self.slots, np.int64)}
        self.next_token = np.zeros(1, np.int64)

    # ---- buffers ---------------------------------------------------------------------------------
    def _device_zeros(self, shape: tuple[int, ...]):
        return _ort().OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), self.ort_device, self.device_id)

    def _bind_in(self, binding, name: str, address: int, shape) -> None:
        binding.bind_input(name, self.ort_device, self.device_id, np.float32, list(shape), address)

    def _bind_out(self, binding, name: str, address: int, shape) -> None:
        binding.bind_output(name, self.ort_device, self.device_id, np.float32, list(shape), address)

    def reset(self, capacity: int) -> None:
        if self.capacity != capacity:
            self.capacity = capacity
            rows = capacity + 1  # + the scratch row bubbles write to
            shape = (self.stage_layers, self.slots, self.kv_heads, rows, self.head_dim)
            # Zeroed once: masked keys get weight 0, and 0 * garbage could be NaN.
            self.key, self.value = self._device_zeros(shape), self._device_zeros(shape)
            self.hidden = [self._device_zeros((self.slots, 1, self.hidden_size)) for _ in range(2)]
            row_shape = (self.stage_layers, self.slots, self.kv_heads, 1, self.head_dim)
            self.new_rows = {"key": self._device_zeros(row_shape), "value": self._device_zeros(row_shape)}
            self._bind_cache_views(rows)
        self.current = 0  # hidden[current] holds the last step's hidden_out
        for buffer in self.hidden:  # a fresh request starts from empty slots
            buffer.update_inplace(np.zeros((self.slots, 1, self.hidden_size), np.float32))

    def _bind_cache_views(self, rows: int) -> None:
        slab = self.kv_heads * rows * self.head_dim * F32  # one (stage layer, slot) [kvh, T, hd]
        full = (self.stage_layers, self.slots, self.kv_heads, rows, self.head_dim)
        for kind, buffer in (("key", self.key), ("value", self.value)):
            base = buffer.data_ptr()
            for name in ("step", "step_flush"):
                if name in self.bindings:
                    for j in range(self.stage_layers):
                        self._bind_in(self.bindings[name], f"cache.{kind}.{j}", base + j * self.slots * slab,
                                      (self.slots, self.kv_heads, rows, self.head_dim))
            for layer in range(self.num_layers):
                slot, j = divmod(layer, self.stage_layers)
                self._bind_in(self.bindings["prefill"], f"cache.{kind}.{layer}", base + (j * self.slots + slot) * slab,
                              (1, self.kv_heads, rows, self.head_dim))
            for name in ("cache_write_step", "cache_write_prefill"):
                if name in self.bindings:  # the same buffer in and out: ScatterND writes in place
                    self._bind_in(self.bindings[name], f"cache.{kind}", base, full)
                    self._bind_out(self.bindings[name], f"cache.{kind}.out", base, full)
        if "cache_write_step" in self.bindings:
            for kind in ("key", "value"):
                self._bind_in(self.bindings["cache_write_step"], f"new_{kind}", self.new_rows[kind].data_ptr(),
                              self.new_rows[kind].shape())

    # ---- graphs ----------------------------------------------------------------------------------
    def prefill(self, ids: list[int], start: int, want_logits: bool) -> tuple[int, np.ndarray | None]:
        binding = self.bindings["prefill"]
        binding.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input("positions", np.asarray([start], dtype=np.int64))
        binding.clear_binding_outputs()
        binding.bind_output("next_token", "cpu", 0, np.int64, [1], self.next_token.ctypes.data)
        for kind in ("key", "value"):  # [N, 1, kvh, L, hd], allocated by ORT on the device
            binding.bind_output(f"new_{kind}", self.ort_device, self.device_id)
        if want_logits:
            binding.bind_output("logits", "cpu")
        self.sessions["prefill"].run_with_iobinding(binding)
        outputs = binding.get_outputs()
        writer = self.bindings["cache_write_prefill"]
        shape = (self.slots, self.stage_layers, self.kv_heads, len(ids), self.head_dim)  # same bytes as [N, 1, ...]
        for kind, rows in zip(("key", "value"), outputs[1:3]):
            self._bind_in(writer, f"new_{kind}", rows.data_ptr(), shape)
        writer.bind_cpu_input("write_start", np.full(self.slots, start, dtype=np.int64))
        self.sessions["cache_write_prefill"].run_with_iobinding(writer)
        return int(self.next_token[0]), (outputs[3].numpy()[0] if want_logits else None)

    def step(self, token: int, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
             all_exits: bool = False) -> StepResult:
        name = "step_flush" if all_exits else "step"
        binding = self.bindings[name]
        previous, nxt = self.hidden[self.current], self.hidden[1 - self.current]
        binding.bind_cpu_input("input_ids", np.asarray([[token]], dtype=np.int64))
        binding.bind_cpu_input("positions", positions.astype(np.int64))
        # slot s's output is slot s+1's input: the first P-1 rows of the last hidden_out, in place
        self._bind_in(binding, "hidden_in", previous.data_ptr(), (self.slots - 1, 1, self.hidden_size))
        binding.clear_binding_outputs()
        binding.bind_output("final_token", "cpu", 0, np.int64, [1], self.final_token.ctypes.data)
        exits = self.exit_tokens[name]
        binding.bind_output("exit_tokens", "cpu", 0, np.int64, list(exits.shape), exits.ctypes.data)
        self._bind_out(binding, "hidden_out", nxt.data_ptr(), (self.slots, 1, self.hidden_size))
        for kind in ("key", "value"):
            self._bind_out(binding, f"new_{kind}", self.new_rows[kind].data_ptr(), self.new_rows[kind].shape())
        if want_logits:
            binding.bind_output("final_logits", "cpu")
        self.sessions[name].run_with_iobinding(binding)
        self.current = 1 - self.current
        writer = self.bindings["cache_write_step"]
        writer.bind_cpu_input("write_start", np.where(valid, positions, self.capacity).astype(np.int64))  # bubbles: scratch row
        self.sessions["cache_write_step"].run_with_iobinding(writer)
        logits = binding.get_outputs()[5].numpy()[0] if want_logits else None
        return StepResult(int(self.final_token[0]), logits, exits.copy())
