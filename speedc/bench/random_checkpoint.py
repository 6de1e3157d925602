"""Random-weight checkpoints at the looped models' real shapes, in their published layouts, written
a row block at a time (a 2.8 GB Ouro-1.4B-shaped checkpoint needs about 100 MB of memory to write).

    write_random_checkpoint(SHAPES["ouro-1.4b"], 24, DIR)
      DIR/config.json                       OuroForCausalLM / NanbeigeForCausalLM keys
      DIR/generation_config.json
      DIR/model-0000k-of-0000n.safetensors  bf16 shards of at most SHARD_BYTES
      DIR/model.safetensors.index.json      (when there is more than one shard)

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte range; padded to 8 bytes) and the tensors' bytes in header order, which is what lets the header
be written first and the bytes streamed after it.

Huginn's shape (RavenForCausalLM) is written in its own layout: transformer.prelude / core_block / coda
blocks with fused Wqkv and fc, qk_bias, the adapter (its state half near the identity), ln_f; its
proj weights carry RESIDUAL_SCALE. Parcae's shape is written as its published save_pretrained writes
it (config.json = its config dataclass's keys): transformer.* blocks with c_q / c_k / c_v / c_proj,
ve_gate, fc / proj, the diagonal injection (A_log, dt_bias, B near the identity), the readout
projection C (near the identity), ln_prelude, ln_f, value_embeds.{i}; its c_proj and proj carry
RESIDUAL_SCALE (as safetensors, which its loader also reads).

IQuest-Coder-V1-Loop's shape (IQuestLoopCoderForCausalLM) is Llama's layout plus
model.gate_projections.{i}.{weight [heads, head_dim], bias [heads]} (its loop-1 gates, bias 1).

Values: matrices N(0, 0.02), norms 1. RESIDUAL_SCALE < 1 shrinks what each block adds to the residual
stream so the state after loop 1 predicts what the last loop does (speculation gets accepted, as in a
trained looped model): o_proj and down_proj in a Llama block; in Ouro's sandwich block the sublayer
output is RMS-normed before the add, so the post-sublayer norms carry the scale there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

SHARD_BYTES = 2_000_000_000
MATRIX_STD = 0.02
BLOCK_BYTES = 32 << 20
SCALED_LLAMA = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
SCALED_SANDWICH = ("input_layernorm_2.weight", "post_attention_layernorm_2.weight")
SCALED_HUGINN = ("attn.proj.weight", "mlp.proj.weight", "adapter.weight")  # what each block and repeat adds
HUGINN_ADAPTER = "transformer.adapter.weight"  # [I | noise] (see _values): each repeat keeps the state's direction
SCALED_PARCAE = ("attn.c_proj.weight", "mlp.proj.weight")
NEAR_IDENTITY = (HUGINN_ADAPTER, "transformer.adapter.B", "transformer.C.weight")  # [I + noise] or [I | noise]
PARCAE_BACKPROP_DEPTH = 4  # the published configs' mean_backprop_depth (which layers' ve_gate exists)


def huginn_layout(shape, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Huginn's published layout: SHAPE's prelude and coda blocks around LAYERS core blocks, the lm_head
    tied to the embedding (not stored: the loader accepts either)."""
    h, hd, i = shape.hidden, shape.head_dim, shape.intermediate
    out = [("transformer.wte.weight", (shape.vocab, h))]
    for group, count in (("prelude", shape.prelude), ("core_block", layers), ("coda", shape.coda)):
        for index in range(count):
            p = f"transformer.{group}.{index}"
            out += [(f"{p}.attn.Wqkv.weight", (3 * shape.heads * hd, h)), (f"{p}.attn.qk_bias", (2, 1, shape.heads, hd)),
                    (f"{p}.attn.proj.weight", (h, shape.heads * hd)), (f"{p}.mlp.fc.weight", (2 * i, h)),
                    (f"{p}.mlp.proj.weight", (h, i))]
            out += [(f"{p}.norm_{n}.weight", (h,)) for n in (1, 2, 3, 4)]
    return out + [("transformer.adapter.weight", (h, 2 * h)), ("transformer.ln_f.weight", (h,))]


