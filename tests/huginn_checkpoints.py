"""Tiny Huginn-0125 (RavenForCausalLM) checkpoints in the published layout, and an independent oracle.

The oracle is written from the published description of the architecture (seal-rg/recurrent-pretraining,
recpre/raven_modeling_minimal.py), reading the checkpoint's own tensor names and fused layouts; it
shares no code with speedc's model: its own RMSNorm, its own rotary over ADJACENT pairs, full causal
attention over the whole sequence, recomputed for every new token.

    e = prelude(wte(ids) * sqrt(n_embd)); s = 0
    for r in range(R): s = core(adapter(cat[s, e]))
    logits = lm_head(ln_f(coda(ln_f(s))))
    block: x = norm_2(x + attn(norm_1 x)); x = norm_4(x + mlp(norm_3 x))
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from oracle_ops import greedy, rms, rotate_adjacent

VOCAB, HIDDEN, HEADS, INTERMEDIATE, CONTEXT = 96, 64, 4, 96, 256
HEAD_DIM = HIDDEN // HEADS
EPS, ROPE_BASE = 1e-6, 50000.0


def config(prelude: int, core: int, coda: int, recurrence: int, **extra) -> dict:
    """config.json as the published checkpoint writes it (its own field names)."""
    return {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "n_embd": HIDDEN, "n_heads": HEADS,
            "num_key_value_heads": HEADS, "n_layers": prelude + core + coda, "n_layers_in_prelude": prelude,
            "n_layers_in_recurrent_block": core, "n_layers_in_coda": coda, "mean_recurrence": recurrence,
            "mean_backprop_depth": 2, "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB, "padded_vocab_size": VOCAB,
            "block_size": CONTEXT, "rope_base": ROPE_BASE, "norm_eps": EPS, "qk_bias": True, "tie_embeddings": True,
            "bias": False, "injection_type": "linear", "state_init": "like-init", "block_class_name": "SandwichBlock",
            "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU",
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", **extra}


def write_checkpoint(directory: Path, *, seed: int, prelude: int = 1, core: int = 2, coda: int = 1, recurrence: int = 4,
                     layer_scale: float = 0.2, adapter_identity: float = 0.0, dtype: torch.dtype = torch.float32,
                     shards: int = 1) -> Path:
    """Random weights in the published layout (transformer.prelude / core_block / coda, Wqkv, qk_bias,
    fc, adapter, ln_f, the tied lm_head stored too, the rotary buffer freqs_cis). ADAPTER_IDENTITY > 0
    adds that multiple of [I | 0] to the adapter (with a small LAYER_SCALE: the state settles, drafts hold)."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)

    def noise(*shape, scale=layer_scale):
        return scale * torch.randn(shape, generator=generator)

    def norm_weight():
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=generator)

    tensors = {"transformer.wte.weight": noise(VOCAB, HIDDEN, scale=0.5)}
    groups = (("prelude", prelude), ("core_block", core), ("coda", coda))
    for group, count in groups:
        for i in range(count):
            p = f"transformer.{group}.{i}."
            tensors.update({p + f"norm_{n}.weight": norm_weight() for n in (1, 2, 3, 4)})
            tensors[p + "attn.Wqkv.weight"] = noise(3 * HIDDEN, HIDDEN)
            tensors[p + "attn.qk_bias"] = noise(2, 1, HEADS, HEAD_DIM, scale=0.3)
            tensors[p + "attn.proj.weight"] = noise(HIDDEN, HIDDEN)
            tensors[p + "mlp.fc.weight"] = noise(2 * INTERMEDIATE, HIDDEN)
            tensors[p + "mlp.proj.weight"] = noise(HIDDEN, INTERMEDIATE)
    adapter = noise(HIDDEN, 2 * HIDDEN, scale=0.15)
    adapter[:, :HIDDEN] += adapter_identity * torch.eye(HIDDEN)
    tensors["transformer.adapter.weight"] = adapter
    tensors["transformer.ln_f.weight"] = norm_weight()
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()  # tied, and stored (as the upload does)
    tensors["freqs_cis"] = torch.zeros(1, CONTEXT, 1, HEAD_DIM // 2, 2)  # the persistent rotary buffer
    tensors = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for shard in range(shards):
            file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[shard::shards]}
            save_file(part, str(directory / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config(prelude, core, coda, recurrence)))
    return directory


