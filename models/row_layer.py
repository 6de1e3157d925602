r"""One decoder layer over R rows, each a chunk of L tokens at its own start position, against a KV
cache it only reads: the semantics of a SPEED step (row s = slot s) and of a prefill chunk (R = 1).

    x [R*L, H] ── rms_norm ── q/k/v projections ── rotary ──┐
    past_k/v [R, kvh, T, hd] (keys below the row's start) ───┼─ softmax over [past | chunk (causal)] ── o_proj ── + x
                                                             └─ new k/v [R, kvh, L, hd] (returned; the caller writes them)
    then x + mlp(rms_norm(x))        (with sandwich norms each sublayer's output is normed before its add;
                                      with post norms, Huginn's, the second norms take the sums instead)

A cross-repeat layer (IQuest-Coder-V1-Loop, `cross`) scores q twice, and mixes the two per head:

    own K/V   [past | chunk], the last W positions only (ctx.window_*)  ── softmax ── A_own
    repeat 0's K/V [cross past | cross chunk] (CrossRead's masks)        ── softmax ── A_shared
    g = sigmoid(<q_h, w_h> + b_h) (q after rotary); rows whose `mixes` is 0 take A_shared alone
    attended = g * A_shared + (1 - g) * A_own

The residual stream stays 2-D, [R*L, H] (token rows), between and inside layers: every projection is
F.linear on it (ONNX Gemm, transB=1) and every norm and residual add runs on it, so the exported layer
has no Reshape outside attention, and an Add feeding a norm is the pair ONNX Runtime fuses into one
SkipSimplifiedLayerNormalization (measured: a 3-D stream cost the graph ~8 Reshapes a layer, 4-8 us each
on this CPU, and kept the Adds apart from the norms).

The past and the chunk are scored separately and softmaxed over their concatenation, so the cache is
never copied or concatenated; grouped-query heads reshape queries to [R, kvh, g*L, hd] so K/V are
never repeated. Written with ops that torch.onnx.export (dynamo=False) exports as plain ONNX: the
trace pass exports exactly this code, and the PyTorch backend runs it, so both share one definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speedc.models.config import VALUE_GATE_CHANNELS, ModelConfig
from speedc.models.llama import QK_NORM_EPS, Block, Decoder, relu2

NEG_INF = float("-inf")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x / sqrt(mean(x^2) + eps) * w: the form ONNX Runtime fuses into SimplifiedLayerNormalization.
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@dataclass
class RowContext:
    """What every layer of one call shares: rotary tables and the masks."""
    cos: torch.Tensor  # [R, 1, L, hd]
    sin: torch.Tensor
    past_mask: torch.Tensor  # [R, 1, 1, T]: 0 where key index < the row's start, -inf elsewhere
    chunk_mask: torch.Tensor  # [g*L, L]: causal within the chunk, repeated per query group
    past_len: int  # T
    rows: int  # R   (sizes taken once per call: traced, each would be a Shape node per layer)
    length: int  # L
    window_past_mask: torch.Tensor | None = None  # [R, 1, g*L, T]: past_mask, and only the last W positions (cross-repeat)
    window_chunk_mask: torch.Tensor | None = None  # [g*L, L]: chunk_mask, and only the last W positions


@dataclass
class CrossRead:
    """What a cross-repeat layer reads beside its own cache: repeat 0's K/V of its core layer and its gate."""
    past_k: torch.Tensor  # [R / slots, kvh, T, hd]: shared by the rows of every slot (a step's rows are slot-major)
    past_v: torch.Tensor
    past_mask: torch.Tensor  # [R, 1, 1, T]
    new_k: torch.Tensor  # [R, kvh, L, hd]: the chunk's rows beside the past (plain decoding: repeat 0's, this call's;
    new_v: torch.Tensor  # a step: the pool's row at each row's position)
    chunk_mask: torch.Tensor  # [g*L, L], or one that broadcasts
    gate_weight: torch.Tensor  # [h, hd]
    gate_bias: torch.Tensor  # [h]
    later: torch.Tensor | None = None  # [R, 1, 1, 1] bool, a step: rows of slots 1.. (gated); slot 0's rows are repeat 0,
    # their chunk their own new rows and g = 1 (A_shared, their own causal read, alone). None: every row gated
    past_len: int | None = None  # positions of past_k (None: ctx.past_len, the own past's)
    slots: int = 1  # row groups sharing past_k


