"""The PyTorch reference model: a Llama-compatible decoder whose N layers share M weight blocks.

    ids -> embed -> [block[map[0]] -> block[map[1]] -> ... -> block[map[N-1]]] -> [norm] -> lm_head
                                      |
                            after exit_layer layers: [exit_norm] -> lm_head  (early-exit head)

What the config says a family's block and loop do (models/config.py): sandwich norms normalize each
sublayer's output before its residual add (Ouro); a loop norm replaces the state by model.norm(state)
after every pass over the M blocks (looped models), in which case the heads may read it unnormed.
With cross-repeat attention (IQuest-Coder-V1-Loop, DepthPlan.cross_window = W) every layer of a later
repeat attends g * Attn(q, repeat 0's K/V of its core layer, causal) + (1 - g) * Attn(q, its own K/V, the
last W positions), g = sigmoid(<q_h, w_h> + b_h) per head from model.gate_projections.{core index}.

Every compiled path is checked against this module, so it favours plain, obviously-correct code
(explicit RoPE, explicit GQA repeat, fp32 RMSNorm) over speed. It is written with ops that export to
ONNX with `torch.onnx.export(dynamo=False)` (no nn.RMSNorm, no SDPA in the cached path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speedc.models.config import VALUE_GATE_CHANNELS, ModelConfig
from speedc.models.trip import read_out, walk

# torch.nn.functional.rms_norm's eps when given none, for float32 (finfo.eps): what Parcae's weightless q/k norm uses
QK_NORM_EPS = float(torch.finfo(torch.float32).eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, L] int -> cos, sin [B, L, head_dim] (Hugging Face's half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, L, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, L, hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, hd]; cos/sin [B, L, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def weightless_rms_norm(x: torch.Tensor, eps: float = QK_NORM_EPS) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis (Parcae's q/k norm: no weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Parcae's ReLU^2 nonlinearity, halved as the published Relu2 module does."""
    return F.relu(x).pow(2) * 0.5


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, value_embed: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qk_bias = cfg.qk_bias
        if cfg.qk_bias:  # added before rotary (Huginn)
            self.q_bias = nn.Parameter(torch.zeros(self.num_heads * self.head_dim))
            self.k_bias = nn.Parameter(torch.zeros(self.num_kv_heads * self.head_dim))
        self.qk_norm = cfg.qk_norm
        if value_embed:  # v += 2 sigmoid(value_gate(x[:32])) * value_embed[token], per kv head (Parcae)
            self.value_embed = nn.Embedding(cfg.vocab_size, self.num_kv_heads * self.head_dim)
            self.value_gate = nn.Linear(VALUE_GATE_CHANNELS, self.num_kv_heads, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_ids: torch.Tensor | None = None):
        """x [B, L, H] -> q [B, h, L, hd], k/v [B, kvh, L, hd] with RoPE applied to q and k (then the q/k
        norm where the config has it); TOKEN_IDS [B, L]: the rows' tokens, for value embeddings."""
        b, length, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_bias:
            q, k = q + self.q_bias, k + self.k_bias
        q = q.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim)  # [B, L, kvh, hd]
        if hasattr(self, "value_embed"):
            if token_ids is None:
                raise ValueError("this block adds value embeddings of its tokens: pass token_ids")
            gate = 2 * torch.sigmoid(self.value_gate(x[..., :VALUE_GATE_CHANNELS]))  # [B, L, kvh]
            v = v + gate[..., None] * self.value_embed(token_ids).view(b, length, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.qk_norm:
            q, k = weightless_rms_norm(q), weightless_rms_norm(k)
        return q, k, v.transpose(1, 2)

    def forward(self, x, cos, sin, cache: "LayerCache | None" = None, start_pos: int = 0,
                token_ids: torch.Tensor | None = None, cross: "CrossRepeat | None" = None) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.project(x, cos, sin, token_ids)
        if cache is None:  # training / full-sequence path
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            cache.k[:, :, start_pos:start_pos + length] = k
            cache.v[:, :, start_pos:start_pos + length] = v
            end = start_pos + length
            out = self._attend(q, cache.k[:, :, :end], cache.v[:, :, :end], start_pos, cross.window if cross else 0)
            if cross is not None:  # IQuest: repeat 0's K/V in full and the own window, mixed per head
                gate = cross.gate(q)  # [B, h, L, 1]
                shared = self._attend(q, cross.source.k[:, :, :end], cross.source.v[:, :, :end], start_pos, 0)
                out = gate * shared + (1 - gate) * out
        return self.o_proj(out.transpose(1, 2).reshape(b, length, self.num_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int, window: int) -> torch.Tensor:
        """q [B, h, L, hd] at positions start_pos.. over keys/values [B, kvh, end, hd], causal (and, WINDOW > 0,
        only the last WINDOW positions up to the query's own) -> [B, h, L, hd]."""
        groups = self.num_heads // self.num_kv_heads
        end = keys.shape[2]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)  # [B, h, end, hd]
        scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)  # [B, h, L, end]
        query_pos = torch.arange(start_pos, start_pos + q.shape[2], device=q.device)[:, None]
        key_pos = torch.arange(end, device=q.device)[None, :]
        hidden = key_pos > query_pos
        if window:
            hidden = hidden | (key_pos <= query_pos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


class LoopGate(nn.Module):
    """A cross-repeat layer's mix per head: g_h = sigmoid(<q_h, w_h> + b_h), q after rotary (IQuest's
    model.gate_projections.{i}: weight [h, hd], bias [h])."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_attention_heads, cfg.head_dim))
        self.bias = nn.Parameter(torch.zeros(cfg.num_attention_heads))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, h, L, hd] -> g [B, h, L, 1]."""
        return torch.sigmoid((q * self.weight[:, None, :]).sum(-1, keepdim=True) + self.bias[:, None, None])


@dataclass
class CrossRepeat:
    """What a cross-repeat layer reads beside its own cache: repeat 0's cache of its core layer, its gate, its window."""
    source: "LayerCache"
    gate: LoopGate
    window: int


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = cfg.mlp_act
        if self.act == "silu-gated":
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "relu2":  # Parcae: no gate
            return self.down_proj(relu2(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One unique weight block (a Llama decoder layer); used by every logical layer mapped to it."""

    def __init__(self, cfg: ModelConfig, value_embed: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, value_embed)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.sandwich_norms:  # names as Ouro's checkpoints have them
            self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich, self.post = cfg.sandwich_norms, cfg.post_norms

    def forward(self, x, cos, sin, cache=None, start_pos: int = 0, token_ids=None,
                cross: CrossRepeat | None = None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache, start_pos, token_ids, cross)
        if self.post:  # Huginn: the second norms take the residual sums
            x = self.input_layernorm_2(x + attended)
            return self.post_attention_layernorm_2(x + self.mlp(self.post_attention_layernorm(x)))
        x = x + (self.input_layernorm_2(attended) if self.sandwich else attended)
        mixed = self.mlp(self.post_attention_layernorm(x))
        return x + (self.post_attention_layernorm_2(mixed) if self.sandwich else mixed)


@dataclass
class LayerCache:
    k: torch.Tensor  # [B, kvh, T, hd]
    v: torch.Tensor


def new_kv_cache(cfg: ModelConfig, batch: int, length: int, dtype=torch.float32, device=None) -> list[LayerCache]:
    """One cache per logical layer (the reference keeps it simple; compiled paths lay it out per block)."""
    shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
    return [LayerCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]


class Decoder(nn.Module):
    """Embedding, the unique blocks, and the norms. State-dict names match the checkpoint format."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, m in cfg.value_embed_blocks) for m in range(cfg.num_blocks))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.exit_norm == "own":
            self.exit_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        plan = cfg.depth_plan
        self.injection_kind = plan.injection
        if plan.injection == "adapter-concat":  # each core repeat reads adapter(cat[state, e]) [H, 2H]
            self.adapter = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        if plan.injection == "diagonal-decay":  # each core repeat reads decay * state + dt * (e B^T)
            self.injection = DiagonalInjection(cfg.hidden_size)
        if plan.prelude_norm:
            self.prelude_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if plan.readout_projection:
            self.readout = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        if cfg.depth_plan.cross_window:  # one gate per core layer, read by its later repeats
            self.gate_projections = nn.ModuleList(LoopGate(cfg) for _ in cfg.depth_plan.core)

    def inject(self, x: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """A core repeat's input from the state X and the entry state ENTRY (the plan's injection)."""
        if self.injection_kind == "diagonal-decay":
            return self.injection(x, entry)
        return self.adapter(torch.cat((x, entry), dim=-1))


class DiagonalInjection(nn.Module):
    """Parcae's injection, per channel: decay * x + dt * (e B^T), dt = softplus(dt_bias), decay = exp(-dt exp(A_log))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(hidden))
        self.dt_bias = nn.Parameter(torch.zeros(hidden))
        self.B = nn.Parameter(torch.zeros(hidden, hidden))  # [state, e]

    def forward(self, x: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(self.dt_bias)  # [H]
        decay = torch.exp(-dt * torch.exp(self.A_log))  # [H]
        return x * decay + dt * F.linear(entry, self.B)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, L, V] final head
    exit_logits: torch.Tensor | None  # [B, L, V] early-exit head, when asked for


class SharedLlama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def final_head(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.model.norm(hidden) if self.cfg.final_norm else hidden
        return normed @ self.lm_head_weight().T

    def exit_head(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = {"own": getattr(self.model, "exit_norm", None), "final": self.model.norm, "none": None}[self.cfg.exit_norm]
        return (norm(hidden) if norm is not None else hidden) @ self.lm_head_weight().T

    def forward(self, input_ids: torch.Tensor, *, cache: list[LayerCache] | None = None, start_pos: int = 0,
                with_exit: bool = False) -> ForwardOutput:
        """input_ids [B, L] at positions start_pos.. ; writes K/V into `cache` when given (one per logical layer).

        The trip is the depth plan's, walked by models/trip.py: prelude, core repeats (a repeat injecting e
        reads adapter(cat[state, e]), the state starting at zero), [readout norm], coda, head. The exit
        head reads after exit_layer layers; with a coda it reads through the coda (full sequences only:
        over a cache the draft readout's coda would need K/V of its own)."""
        cfg, plan = self.cfg, self.cfg.depth_plan
        b, length = input_ids.shape
        positions = torch.arange(start_pos, start_pos + length, device=input_ids.device).expand(b, length)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        x = self.model.embed_tokens(input_ids) * cfg.embed_scale  # [B, L, H]
        if plan.cross_window and cache is None:  # later repeats read repeat 0's K/V: a cache of this call's own
            cache = new_kv_cache(cfg, b, length, x.dtype, x.device)
        ops = _ReferenceOps(self, cos, sin, cache, start_pos, input_ids, with_exit)
        x = walk(plan, plan.trip(), ops, x)
        return ForwardOutput(self.final_head(x), ops.exit_logits)


class _ReferenceOps:
    """The walker's ops (models/trip.py) for SharedLlama.forward: the model's modules over [B, L, H]."""

    def __init__(self, llama: SharedLlama, cos, sin, cache: list[LayerCache] | None, start_pos: int,
                 input_ids: torch.Tensor, with_exit: bool) -> None:
        self.llama, self.decoder, self.plan = llama, llama.model, llama.cfg.depth_plan
        self.cos, self.sin, self.cache, self.start_pos, self.input_ids = cos, sin, cache, start_pos, input_ids
        self.with_exit, self.exit_logits = with_exit, None

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        source = self.plan.cross_source(step.layer)
        cross = None if source is None else CrossRepeat(self.cache[source], self.decoder.gate_projections[source - len(self.plan.prelude)],
                                                        self.plan.cross_window)
        return self.decoder.blocks[step.block](x, self.cos, self.sin, None if self.cache is None else self.cache[step.layer],
                                               self.start_pos, self.input_ids, cross)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder.norm(x)

    def prelude_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder.prelude_norm(x)

    def start_state(self, entry: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(entry)

    def inject(self, x: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        return self.decoder.inject(x, entry)

    def project_readout(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder.readout(x)

    def enter_core(self, x: torch.Tensor, entry):
        return x, entry

    def after(self, step, x: torch.Tensor) -> None:
        if self.with_exit and step.layer + 1 == self.llama.cfg.exit_layer:
            self.exit_logits = self._exit_readout(x)

    def _exit_readout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.plan.coda:
            return self.llama.exit_head(x)
        if self.cache is not None:
            raise ValueError("the exit readout of a plan with a coda runs over full sequences only (no cache)")
        return self.llama.final_head(read_out(self.plan, _ReferenceOps(self.llama, self.cos, self.sin, None, 0,
                                                                      self.input_ids, False), x))
