"""PyTorch backend: the same schedule as the compiled step graph, run from the artifact's weights.

    step:  [embed(token); hidden_in] -> [P,H] (token rows) -> stage layers 0..S-1 (each block's weights applied
           once to all P rows) -> exit head (all rows), final head (row P-1), new K/V rows

It runs on CPU or CUDA (`device="cuda"`); the cache and hidden states stay on the device and only
token ids (and logits when sampling) cross to the host. Needs torch and the compiler extra.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from speedc.artifact import (CONFIG, Manifest, checkpoint_tensor_names, dequantized_weights, exit_norm_kind, is_quantized,
                             read_weight)
from speedc.errors import SpeedcError
from speedc.models.config import ModelConfig
from speedc.models.layer_map import valid_slot_counts
from speedc.models.llama import SharedLlama
from speedc.models.row_layer import layer_over_rows, loop_boundary, rotary_inv_freq, row_context
from speedc.runtimes.backend import StepResult, cache_slab


def load_model_from_artifact(directory: Path, manifest: Manifest) -> SharedLlama:
    """The artifact's weights as a PyTorch SharedLlama, with the layer map and exit the compiler chose."""
    from speedc.models.checkpoint import model_from_state  # imports safetensors: not needed by from_model

    base = ModelConfig.load(directory / CONFIG)
    index = manifest.weights["index"]
    # The artifact's layer map is the one the share pass derived from the weights.
    cfg = dataclasses.replace(base, layer_map=list(manifest.layer_map), exit_layer=manifest.exit_layer,
                              exit_norm=exit_norm_kind(manifest))
    tensors = {name: torch.from_numpy(np.array(read_weight(directory, manifest, name), dtype=np.float32))
               for name in checkpoint_tensor_names(manifest)}
    if is_quantized(manifest):  # the dequantized weights (peers and sweeps rebuild from these; not a backend)
        tensors.update({name: torch.from_numpy(np.array(values)) for name, values in dequantized_weights(directory, manifest).items()})
    return model_from_state(cfg, tensors)


class TorchBackend:
    name = "torch"

    def __init__(self, directory: Path, manifest: Manifest, device: str = "cpu", threads: int | None = None) -> None:
        if is_quantized(manifest):
            raise SpeedcError(f"{directory}: the PyTorch backend runs float artifacts; this one stores {manifest.dtype} "
                              "weights for ONNX Runtime's MatMulNBits: use --backend onnx, or build with --weights fp32/fp16/bf16")
        self._setup(load_model_from_artifact(directory, manifest), manifest.slots, device, threads)

    @classmethod
    def from_model(cls, model: SharedLlama, slots: int, device: str = "cpu", threads: int | None = None) -> "TorchBackend":
        """A backend over an in-memory model (no artifact): what the GPU check uses where only torch is
        installed. SLOTS must be a valid pipeline depth for the layer map (valid_slot_counts)."""
        if slots not in valid_slot_counts(model.cfg.layer_map, model.cfg.exit_layer):
            raise SpeedcError(f"{slots} slots do not fit the layer map {model.cfg.layer_map} (exit after {model.cfg.exit_layer})")
        backend = cls.__new__(cls)
        backend._setup(model, slots, device, threads)
        return backend

    def _setup(self, model: SharedLlama, slots: int, device: str, threads: int | None) -> None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SpeedcError(f"device {device!r}: CUDA is not available to torch on this machine")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.cfg = cfg = self.model.cfg
        self.slots, self.stage_layers = slots, cfg.num_hidden_layers // slots
        self.vocab_size, self.max_context = cfg.vocab_size, cfg.max_position_embeddings
        self.key = self.value = None
        self.inv_freq = rotary_inv_freq(cfg, self.device)
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.hidden_in = torch.zeros(max(self.slots - 1, 0), cfg.hidden_size, device=self.device)  # token rows [P-1, H]

    def reset(self, capacity: int) -> None:
        shape = (self.stage_layers, self.slots, self.cfg.num_key_value_heads, capacity, self.cfg.head_dim)
        if self.key is None or tuple(self.key.shape) != shape:
            self.key = torch.zeros(shape, device=self.device)
            self.value = torch.zeros(shape, device=self.device)
        self.hidden_in.zero_()

    @torch.no_grad()
    def prefill(self, ids: list[int], start: int, want_logits: bool) -> tuple[int, np.ndarray | None]:
        cfg, model = self.cfg, self.model
        x = model.model.embed_tokens(torch.tensor(ids, device=self.device))  # token rows [L, H]
        length = len(ids)
        ctx = row_context(torch.tensor([start], device=self.device), length, self.key.shape[3], self.inv_freq, self.groups)
        for layer, block_index in enumerate(cfg.layer_map):
            j, slot = cache_slab(layer, self.stage_layers)
            x, k, v = layer_over_rows(model.model.blocks[block_index], x, ctx, self.key[j, slot][None],
                                      self.value[j, slot][None], cfg)
            x = loop_boundary(x, model.model.norm.weight, cfg, layer)
            self.key[j, slot, :, start:start + length] = k[0]
            self.value[j, slot, :, start:start + length] = v[0]
        logits = model.final_head(x[-1:])[0]  # [V]
        return int(logits.argmax()), (logits.float().cpu().numpy() if want_logits else None)

    @torch.no_grad()
    def step(self, token: int, positions: np.ndarray, valid: np.ndarray, want_logits: bool,
             all_exits: bool = False) -> StepResult:
        cfg, model = self.cfg, self.model
        x = torch.cat((model.model.embed_tokens(torch.tensor([token], device=self.device)), self.hidden_in))  # [P, H]
        starts = torch.from_numpy(positions.astype(np.int64)).to(self.device)
        new_rows, exit_hidden = [], None
        ctx = row_context(starts, 1, self.key.shape[3], self.inv_freq, self.groups)
        for j in range(self.stage_layers):
            x, k, v = layer_over_rows(model.model.blocks[cfg.layer_map[j]], x, ctx, self.key[j], self.value[j], cfg)
            x = loop_boundary(x, model.model.norm.weight, cfg, j)  # stage j of every slot: the same loop position
            new_rows.append((k, v))
            if j + 1 == cfg.exit_layer:
                exit_hidden = x
        exit_rows = exit_hidden if all_exits else exit_hidden[:1]
        exit_tokens = model.exit_head(exit_rows).argmax(-1)  # [P] or [1]
        final_logits = model.final_head(x[-1:])[0]  # [V]
        tokens = torch.cat((final_logits.argmax()[None], exit_tokens)).cpu().numpy()
        # New rows of valid slots only (bubbles never write), all stage layers in one indexed copy each:
        # the indexed target is [n, S, kvh, hd] (advanced indices first), hence the transpose.
        rows = torch.from_numpy(np.flatnonzero(valid)).to(self.device)
        for buffer, part in ((self.key, 0), (self.value, 1)):
            new = torch.stack([kv[part][:, :, 0] for kv in new_rows])  # [S, P, kvh, hd]
            buffer[:, rows, :, starts[rows]] = new[:, rows].transpose(0, 1)
        self.hidden_in = x[:-1]
        logits = final_logits.float().cpu().numpy() if want_logits else None
        return StepResult(int(tokens[0]), logits, tokens[1:])
