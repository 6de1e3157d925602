"""Tiny Parcae checkpoints in the published layout, and an independent oracle.

The layout is what the published code writes (sandyresearch/parcae, receval/models/parcae.py
save_pretrained): config.json = the ParcaeConfig dataclass's fields, pytorch_model.bin = the Parcae
module's state dict (transformer.* names, value_embeds.{i}, the tied lm_head stored too, the rotary
buffer freqs_cis). The oracle is written from parcae_lm/models/parcae/parcae.py and modules/{injection,
mixer,mlp,blocks}.py, reading the checkpoint's own names; it shares no code with speedc's model: its own
RMSNorm, rotary over ADJACENT pairs, a weightless q/k norm after it, full causal attention recomputed
for every new token, value embeddings where the module has both the table and the layer's gate.

    e = ln_prelude(prelude(wte(ids))); s = 0
    for r in range(R): s = exp(-dt exp(A_log)) * s + dt * (e B^T); s = core(s)      dt = softplus(dt_bias)
    logits = lm_head(ln_f(coda(C(s))))
    block: x = x + attn(norm_1 x); x = x + proj(0.5 relu(fc(norm_2 x))^2)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from oracle_ops import greedy, rms, rotate_adjacent

VOCAB, HIDDEN, HEADS, INTERMEDIATE, CONTEXT = 128, 64, 4, 128, 256
HEAD_DIM = HIDDEN // HEADS
EPS, ROPE_BASE = 1e-5, 50000.0
GATE_CHANNELS = 32
QK_EPS = torch.finfo(torch.float32).eps  # F.rms_norm(x, shape) with no eps, on the published fp32 activations


def _has_ve(index: int, count: int) -> bool:
    return index % 2 == (count - 1) % 2


def config(prelude: int, core: int, coda: int, recurrence: int, backprop_depth: int = 4, **extra) -> dict:
    """config.json as the published save_pretrained writes it: the ParcaeConfig dataclass's fields
    (after __post_init__: padded_vocab_size filled in), every option at the published model's value."""
    return {"name": "parcae-tiny", "hf_config": {}, "block_size": CONTEXT, "n_embd": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "vocab_size": VOCAB, "padding_multiple": 64, "padded_vocab_size": VOCAB,
            "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": int(ROPE_BASE)},
            "use_abacus": False, "randomize_positions_from": None, "block_class_name": "TransformerPreNormBlock",
            "norm_class_name": "RMSNorm", "attn_impl": "flash", "norm_eps": EPS, "mlp_class_name": "BaseMLP",
            "nonlin_name": "ReLU2", "bias": False, "qk_bias": False, "init_strategy": "scaled-zero",
            "init_orthogonal": True, "skip_initialization": False, "mup_model_scaling_factor": 1,
            "use_fused_head": "pytorch", "debias_attention": False, "center_attention": False, "clip_qkv": None,
            "qk_norm": True, "logit_softcap": None, "activation_checkpoint_impl": "per-iteration", "simple_ops": False,
            "strategy": "single", "injection_type": "diagonal", "n_layers_in_recurrent_block": core,
            "n_layers_in_prelude": prelude, "n_layers_in_coda": coda, "state_init": "like-init",
            "recurrent_embedding_dimension": HIDDEN, "recurrent_intermediation_embedding_dimension": INTERMEDIATE,
            "recurrent_num_attention_heads": None, "prelude_norm": True, "sampling_scheme": "poisson-truncated-full",
            "mean_recurrence": recurrence, "mean_backprop_depth": backprop_depth, "lockstep_n": False,
            "lockstep_k": False, "curriculum_target": "forward", "recurrent_iteration_method": "per-sequence",
            "tie_embeddings": True, "model_class_name": "Parcae", "_is_recurrent_block_config": False, **extra}