# ---- the oracle ----------------------------------------------------------------------------------
def _block(t: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """One SandwichBlock over a whole sequence x [L, H] (causal attention within it)."""
    length = x.shape[0]
    q, k, v = (rms(x, t[prefix + "norm_1.weight"], EPS) @ t[prefix + "attn.Wqkv.weight"].T).split(HIDDEN, dim=-1)
    bias = t[prefix + "attn.qk_bias"]  # [2, 1, heads, hd]
    q = q.reshape(length, HEADS, HEAD_DIM) + bias[0]
    k = k.reshape(length, HEADS, HEAD_DIM) + bias[1]
    positions = torch.arange(length)
    q, k = rotate_adjacent(q, positions, ROPE_BASE), rotate_adjacent(k, positions, ROPE_BASE)
    v = v.double().reshape(length, HEADS, HEAD_DIM)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    attended = torch.einsum("hqk,khd->qhd", weights, v).reshape(length, HIDDEN)
    x = rms(x + attended @ t[prefix + "attn.proj.weight"].double().T, t[prefix + "norm_2.weight"], EPS)
    gate, up = (rms(x, t[prefix + "norm_3.weight"], EPS) @ t[prefix + "mlp.fc.weight"].double().T).chunk(2, dim=-1)
    mlp = (torch.nn.functional.silu(gate) * up) @ t[prefix + "mlp.proj.weight"].double().T
    return rms(x + mlp, t[prefix + "norm_4.weight"], EPS)


def load_tensors(directory: Path) -> dict:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return {name: t.double() for name, t in tensors.items()}


def random_start(seed: int, position: int) -> torch.Tensor:
    """speedc's documented draw for --state-init random (its own three lines here): Philox keyed by
    (position, seed), standard normals, each beyond 3 redrawn from the same stream, times the published
    scale sqrt(2 / (5 H)) * sqrt(H)."""
    import numpy as np

    stream = np.random.Generator(np.random.Philox(key=np.array([position, seed], dtype=np.uint64)))
    z = stream.standard_normal(HIDDEN)
    while (np.abs(z) > 3).any():
        bad = np.flatnonzero(np.abs(z) > 3)
        z[bad] = stream.standard_normal(bad.size)
    return torch.from_numpy(z * math.sqrt(2 / (5 * HIDDEN)) * math.sqrt(HIDDEN)).float().double()


@torch.no_grad()
def oracle_logits(t: dict, cfg: dict, ids: list[int], recurrence: int | None = None, seed: int | None = None) -> torch.Tensor:
    """Logits [L, V] of every position of IDS (float64); SEED: the core starts from random_start, else zero."""
    recurrence = cfg["mean_recurrence"] if recurrence is None else recurrence
    e = t["transformer.wte.weight"][torch.tensor(ids)] * math.sqrt(HIDDEN)
    for i in range(cfg["n_layers_in_prelude"]):
        e = _block(t, f"transformer.prelude.{i}.", e)
    s = torch.zeros_like(e) if seed is None else torch.stack([random_start(seed, p) for p in range(len(ids))])
    for _ in range(recurrence):
        s = torch.cat((s, e), dim=-1) @ t["transformer.adapter.weight"].T
        for i in range(cfg["n_layers_in_recurrent_block"]):
            s = _block(t, f"transformer.core_block.{i}.", s)
    s = rms(s, t["transformer.ln_f.weight"], EPS)
    for i in range(cfg["n_layers_in_coda"]):
        s = _block(t, f"transformer.coda.{i}.", s)
    return rms(s, t["transformer.ln_f.weight"], EPS) @ t["lm_head.weight"].T


def oracle_greedy(t: dict, cfg: dict, prompt: list[int], new_tokens: int, seed: int | None = None) -> list[int]:
    return greedy(lambda ids: oracle_logits(t, cfg, ids, seed=seed), prompt, new_tokens)