def parcae_layout(shape, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parcae's published layout: SHAPE's prelude and coda blocks around LAYERS core blocks, value
    embeddings and ve_gates where its construction puts them, the lm_head tied (not stored)."""
    from speedc.models.families.parcae import has_ve

    h, hd, i, kv = shape.hidden, shape.head_dim, shape.intermediate, shape.kv_heads * shape.head_dim
    blocks, gate_layers = shape.prelude + layers + shape.coda, layers * PARCAE_BACKPROP_DEPTH
    out = [("transformer.wte.weight", (shape.vocab, h))]
    groups = (("prelude", 0, shape.prelude), ("core_block", shape.prelude, layers),
              ("coda", shape.prelude + layers * shape.loops, shape.coda))  # (group, its first layer_id, count)
    for group, first_id, count in groups:
        for index in range(count):
            p = f"transformer.{group}.{index}"
            out += [(f"{p}.norm_1.weight", (h,)), (f"{p}.attn.c_q.weight", (shape.heads * hd, h)),
                    (f"{p}.attn.c_k.weight", (kv, h)), (f"{p}.attn.c_v.weight", (kv, h)),
                    (f"{p}.attn.c_proj.weight", (h, shape.heads * hd))]
            if has_ve(first_id + index, gate_layers):
                out.append((f"{p}.attn.ve_gate.weight", (shape.kv_heads, 32)))
            out += [(f"{p}.norm_2.weight", (h,)), (f"{p}.mlp.fc.weight", (i, h)), (f"{p}.mlp.proj.weight", (h, i))]
    out += [("transformer.adapter.A_log", (h,)), ("transformer.adapter.dt_bias", (h,)), ("transformer.adapter.B", (h, h)),
            ("transformer.C.weight", (h, h)), ("transformer.ln_f.weight", (h,)), ("transformer.ln_prelude.weight", (h,))]
    return out + [(f"value_embeds.{b}.weight", (shape.vocab, kv)) for b in range(blocks) if has_ve(b, blocks)]


def parcae_config(shape, layers: int, max_positions: int) -> dict:
    """Parcae's config.json: its config dataclass's keys at the published large model's values."""
    return {"name": shape.name, "block_size": max_positions, "n_embd": shape.hidden, "intermediate_size": shape.intermediate,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
            "padding_multiple": 64, "padded_vocab_size": shape.vocab,
            "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000},
            "block_class_name": "TransformerPreNormBlock", "norm_class_name": "RMSNorm", "norm_eps": 1e-5,
            "mlp_class_name": "BaseMLP", "nonlin_name": "ReLU2", "bias": False, "qk_bias": False, "qk_norm": True,
            "clip_qkv": None, "logit_softcap": None, "init_strategy": "scaled-zero", "mup_model_scaling_factor": 1,
            "injection_type": "diagonal", "n_layers_in_recurrent_block": layers, "n_layers_in_prelude": shape.prelude,
            "n_layers_in_coda": shape.coda, "state_init": "like-init", "recurrent_embedding_dimension": shape.hidden,
            "recurrent_intermediation_embedding_dimension": shape.intermediate, "recurrent_num_attention_heads": None,
            "prelude_norm": True, "mean_recurrence": shape.loops, "mean_backprop_depth": PARCAE_BACKPROP_DEPTH,
            "tie_embeddings": True, "model_class_name": "Parcae", "bos_token_id": 1, "eos_token_id": 2}


def tensor_layout(shape, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of SHAPE's family layout with LAYERS layers, in file order."""
    if shape.recurrent:
        return parcae_layout(shape, layers) if shape.family == "parcae" else huginn_layout(shape, layers)
    h, hd, i = shape.hidden, shape.head_dim, shape.intermediate
    out = [("model.embed_tokens.weight", (shape.vocab, h))]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [(f"{p}.self_attn.q_proj.weight", (shape.heads * hd, h)),
                (f"{p}.self_attn.k_proj.weight", (shape.kv_heads * hd, h)),
                (f"{p}.self_attn.v_proj.weight", (shape.kv_heads * hd, h)),
                (f"{p}.self_attn.o_proj.weight", (h, shape.heads * hd)),
                (f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                (f"{p}.mlp.down_proj.weight", (h, i)),
                (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        if shape.sandwich_norms:
            out += [(f"{p}.input_layernorm_2.weight", (h,)), (f"{p}.post_attention_layernorm_2.weight", (h,))]
    if shape.cross_window:  # IQuest: each layer's loop-1 gate
        for layer in range(layers):
            out += [(f"model.gate_projections.{layer}.weight", (shape.heads, hd)),
                    (f"model.gate_projections.{layer}.bias", (shape.heads,))]
    out.append(("model.norm.weight", (h,)))
    if shape.sandwich_norms:  # Ouro's per-token exit gate: read and ignored by the build
        out += [("model.early_exit_gate.weight", (1, h)), ("model.early_exit_gate.bias", (1,))]
    if not shape.tied:
        out.append(("lm_head.weight", (shape.vocab, h)))
    return out


def family_config(shape, layers: int, max_positions: int) -> dict:
    """config.json of SHAPE's family (the keys speedc's family readers and the published code use)."""
    if shape.recurrent and shape.family == "parcae":
        return parcae_config(shape, layers, max_positions)
    if shape.recurrent:
        return {"architectures": ["RavenForCausalLM"], "model_type": "huginn_raven", "n_embd": shape.hidden,
                "n_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "n_layers_in_prelude": shape.prelude,
                "n_layers_in_recurrent_block": layers, "n_layers_in_coda": shape.coda, "mean_recurrence": shape.loops,
                "intermediate_size": shape.intermediate, "vocab_size": shape.vocab, "padded_vocab_size": shape.vocab,
                "block_size": max_positions, "rope_base": 50000, "norm_eps": 1e-6, "qk_bias": True,
                "tie_embeddings": True, "bias": False, "injection_type": "linear", "state_init": "like-init",
                "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    common = {"hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
              "hidden_act": "silu", "vocab_size": shape.vocab, "max_position_embeddings": max_positions,
              "tie_word_embeddings": shape.tied, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if shape.cross_window:
        return {"architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder", "rope_theta": 500000.0,
                "rms_norm_eps": 1e-5, "loop_num": shape.loops, "loop_window_size": shape.cross_window,
                "attention_bias": False, "mlp_bias": False, **common}
    if shape.sandwich_norms:
        return {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6, "total_ut_steps": shape.loops, **common}
    return {"architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige", "rope_theta": 70000000,
            "rms_norm_eps": 1e-5, "num_loops": shape.loops, "loop_loss_weights": [], "skip_loop_final_norm": False,
            **common}


def _shards(layout: list[tuple[str, tuple[int, ...]]], limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards, current, size = [], [], 0
    for name, dims in layout:
        nbytes = 2 * math.prod(dims)
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, dims))
        size += nbytes
    return shards + [current]


def _values(rng: np.random.Generator, name: str, dims: tuple[int, ...], scaled: tuple[str, ...], scale: float):
    """Row blocks of tensor NAME as bfloat16."""
    import ml_dtypes

    if name.endswith("qk_bias"):  # [2, 1, heads, hd]: small, the rotary still sees the projections
        yield (0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        return
    if len(dims) == 1 or name.endswith("early_exit_gate.bias"):
        norm = scale if name.endswith(scaled) else 1.0
        yield np.full(dims, norm, dtype=ml_dtypes.bfloat16)
        return
    std = MATRIX_STD * (scale if name.endswith(scaled) else 1.0)
    rows = max(1, BLOCK_BYTES // (4 * dims[1]))
    for first in range(0, dims[0], rows):
        block = rng.standard_normal((min(rows, dims[0] - first), dims[1]), dtype=np.float32)
        block *= std
        if name in NEAR_IDENTITY:  # the state's half near the identity: a repeat refines, it does not scramble
            block[np.arange(block.shape[0]), first + np.arange(block.shape[0])] += 1.0
        yield block.astype(ml_dtypes.bfloat16)


def write_random_checkpoint(shape, layers: int, directory: Path, *, residual_scale: float = 1.0, seed: int = 0,
                            max_positions: int = 4096, shard_bytes: int = SHARD_BYTES,
                            progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a bf16 checkpoint of SHAPE (speedc.bench.synthetic.Shape, a looped family) with LAYERS layers."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layout = tensor_layout(shape, layers)
    shards = _shards(layout, shard_bytes)
    total = sum(2 * math.prod(dims) for _, dims in layout)
    rng = np.random.default_rng(seed)
    scaled = (SCALED_PARCAE if shape.family == "parcae" else SCALED_HUGINN) if shape.recurrent else \
        SCALED_SANDWICH if shape.sandwich_norms else SCALED_LLAMA
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    done = 0
    for file_name, tensors in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dims in tensors:
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + 2 * math.prod(dims)]}
            offset += 2 * math.prod(dims)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / file_name, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little"))
            out.write(encoded)
            for name, dims in tensors:
                for block in _values(rng, name, dims, scaled, residual_scale):
                    out.write(block.tobytes())
                    done += block.nbytes
                    if progress:
                        progress(done, total)
    if len(shards) > 1:
        weight_map = {name: file_name for file_name, tensors in zip(names, shards) for name, _ in tensors}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (directory / "config.json").write_text(json.dumps(family_config(shape, layers, max_positions), indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return directory