def write_checkpoint(directory: Path, *, seed: int, prelude: int = 2, core: int = 2, coda: int = 2, recurrence: int = 8,
                     layer_scale: float = 0.2, decay: float = math.sqrt(1 / 5), backprop_depth: int = 4,
                     weights_file: str = "pytorch_model.bin", **extra) -> Path:
    """Random weights in the published layout. DECAY sets dt_bias as the published init does (A_log = 0:
    decay = exp(-dt)); a small DECAY with a small LAYER_SCALE lets the state settle within one repeat
    (drafts hold), the published sqrt(1/5) with larger weights does not (drafts fail)."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    cfg = config(prelude, core, coda, recurrence, backprop_depth, **extra)

    def noise(*shape, scale=layer_scale):
        return scale * torch.randn(shape, generator=generator)

    def norm_weight():
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=generator)

    blocks = prelude + core + coda
    gate_layers = core * backprop_depth  # ParcaeConfig.n_layer
    tensors = {"transformer.wte.weight": noise(VOCAB, HIDDEN, scale=0.5)}
    groups = (("prelude", 0, prelude), ("core_block", prelude, core), ("coda", prelude + core * recurrence, coda))
    for group, first_id, count in groups:
        for i in range(count):
            p = f"transformer.{group}.{i}."
            tensors[p + "norm_1.weight"], tensors[p + "norm_2.weight"] = norm_weight(), norm_weight()
            for name in ("c_q", "c_k", "c_v"):
                tensors[p + f"attn.{name}.weight"] = noise(HIDDEN, HIDDEN, scale=0.3)
            tensors[p + "attn.c_proj.weight"] = noise(HIDDEN, HIDDEN)
            if _has_ve(first_id + i, gate_layers):
                tensors[p + "attn.ve_gate.weight"] = noise(HEADS, GATE_CHANNELS, scale=0.5)
            tensors[p + "mlp.fc.weight"] = noise(INTERMEDIATE, HIDDEN, scale=0.5)
            tensors[p + "mlp.proj.weight"] = noise(HIDDEN, INTERMEDIATE)
    dt = -math.log(decay)
    tensors["transformer.adapter.A_log"] = 0.1 * torch.randn(HIDDEN, generator=generator)
    tensors["transformer.adapter.dt_bias"] = dt + math.log(-math.expm1(-dt)) + 0.1 * torch.randn(HIDDEN, generator=generator)
    tensors["transformer.adapter.B"] = torch.eye(HIDDEN) + noise(HIDDEN, HIDDEN, scale=0.1)
    tensors["transformer.C.weight"] = torch.eye(HIDDEN) + noise(HIDDEN, HIDDEN, scale=0.1)
    tensors["transformer.ln_f.weight"] = norm_weight()
    tensors["transformer.ln_prelude.weight"] = norm_weight()
    for i in range(blocks):
        if _has_ve(i, blocks):
            tensors[f"value_embeds.{i}.weight"] = noise(VOCAB, HIDDEN, scale=0.5)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"]  # tied: the state dict holds both names
    tensors["freqs_cis"] = torch.zeros(1, CONTEXT, 1, HEAD_DIM // 2, 2)  # the persistent rotary buffer
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if weights_file.endswith(".safetensors"):
        from safetensors.torch import save_file

        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()
        save_file(tensors, str(directory / weights_file), metadata={"format": "pt"})
    else:
        torch.save(tensors, directory / weights_file)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def load_tensors(directory: Path) -> dict:
    if (directory / "pytorch_model.bin").exists():
        tensors = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file

        tensors = load_file(str(next(directory.glob("*.safetensors"))))
    return {name: t.double() for name, t in tensors.items()}


# ---- the oracle ----------------------------------------------------------------------------------
def _block(t: dict, prefix: str, x: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
    """One TransformerPreNormBlock over a whole sequence x [L, H]; VE [L, H]: this layer's value embedding."""
    length = x.shape[0]
    xn = rms(x, t[prefix + "norm_1.weight"], EPS)
    q = (xn @ t[prefix + "attn.c_q.weight"].T).reshape(length, HEADS, HEAD_DIM)
    k = (xn @ t[prefix + "attn.c_k.weight"].T).reshape(length, HEADS, HEAD_DIM)
    v = (xn @ t[prefix + "attn.c_v.weight"].T).reshape(length, HEADS, HEAD_DIM)
    if ve is not None and prefix + "attn.ve_gate.weight" in t:
        gate = 2 * torch.sigmoid(xn[:, :GATE_CHANNELS] @ t[prefix + "attn.ve_gate.weight"].T)  # [L, kvh]
        v = v + gate[..., None] * ve.reshape(length, HEADS, HEAD_DIM)
    positions = torch.arange(length)
    q, k = rotate_adjacent(q, positions, ROPE_BASE), rotate_adjacent(k, positions, ROPE_BASE)
    q, k = F.rms_norm(q, (HEAD_DIM,), eps=QK_EPS), F.rms_norm(k, (HEAD_DIM,), eps=QK_EPS)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    attended = torch.einsum("hqk,khd->qhd", weights, v).reshape(length, HIDDEN)
    x = x + attended @ t[prefix + "attn.c_proj.weight"].T
    hidden = F.relu(rms(x, t[prefix + "norm_2.weight"], EPS) @ t[prefix + "mlp.fc.weight"].T).pow(2) * 0.5
    return x + hidden @ t[prefix + "mlp.proj.weight"].T


