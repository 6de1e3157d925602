"""ONNX Runtime backend fed numpy views (`--backend onnx-numpy`, CPU): the simplest path, and the
one for artifacts built before the IO-binding graphs. Imports numpy and onnxruntime only.

The graphs only read the cache (inputs are views of this backend's numpy buffers, bound without a
copy) and return the new K/V rows as one small tensor each; this backend writes them in place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from speedc import contract
from speedc.artifact import Manifest
from speedc.errors import SpeedcError
from speedc.runtimes.backend import StepResult, cache_slab
from speedc.runtimes.onnx_session import open_sessions, take_dimensions


NEW_ROWS = tuple(contract.new_rows(kind) for kind in contract.KV_KINDS)


class OnnxNumpyBackend:
    name = "onnx-numpy"

    def __init__(self, directory: Path, manifest: Manifest, device: str = "cpu", threads: int | None = None) -> None:
        if device != "cpu":
            raise SpeedcError(f"device {device!r}: this backend feeds numpy arrays on the CPU; "
                              "use --backend onnx for a device-resident cache")
        take_dimensions(self, manifest)
        self.sessions = open_sessions(directory, manifest, contract.PROGRAMS,
                                      ["CPUExecutionProvider"], threads)
        self.key = self.value = None
        self.hidden_in = np.zeros((max(self.slots - 1, 0), 1, self.hidden_size), np.float32)

    def reset(self, capacity: int) -> None:
        shape = (self.stage_layers, self.slots, self.kv_heads, capacity, self.head_dim)
        if self.key is None or self.key.shape != shape:
            self.key, self.value = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
            # The graphs read the cache through views fixed for the life of these buffers (no copies).
            self.step_cache_feeds = {}
            for j in range(self.stage_layers):
                self.step_cache_feeds[contract.cache_input("key", j)] = self.key[j]
                self.step_cache_feeds[contract.cache_input("value", j)] = self.value[j]
            self.prefill_cache_feeds = {}
            for layer in range(self.num_layers):
                j, slot = cache_slab(layer, self.stage_layers)
                self.prefill_cache_feeds[contract.cache_input("key", layer)] = self.key[j, slot][None]
                self.prefill_cache_feeds[contract.cache_input("value", layer)] = self.value[j, slot][None]
        self.hidden_in[:] = 0.0

    def prefill(self, ids: list[int], start: int, want_logits: bool) -> tuple[int, np.ndarray | None]:
        feeds = {contract.INPUT_IDS: np.asarray([ids], dtype=np.int64), contract.POSITIONS: np.asarray([start], dtype=np.int64),
                 contract.CHUNK_LENGTHS: np.asarray([len(ids)], dtype=np.int64), **self.prefill_cache_feeds}
        names = [contract.NEXT_TOKEN, *NEW_ROWS] + ([contract.LOGITS] if want_logits else [])
        outputs = self.sessions[contract.PREFILL].run(names, feeds)
        token, new_key, new_value = outputs[:3]
        length = len(ids)
        # new rows [N, 1, kvh, L, hd] -> buffer[j, slot, :, start:start+L] for layer = slot*S + j
        shape = (self.slots, self.stage_layers, self.kv_heads, length, self.head_dim)
        self.key[:, :, :, start:start + length] = new_key[:, 0].reshape(shape).transpose(1, 0, 2, 3, 4)
        self.value[:, :, :, start:start + length] = new_value[:, 0].reshape(shape).transpose(1, 0, 2, 3, 4)
        return int(token[0]), (outputs[3][0] if want_logits else None)

    def step(self, token: int, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
             all_exits: bool = False) -> StepResult:
        feeds = {contract.INPUT_IDS: np.asarray([[token]], dtype=np.int64),
                 contract.POSITIONS: np.asarray(positions, dtype=np.int64),
                 contract.HIDDEN_IN: self.hidden_in, **self.step_cache_feeds}
        names = [contract.FINAL_TOKEN, contract.EXIT_TOKENS, contract.HIDDEN_OUT, *NEW_ROWS]
        names += [contract.FINAL_LOGITS] if want_logits else []
        outputs = self.sessions[contract.STEP_FLUSH if all_exits else contract.STEP].run(names, feeds)
        final_token, exit_tokens, hidden_out, new_key, new_value = outputs[:5]
        # New rows [S, P, kvh, 1, hd] -> buffer[:, s, :, positions[s]] for valid slots only (bubbles never
        # write). The indexed target is [n, S, kvh, hd] (advanced indices first), hence the transpose.
        rows = np.flatnonzero(valid)
        self.key[:, rows, :, positions[rows]] = new_key[:, :, :, 0][:, rows].transpose(1, 0, 2, 3)
        self.value[:, rows, :, positions[rows]] = new_value[:, :, :, 0][:, rows].transpose(1, 0, 2, 3)
        self.hidden_in = hidden_out[:-1]  # slot s's output is slot s+1's input next step
        return StepResult(int(final_token[0]), outputs[5][0] if want_logits else None, exit_tokens)
