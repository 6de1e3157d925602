"""Tiny random checkpoints in the layouts real looped models are published in (not a test file).

    write_ouro(dir)      ByteDance Ouro (OuroForCausalLM): one model.safetensors, bf16, four RMSNorms per
                         layer (input_layernorm, input_layernorm_2, post_attention_layernorm,
                         post_attention_layernorm_2), model.early_exit_gate.{weight [1, H], bias [1]},
                         untied lm_head; config.json bos = eos = pad = 0, generation_config.json eos 2.
    write_nanbeige(dir)  Nanbeige4.2 (NanbeigeForCausalLM): plain Llama tensor names, bf16, TWO shards +
                         model.safetensors.index.json (weight_map); head_dim * heads != hidden (q projects
                         hidden -> heads * head_dim, as in the real 3072 -> 48 x 128 model); every optional
                         flag present with its off value.

Names, config keys and values follow /work/shared_notes/looped_spec.md (the published code), only the
sizes are tiny. Weights are normal(0, 0.15) for matrices and 1 + 0.1 * noise for norms, so logits are
far from uniform.

`residual_scale` shrinks what each sublayer adds to the residual stream, so a state after one loop
already predicts what the last loop does (speculation gets accepted). In a Llama block that is o_proj
and down_proj; in Ouro's sandwich block the sublayer output is RMS-normed before the add, so scaling
o_proj/down_proj would be normalised away: there the post-sublayer norms (input_layernorm_2,
post_attention_layernorm_2) carry the scale. `perturb` rescales the same tensors of an existing
checkpoint in place (shards and dtypes kept), to make speculation mispredict often.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

OURO_WEIGHTS = "model.safetensors"
NANBEIGE_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
OURO_CONFIG_EOS, OURO_GENERATION_EOS = 0, 2
MATRIX_STD = 0.15

# Tensors whose scale sets how much each sublayer adds to the residual stream.
LLAMA_RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
SANDWICH_RESIDUAL_OUTPUTS = ("input_layernorm_2.weight", "post_attention_layernorm_2.weight")

NANBEIGE_OPTIONAL_FLAGS = {  # configuration_nanbeige.py defaults (spec 2.1): all off
    "qk_layernorm": False, "mlp_bias": False, "emb_neighbor_num": None, "emb_split_num": None,
    "ngram_vocab_size_ratio": None, "ngram_embedding_hidden_size": None, "ngram_fused_mode": "average",
    "ngram_compressed_tokenizer": False, "insert_ngram_layer_idx": None, "ngram_insert_all_layers": False,
    "ngram_layer_downproject_size": None, "skip_ngram_for_input": False, "emb_tp_num": None,
    "enable_double_loop_split": False, "loop_middle_layers": None, "loop_share_kv": False,
    "mhc_diff_for_loop": False, "mhc_double_stream_position_for_loop": None, "enable_hyper_connection": False,
    "enable_mhc": False, "enable_h_res_identity": False, "mhc_identity_nohresparam": False,
    "num_residual_streams": 4, "mhc_sinkhorn_iterations": 20, "mhc_init_gating_factor": 0.01,
    "enable_depth_attention": False, "depth_attention_stride": None, "depth_attention_recent_window": 0,
    "depth_attention_static_anchor_once": True,
}


class _Random:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def matrix(self, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * MATRIX_STD * torch.randn(rows, cols, generator=self.gen)).to(torch.bfloat16)

    def norm(self, size: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * (1.0 + 0.1 * torch.randn(size, generator=self.gen))).to(torch.bfloat16)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def llama_shards(rnd: "_Random", *, layers: int, vocab: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, branch_scale: float, per_layer=None) -> tuple[dict, dict]:
    """An untied Llama stack's tensors in two shards (the embedding and the first half of the layers, the rest
    with the final norm and lm_head), drawn in that order; PER_LAYER(i) -> the tensors layer i adds beside
    its own (drawn right after them, in the second shard)."""
    first = {"model.embed_tokens.weight": rnd.matrix(vocab, hidden)}
    second: dict[str, torch.Tensor] = {}
    for i in range(layers):
        shard = first if i < (layers + 1) // 2 else second
        shard.update(_llama_layer(rnd, f"model.layers.{i}", hidden=hidden, heads=heads, kv_heads=kv_heads,
                                  head_dim=head_dim, intermediate=intermediate, branch_scale=branch_scale))
        if per_layer is not None:
            second.update(per_layer(i))
    second["model.norm.weight"] = rnd.norm(hidden)
    second["lm_head.weight"] = rnd.matrix(vocab, hidden)
    return first, second


def write_two_shards(directory: Path, first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    """Two safetensors shards and their index (the layout Nanbeige and IQuest-Coder-V1-Loop ship)."""
    weight_map = {}
    for name, tensors in zip(NANBEIGE_SHARDS, (first, second)):
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.numel() * t.element_size() for t in (*first.values(), *second.values()))
    _write_json(directory / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _llama_layer(rnd: _Random, prefix: str, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, branch_scale: float) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.self_attn.q_proj.weight": rnd.matrix(heads * head_dim, hidden),
        f"{prefix}.self_attn.k_proj.weight": rnd.matrix(kv_heads * head_dim, hidden),
        f"{prefix}.self_attn.v_proj.weight": rnd.matrix(kv_heads * head_dim, hidden),
        f"{prefix}.self_attn.o_proj.weight": rnd.matrix(hidden, heads * head_dim, branch_scale),
        f"{prefix}.mlp.gate_proj.weight": rnd.matrix(intermediate, hidden),
        f"{prefix}.mlp.up_proj.weight": rnd.matrix(intermediate, hidden),
        f"{prefix}.mlp.down_proj.weight": rnd.matrix(hidden, intermediate, branch_scale),
        f"{prefix}.input_layernorm.weight": rnd.norm(hidden),
        f"{prefix}.post_attention_layernorm.weight": rnd.norm(hidden),
    }


def write_ouro(directory, *, layers: int = 3, loops: int = 4, hidden: int = 64, heads: int = 4, head_dim: int = 16,
               intermediate: int = 96, vocab: int = 128, seed: int = 0, residual_scale: float = 1.0,
               extra_config: dict | None = None, max_positions: int = 512) -> Path:
    """An Ouro checkpoint (config.json, generation_config.json, one bf16 model.safetensors)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rnd = _Random(seed)
    tensors = {"model.embed_tokens.weight": rnd.matrix(vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        layer = _llama_layer(rnd, prefix, hidden=hidden, heads=heads, kv_heads=heads, head_dim=head_dim,
                             intermediate=intermediate, branch_scale=1.0)
        layer[f"{prefix}.input_layernorm_2.weight"] = rnd.norm(hidden, residual_scale)
        layer[f"{prefix}.post_attention_layernorm_2.weight"] = rnd.norm(hidden, residual_scale)
        tensors.update(layer)
    tensors["model.norm.weight"] = rnd.norm(hidden)
    tensors["model.early_exit_gate.weight"] = rnd.matrix(1, hidden)
    tensors["model.early_exit_gate.bias"] = (0.1 * torch.randn(1, generator=rnd.gen)).to(torch.bfloat16)
    tensors["lm_head.weight"] = rnd.matrix(vocab, hidden)
    save_file(tensors, str(directory / OURO_WEIGHTS), metadata={"format": "pt"})
    config = {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModel": "modeling_ouro.OuroModel",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "model_type": "ouro",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "total_ut_steps": loops,
        "early_exit_threshold": 1.0,
        "bos_token_id": 0,
        "eos_token_id": OURO_CONFIG_EOS,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.1",
        "use_cache": True,
        **(extra_config or {}),
    }
    _write_json(directory / "config.json", config)
    # config.json says eos 0 (<|endoftext|>), but a ChatML turn ends with <|im_end|> = 2.
    _write_json(directory / "generation_config.json", {"_from_model_config": False, "bos_token_id": 0,
                                                       "eos_token_id": OURO_GENERATION_EOS, "pad_token_id": 0,
                                                       "transformers_version": "4.54.1"})
    return directory


def nanbeige_token_ids(vocab: int) -> tuple[int, int]:
    """(bos, eos): the real model's <|im_start|> / <|im_end|> are the ids just past its text vocabulary."""
    return vocab - 2, vocab - 1


def write_nanbeige(directory, *, layers: int = 3, loops: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   head_dim: int = 32, intermediate: int = 96, vocab: int = 128, seed: int = 0,
                   skip_loop_final_norm: bool = False, residual_scale: float = 1.0, extra_config: dict | None = None,
                   max_positions: int = 512) -> Path:
    """A Nanbeige4.2 checkpoint (config.json, generation_config.json, two bf16 shards + index)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    first, second = llama_shards(_Random(seed), layers=layers, vocab=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                 head_dim=head_dim, intermediate=intermediate, branch_scale=residual_scale)
    write_two_shards(directory, first, second)
    bos, eos = nanbeige_token_ids(vocab)
    config = {
        "architectures": ["NanbeigeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_nanbeige.NanbeigeConfig",
                     "AutoModel": "modeling_nanbeige.NanbeigeModel",
                     "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM"},
        "model_type": "nanbeige",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": 0,
        "head_dim": head_dim,
        "kv_channels": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_loops": loops,
        "loop_loss_weights": [],
        "skip_loop_final_norm": skip_loop_final_norm,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 70000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.47.1",
        "use_cache": True,
        "vocab_size": vocab,
        **NANBEIGE_OPTIONAL_FLAGS,
        **(extra_config or {}),
    }
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": 0,
                                                       "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                                       "top_k": 20, "transformers_version": "4.47.1"})
    return directory


# ---- reading and rewriting the files ---------------------------------------------------------------------
def weight_files(directory) -> list[Path]:
    """The safetensors files of a checkpoint (the shards its index names, else every *.safetensors)."""
    directory = Path(directory)
    if (directory / INDEX).exists():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    return sorted(directory.glob("*.safetensors"))


def read_tensors(directory, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by its published name (converted to DTYPE unless None)."""
    out = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                out[name] = tensor if dtype is None else tensor.to(dtype)
    return out


def rewrite_tensors(directory, change) -> None:
    """Apply CHANGE(name, tensor) -> tensor (or None to drop it) to every tensor, each file rewritten in
    place with its metadata; the index is left as it was (so a test can make it lie)."""
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        changed = {}
        for name, tensor in tensors.items():
            new = change(name, tensor)
            if new is not None:
                changed[name] = new.contiguous()
        save_file(changed, str(path), metadata=metadata)


def residual_output_names(directory) -> tuple[str, ...]:
    """Which per-layer tensors set the size of each sublayer's contribution (see the module docstring)."""
    sandwich = any(name.endswith("input_layernorm_2.weight") for name in read_tensors(directory, dtype=None))
    return SANDWICH_RESIDUAL_OUTPUTS if sandwich else LLAMA_RESIDUAL_OUTPUTS


def perturb(directory, *, factor: float = 8.0) -> Path:
    """Multiply every sublayer's residual contribution by FACTOR, in place: with FACTOR > 1 the loops
    change the state more, so the draft after loop 1 disagrees with the last loop more often."""
    suffixes = residual_output_names(directory)

    def scale(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.float() * factor).to(tensor.dtype) if name.endswith(suffixes) else tensor

    rewrite_tensors(directory, scale)
    return Path(directory)


def write_sparse_safetensors(path, name: str, shape: list[int], dtype: str = "BF16") -> Path:
    """A safetensors file whose header declares one tensor of SHAPE, its data a hole (sparse file): the
    declared size costs no disk, and reading the data would take as long as the size says."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
    size = itemsize
    for dim in shape:
        size *= dim
    header = json.dumps({"__metadata__": {"format": "pt"},
                         name: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)  # safetensors pads the header to 8 bytes
    path = Path(path)
    with open(path, "wb") as handle:
        handle.write(len(header).to_bytes(8, "little"))
        handle.write(header)
    os.truncate(path, 8 + len(header) + size)
    return path


@torch.no_grad()
def hf_greedy(oracle, prompt: list[int], new_tokens: int) -> list[int]:
    """NEW_TOKENS greedy ids of a transformers causal LM (ORACLE) after PROMPT, recomputed from scratch each token."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(oracle(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def seeded_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """LENGTH ids in [3, VOCAB) drawn with SEED (ids 0-2 are the special tokens of these checkpoints)."""
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def batch_plain_and_speed(engine, prompts: list[list[int]], new_tokens: int, max_batch: int = 3):
    """Greedy results of PROMPTS decoded together plainly, and speculating at every step (per_sequence=False:
    the speculation counts a test asserts then do not follow this host's step timings)."""
    plain = engine.generate_batch(prompts, max_new_tokens=new_tokens, stop_at_eos=False, row_budget=0, max_batch=max_batch)
    speed = engine.generate_batch(prompts, max_new_tokens=new_tokens, stop_at_eos=False, max_batch=max_batch,
                                  row_budget=None, per_sequence=False)
    return plain, speed


def assert_batch_lossless(engine, prompts: list[list[int]], expected: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """PROMPTS decode to EXPECTED plainly and speculating in a batch, the first alone too (one sequence: the same
    runtime), and seeded sampling draws the same ids with and without speculation. Returns the speculating batch's
    (accepted, mispredicted) drafts, for the caller to say which paths its weights must cover."""
    plain, speed = batch_plain_and_speed(engine, prompts, new_tokens)
    assert [r.ids for r in plain] == expected
    assert {r.stats.mode for r in speed} == {"batch speed"}
    assert [r.ids for r in speed] == expected
    alone = engine.generate(prompts[0], max_new_tokens=new_tokens, stop_at_eos=False)
    assert alone.ids == expected[0]
    settings = [{"temperature": 0.9, "top_p": 0.95, "seed": s} for s in (11, 12, 13)][:len(prompts)]
    runs = [engine.generate_batch(prompts, max_new_tokens=new_tokens, stop_at_eos=False, settings=settings, max_batch=3,
                                  **extra) for extra in ({}, {"row_budget": 0})]
    assert [r.ids for r in runs[0]] == [r.ids for r in runs[1]]
    return sum(r.stats.accepted for r in speed), sum(r.stats.mispredicted for r in speed)