def _value_embedding(t: dict, index: int, ids: torch.Tensor) -> torch.Tensor | None:
    table = t.get(f"value_embeds.{index}.weight")
    return None if table is None else table[ids]


def random_start(seed: int, position: int) -> torch.Tensor:
    """speedc's documented draw for --state-init random (its own three lines here): Philox keyed by
    (position, seed), standard normals, each beyond 3 redrawn from the same stream, times the published
    like-init scale sqrt(2 / (5 H))."""
    import numpy as np

    stream = np.random.Generator(np.random.Philox(key=np.array([position, seed], dtype=np.uint64)))
    z = stream.standard_normal(HIDDEN)
    while (np.abs(z) > 3).any():
        bad = np.flatnonzero(np.abs(z) > 3)
        z[bad] = stream.standard_normal(bad.size)
    return torch.from_numpy(z * math.sqrt(2 / (5 * HIDDEN))).float().double()


@torch.no_grad()
def oracle_logits(t: dict, cfg: dict, ids: list[int], recurrence: int | None = None, seed: int | None = None) -> torch.Tensor:
    """Logits [L, V] of every position of IDS (float64); SEED: the core starts from random_start, else zero."""
    recurrence = cfg["mean_recurrence"] if recurrence is None else recurrence
    prelude, core = cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"]
    tokens = torch.tensor(ids)
    e = t["transformer.wte.weight"][tokens]
    for i in range(prelude):
        e = _block(t, f"transformer.prelude.{i}.", e, _value_embedding(t, i, tokens))
    if cfg["prelude_norm"]:
        e = rms(e, t["transformer.ln_prelude.weight"], EPS)
    s = torch.zeros_like(e) if seed is None else torch.stack([random_start(seed, p) for p in range(len(ids))])
    dt = F.softplus(t["transformer.adapter.dt_bias"])
    decay = torch.exp(-dt * torch.exp(t["transformer.adapter.A_log"]))
    for _ in range(recurrence):
        s = s * decay + dt * (e @ t["transformer.adapter.B"].T)
        for i in range(core):
            s = _block(t, f"transformer.core_block.{i}.", s, _value_embedding(t, prelude + i, tokens))
    s = s @ t["transformer.C.weight"].T
    for i in range(cfg["n_layers_in_coda"]):
        s = _block(t, f"transformer.coda.{i}.", s, _value_embedding(t, prelude + core + i, tokens))
    return rms(s, t["transformer.ln_f.weight"], EPS) @ t["lm_head.weight"].T


def oracle_greedy(t: dict, cfg: dict, prompt: list[int], new_tokens: int, seed: int | None = None) -> list[int]:
    return greedy(lambda ids: oracle_logits(t, cfg, ids, seed=seed), prompt, new_tokens)
