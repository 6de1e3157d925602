"""A tiny random IQuest-Coder-V1-Loop checkpoint in its published layout, and an oracle of its forward pass
written from the published modeling code (vLLM / SGLang iquest_loopcoder.py, mlx-lm iquestloopcoder.py),
plain torch, sharing nothing with speedc's model code (not a test file).

    write_iquest(dir)   config.json (IQuestLoopCoderForCausalLM / iquestloopcoder, loop_num 2,
                        loop_window_size), generation_config.json, two bf16 shards + index: Llama tensor
                        names model.layers.{i}.*, model.gate_projections.{i}.{weight [heads, head_dim], bias
                        [heads]}, model.norm, untied lm_head
    IQuestOracle        the published forward over a whole sequence (recomputed per token)

The published forward: the L layers run twice with no norm between. Loop 0 is a Llama layer; in loop 1
layer i computes q, k, v from its input as usual (rotary on q and k), then

    global = softmax causal attention of q over loop 0's k / v of layer i        (all earlier positions)
    local  = softmax attention of q over loop 1's own k / v of layer i, keys j with i - W < j <= i
    g      = sigmoid(q_h . w_h + b_h) per head h (w, b: gate_projections.{i}; q after rotary)
    attn   = o_proj(g * global + (1 - g) * local)

then model.norm and lm_head. `residual_scale` shrinks o_proj and down_proj so the state after loop 0
already predicts loop 1 (speculation accepted); the gates (weights 2x the others' scale, biases around 0) mix
both reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from looped_checkpoints import NANBEIGE_SHARDS as SHARDS, _Random, _write_json, llama_shards, write_two_shards
from oracle_ops import greedy

BOS, EOS = 1, 2


def config_data(*, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, window: int) -> dict:
    """config.json as the published checkpoint ships it, only the sizes tiny."""
    return {
        "architectures": ["IQuestLoopCoderForCausalLM"],
        "model_type": "iquestloopcoder",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "loop_num": 2,
        "loop_window_size": window,
        "max_position_embeddings": 256,
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab,
    }


def write_iquest(directory, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 96, vocab: int = 96, window: int = 4, seed: int = 0,
                 residual_scale: float = 1.0, extra_config: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rnd = _Random(seed)
    head_dim = hidden // heads

    def gate(i: int) -> dict[str, torch.Tensor]:  # model.gate_projections.{i}: [heads, head_dim] and [heads]
        return {f"model.gate_projections.{i}.weight": rnd.matrix(heads, head_dim, 2.0),
                f"model.gate_projections.{i}.bias": (0.5 * torch.randn(heads, generator=rnd.gen)).to(torch.bfloat16)}

    first, second = llama_shards(rnd, layers=layers, vocab=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                 head_dim=head_dim, intermediate=intermediate, branch_scale=residual_scale, per_layer=gate)
    write_two_shards(directory, first, second)
    config = config_data(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                         vocab=vocab, window=window)
    _write_json(directory / "config.json", {**config, **(extra_config or {})})
    _write_json(directory / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS})
    return directory


def read_published(directory) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    directory = Path(directory)
    tensors = {}
    for name in SHARDS:
        with safe_open(str(directory / name), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key).float() for key in handle.keys()})
    return json.loads((directory / "config.json").read_text()), tensors


class IQuestOracle:
    """The published forward pass over a whole sequence, fp32 (from the published code's description)."""

    def __init__(self, directory) -> None:
        self.config, self.w = read_published(directory)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"])

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, T, hd]: rotary in the half-split (non-interleaved) layout at positions 0..T-1."""
        hd, length = x.shape[-1], x.shape[1]
        inv = 1.0 / (self.config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.arange(length).float()[:, None] * inv[None, :]  # [T, hd/2]
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        return x * cos + torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), -1) * sin

    @staticmethod
    def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [h, T, hd], k / v [h, T, hd] (kv heads already repeated), allowed [T, T] bool -> [h, T, hd]."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v

    def logits(self, ids: list[int], loops_run: int | None = None) -> torch.Tensor:
        """[T, V] final logits (LOOPS_RUN = 1: lm_head(norm(state after loop 0)), the draft)."""
        c, w = self.config, self.w
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c["hidden_size"] // heads
        length = len(ids)
        h = w["model.embed_tokens.weight"][torch.tensor(ids)]  # [T, H]
        pos = torch.arange(length)
        causal = pos[None, :] <= pos[:, None]
        windowed = causal & (pos[None, :] > pos[:, None] - c["loop_window_size"])
        loop0_kv = []
        for loop in range(loops_run or c["loop_num"]):
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}."
                x = self._rms(h, w[p + "input_layernorm.weight"])
                q = self._rotate((x @ w[p + "self_attn.q_proj.weight"].T).view(length, heads, hd).transpose(0, 1))
                k = self._rotate((x @ w[p + "self_attn.k_proj.weight"].T).view(length, kv_heads, hd).transpose(0, 1))
                v = (x @ w[p + "self_attn.v_proj.weight"].T).view(length, kv_heads, hd).transpose(0, 1)
                k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
                if loop == 0:
                    loop0_kv.append((k, v))
                    out = self._softmax_attention(q, k, v, causal)
                else:
                    k0, v0 = loop0_kv[i]
                    global_out = self._softmax_attention(q, k0, v0, causal)
                    local_out = self._softmax_attention(q, k, v, windowed)
                    gw, gb = w[f"model.gate_projections.{i}.weight"], w[f"model.gate_projections.{i}.bias"]
                    g = torch.sigmoid((q * gw[:, None, :]).sum(-1, keepdim=True) + gb[:, None, None])  # [h, T, 1]
                    out = g * global_out + (1 - g) * local_out
                h = h + out.transpose(0, 1).reshape(length, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
                x = self._rms(h, w[p + "post_attention_layernorm.weight"])
                mlp = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
                h = h + mlp @ w[p + "mlp.down_proj.weight"].T
        return self._rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        return greedy(self.logits, prompt, new_tokens)