def step_cross_read(slab_k: torch.Tensor, slab_v: torch.Tensor, positions: torch.Tensor, slots: int, gate,
                    past_mask: torch.Tensor | None = None) -> CrossRead:
    """A speed step's read of repeat 0's K/V, slot 0's slab of a stage layer (SLAB_K/V [n, kvh, T, hd]), by its
    SLOTS x n rows (slot-major, at POSITIONS [R]): each row over the slab below its position (PAST_MASK
    [R, 1, 1, T]; None: built here) and, as its chunk, the slab's row at its position, which slot 0 wrote a step
    earlier: past and chunk split as plain decoding splits them (its chunk is the row it just computed), so the
    softmax sums the same terms in the same order. The slab is read in place by every slot's rows, not copied."""
    n, kvh, length, hd = slab_k.shape
    keys = torch.arange(length, device=positions.device)  # [T]
    if past_mask is None:
        past_mask = torch.where(keys[None, :] < positions[:, None], 0.0, NEG_INF).to(slab_k.dtype)[:, None, None, :]
    later = (torch.arange(positions.shape[0], device=positions.device) >= n)[:, None, None, None]  # [R, 1, 1, 1]
    # a bubble's position may be the pool's scratch row: clamped (its output is never read)
    at = torch.minimum(positions, keys[-1]).reshape(slots, -1).transpose(0, 1)  # [n, P]
    index = at[:, None, :, None].expand(-1, kvh, -1, hd)  # [n, kvh, P, hd]

    def rows(slab: torch.Tensor) -> torch.Tensor:  # [R, kvh, 1, hd], slot-major
        return torch.gather(slab, 2, index).permute(2, 0, 1, 3).reshape(-1, kvh, 1, hd)

    return CrossRead(slab_k, slab_v, past_mask, rows(slab_k), rows(slab_v), slab_k.new_zeros(1, 1, 1, 1), gate.weight,
                     gate.bias, later, length, slots)


def row_context(starts: torch.Tensor, length: int, past_len: int, inv_freq: torch.Tensor, groups: int,
                window: int = 0) -> RowContext:
    """STARTS [R] int: each row's first position; LENGTH: chunk length L; PAST_LEN: cache rows T; WINDOW > 0:
    also the masks of attention over the last WINDOW positions (a cross-repeat layer's own K/V)."""
    device = starts.device
    pos = starts[:, None] + torch.arange(length, device=device)[None, :]  # [R, L]
    freqs = pos.to(torch.float32)[..., None] * inv_freq  # [R, L, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [R, 1, L, hd]
    past_valid = torch.arange(past_len, device=device)[None, :] < starts[:, None]  # [R, T]
    past_mask = torch.where(past_valid, 0.0, NEG_INF)[:, None, None, :]  # [R, 1, 1, T]
    idx = torch.arange(length, device=device)
    chunk_mask = torch.where(idx[None, :] <= idx[:, None], 0.0, NEG_INF).repeat(groups, 1)  # [g*L, L]
    ctx = RowContext(emb.cos(), emb.sin(), past_mask, chunk_mask, past_len, starts.shape[0], length)
    if window:  # key position > query position - W
        near = torch.arange(past_len, device=device)[None, None, :] > pos[:, :, None] - window  # [R, L, T]
        window_past = torch.where(past_valid[:, None, :] & near, 0.0, NEG_INF)  # [R, L, T]
        ctx.window_past_mask = window_past.repeat(1, groups, 1)[:, None]  # [R, 1, g*L, T]
        chunk_near = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - window)  # [L, L]
        ctx.window_chunk_mask = torch.where(chunk_near, 0.0, NEG_INF).repeat(groups, 1)  # [g*L, L]
    return ctx


def rotary_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    hd = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))


def mlp_over_rows(mlp, xn: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """xn [R*L, H] (normed) -> the MLP's output [R*L, H]: down(silu(gate) * up), or down(0.5 relu(up)^2) (relu2)."""
    if cfg.mlp_act == "relu2":
        return F.linear(relu2(F.linear(xn, mlp.up_proj.weight)), mlp.down_proj.weight)
    act = F.silu(F.linear(xn, mlp.gate_proj.weight)) * F.linear(xn, mlp.up_proj.weight)  # [R*L, I]
    return F.linear(act, mlp.down_proj.weight)


def value_embedding(attn, xn: torch.Tensor, token_ids: torch.Tensor, kvh: int, hd: int) -> torch.Tensor:
    """What Parcae adds to v: 2 sigmoid(value_gate(xn[:, :32])) per kv head x value_embed[token] -> [R*L, kvh*hd]."""
    gate = 2 * torch.sigmoid(F.linear(xn[:, :VALUE_GATE_CHANNELS], attn.value_gate.weight))  # [R*L, kvh]
    embedded = F.embedding(token_ids, attn.value_embed.weight).reshape(-1, kvh, hd)  # [R*L, kvh, hd]
    return (embedded * gate[..., None]).reshape(-1, kvh * hd)


def _attend(qg: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, past_mask: torch.Tensor, new_k: torch.Tensor,
            new_v: torch.Tensor, chunk_mask: torch.Tensor, past_len: int) -> torch.Tensor:
    """qg [R, kvh, g*L, hd] over [past | chunk], softmaxed together -> [R, kvh, g*L, hd]."""
    s_past = qg @ past_k.transpose(-2, -1) + past_mask  # [R, kvh, g*L, T]
    s_new = qg @ new_k.transpose(-2, -1) + chunk_mask  # [R, kvh, g*L, L]
    w = torch.softmax(torch.cat((s_past, s_new), dim=-1), dim=-1)
    return w[..., :past_len] @ past_v + w[..., past_len:] @ new_v  # [R, kvh, g*L, hd]


def _cross_attend(qg: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                  past_v: torch.Tensor, ctx: RowContext, cross: CrossRead, grouped: tuple) -> torch.Tensor:
    """A cross-repeat layer's attention (the module docstring): qg [R, kvh, g*L, hd] over its own K/V's window and
    over repeat 0's, mixed per head by the gate of q [R, h, L, hd] -> [R, kvh, g*L, hd] (GROUPED: those sizes)."""
    rows, kvh, gl, hd = grouped
    own = _attend(qg, past_k, past_v, ctx.window_past_mask, k, v, ctx.window_chunk_mask, ctx.past_len)
    new_k, new_v = cross.new_k, cross.new_v
    if cross.later is not None:  # a step: slot 0's rows (repeat 0) read their own new rows
        new_k, new_v = torch.where(cross.later, new_k, k), torch.where(cross.later, new_v, v)

    def by_slot(t: torch.Tensor) -> torch.Tensor:  # [R, ...] -> [slots, R / slots, ...]: broadcast over the slots
        return t if cross.slots == 1 else t.reshape(cross.slots, -1, *t.shape[1:])

    shared = _attend(by_slot(qg), cross.past_k, cross.past_v, by_slot(cross.past_mask), by_slot(new_k), by_slot(new_v),
                     cross.chunk_mask, ctx.past_len if cross.past_len is None else cross.past_len)
    shared = shared.reshape(rows, kvh, gl, hd)  # [R, kvh, g*L, hd]
    # the gate's weights feed Mul / Add as stored (an indexed view would be folded into a renamed constant)
    logit = (q.transpose(1, 2) * cross.gate_weight).sum(-1) + cross.gate_bias  # [R, L, h]
    gate = torch.sigmoid(logit).transpose(1, 2)[..., None]  # [R, h, L, 1]
    if cross.later is not None:  # slot 0's rows: g = 1, A_shared alone
        gate = torch.where(cross.later, gate, 1.0)
    gate = gate.reshape(rows, kvh, gl, 1)  # [R, kvh, g*L, 1]: heads grouped as qg's
    return gate * shared + (1.0 - gate) * own


def layer_over_rows(block: Block, x: torch.Tensor, ctx: RowContext, past_k: torch.Tensor, past_v: torch.Tensor,
                    cfg: ModelConfig, token_ids: torch.Tensor | None = None,
                    cross: CrossRead | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R*L, H] (row r's L tokens contiguous); past_k/v [R, kvh, T, hd] -> (x [R*L, H], new k, new v
    [R, kvh, L, hd]). Every projection is F.linear on 2-D input (ONNX Gemm with transB=1): weights are
    read as stored. TOKEN_IDS [R*L] int: the rows' tokens, read by a block with value embeddings. CROSS: a
    cross-repeat layer's read of repeat 0's K/V (the module docstring)."""
    rows, length = ctx.rows, ctx.length
    h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = h // kvh
    attn, mlp, eps = block.self_attn, block.mlp, cfg.rms_norm_eps

    def rope(v: torch.Tensor) -> torch.Tensor:  # [R, heads, L, hd]
        half = hd // 2
        return v * ctx.cos + torch.cat((-v[..., half:], v[..., :half]), dim=-1) * ctx.sin

    xn = rms_norm(x, block.input_layernorm.weight, eps)  # [R*L, H]
    q2d, k2d = F.linear(xn, attn.q_proj.weight), F.linear(xn, attn.k_proj.weight)  # [R*L, h*hd], [R*L, kvh*hd]
    if cfg.qk_bias:  # an Add after the Gemm (the weight passes read bias-free Gemms)
        q2d, k2d = q2d + attn.q_bias, k2d + attn.k_bias
    q = q2d.reshape(rows, length, h, hd).transpose(1, 2)  # [R, h, L, hd]
    k = k2d.reshape(rows, length, kvh, hd).transpose(1, 2)  # [R, kvh, L, hd]
    v2d = F.linear(xn, attn.v_proj.weight)  # [R*L, kvh*hd]
    if hasattr(attn, "value_embed"):
        if token_ids is None:
            raise ValueError("this block adds value embeddings of its tokens: pass token_ids")
        v2d = v2d + value_embedding(attn, xn, token_ids, kvh, hd)
    v = v2d.reshape(rows, length, kvh, hd).transpose(1, 2)  # [R, kvh, L, hd]
    q, k = rope(q), rope(k)
    if cfg.qk_norm:  # weightless, per head, after rotary (Parcae)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + QK_NORM_EPS)
    qg = (q * (1.0 / math.sqrt(hd))).reshape(rows, kvh, g * length, hd)  # [R, kvh, g*L, hd]
    if cross is None:
        attended = _attend(qg, past_k, past_v, ctx.past_mask, k, v, ctx.chunk_mask, ctx.past_len)  # [R, kvh, g*L, hd]
    else:
        attended = _cross_attend(qg, q, k, v, past_k, past_v, ctx, cross, (rows, kvh, g * length, hd))
    attended = attended.reshape(rows, h, length, hd).transpose(1, 2).reshape(rows * length, h * hd)
    attn_out = F.linear(attended, attn.o_proj.weight)  # [R*L, H]
    if cfg.post_norms:  # Huginn: norm2(x + attn), then norm4(h + mlp(norm3(h)))
        x = rms_norm(x + attn_out, block.input_layernorm_2.weight, eps)
        xn = rms_norm(x, block.post_attention_layernorm.weight, eps)
        return rms_norm(x + mlp_over_rows(mlp, xn, cfg), block.post_attention_layernorm_2.weight, eps), k, v
    if cfg.sandwich_norms:
        attn_out = rms_norm(attn_out, block.input_layernorm_2.weight, eps)
    x = x + attn_out
    xn = rms_norm(x, block.post_attention_layernorm.weight, eps)
    mlp_out = mlp_over_rows(mlp, xn, cfg)  # [R*L, H]
    if cfg.sandwich_norms:
        mlp_out = rms_norm(mlp_out, block.post_attention_layernorm_2.weight, eps)
    return x + mlp_out, k, v


def inject(x: torch.Tensor, entry: torch.Tensor, adapter_weight: torch.Tensor) -> torch.Tensor:
    """A core repeat's input: adapter(cat[state, e]), x and entry [r, H], weight [H, 2H] -> [r, H]."""
    return F.linear(torch.cat((x, entry), dim=-1), adapter_weight)


def inject_entry(decoder: Decoder, x: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    """A core repeat's input by the plan's injection kind (speedc/format/depth_plan.py INJECTIONS), x and entry [r, H]."""
    if decoder.injection_kind == "diagonal-decay":  # Parcae: decay * x + dt * (e B^T), per channel (one definition)
        return decoder.injection(x, entry)  # [r, H]
    return inject(x, entry, decoder.adapter.weight)


class RowOps:
    """The walker's ops (models/trip.py) over the 2-D residual stream [r, H], written as the exported
    programs and the PyTorch backend compute them; each caller adds `layer` (its cache, its rows) and, where
    it needs them, `enter_core` (the rows that run the core) and `after` (taps, outputs)."""

    def __init__(self, decoder: Decoder, cfg: ModelConfig, initial: torch.Tensor | None = None) -> None:
        self.decoder, self.cfg = decoder, cfg
        self.initial = initial  # [r, H]: the entering tokens' drawn start states (a random state_init), else zeros

    def layer(self, step, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.decoder.norm.weight, self.cfg.rms_norm_eps)

    def prelude_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.decoder.prelude_norm.weight, self.cfg.rms_norm_eps)

    def start_state(self, entry: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(entry) if self.initial is None else self.initial

    def inject(self, x: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        return inject_entry(self.decoder, x, entry)

    def project_readout(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.decoder.readout.weight)

    def enter_core(self, x: torch.Tensor, entry):
        return x, entry

    def after(self, step, x: torch.Tensor) -> None:
        pass
