r"""Pass `trace` (phase import): checkpoint -> the model's decode program as an ONNX graph.

The traced program processes a chunk of L tokens per row for B rows, each row at its own start
position, against a KV cache it only reads:

    input_ids [B, L]   positions [B] (start of the chunk)   past.key.{l} / past.value.{l} [B, kvh, T, hd]
        |
    embed -> layer 0 -> hidden.0 -> layer 1 -> hidden.1 ... -> hidden.{N-1} -> norm -> lm_head -> logits
                                 \__ after exit_layer layers: exit_norm -> lm_head -> exit_logits
    each layer also returns present.key.{l} / present.value.{l} [B, kvh, L, hd] (the chunk's new rows)

Attention scores the past (masked to key index < the row's start) and the chunk (causal) separately
and softmaxes over their concatenation, so the cache is never copied or concatenated in-graph: the
runtime writes the new rows into its own cache buffer. Grouped-query heads are handled by reshaping
queries to [B, kvh, g*L, hd], so K/V are never repeated.

With B=1 this is the prefill / plain decode graph; the pipeline pass turns it into the P-slot step
graph. Every projection is F.linear on 2-D input (ONNX Gemm, transB=1) so initializers are exactly
the checkpoint tensors: nothing is transposed or duplicated, and shared blocks stay one initializer.
"""

from __future__ import annotations

import io
import math
import warnings

import onnx
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F
from torch import nn

from speedc.models.checkpoint import model_from_state
from speedc.models.llama import SharedLlama
from speedc.passes.base import CompileState, register_pass
from speedc.passes.graph_utils import bypass_constant_identities, linear_to_gemm

OPSET = 17
NEG_INF = float("-inf")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x / sqrt(mean(x^2) + eps) * w: the form ONNX Runtime fuses into SimplifiedLayerNormalization.
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class DecodeProgram(nn.Module):
    """Export-friendly formulation of SharedLlama's cached forward (same math, same weights)."""

    def __init__(self, llama: SharedLlama) -> None:
        super().__init__()
        self.cfg = llama.cfg
        self.model = llama.model  # parameter names stay the checkpoint's: model.blocks.{m}...
        if not llama.cfg.tie_word_embeddings:
            self.lm_head = llama.lm_head
        head_dim = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _head(self, x2d: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(_rms_norm(x2d, norm_weight, self.cfg.rms_norm_eps), weight)  # [B*L, V]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor):
        cfg = self.cfg
        b, length = positions.shape[0], input_ids.shape[1]
        h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = h // kvh
        hidden_size = cfg.hidden_size

        x = self.model.embed_tokens(input_ids)  # [B, L, H]
        embeddings = x
        # Rotary tables for each row's chunk positions.
        pos = positions[:, None] + torch.arange(length, device=x.device)[None, :]  # [B, L]
        freqs = pos.to(torch.float32)[..., None] * self.inv_freq  # [B, L, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, L, hd]
        cos, sin = emb.cos(), emb.sin()
        # Masks: past keys valid below the row's start; chunk keys causal (repeated per query group).
        t = past[0].shape[2]
        past_valid = torch.arange(t, device=x.device)[None, :] < positions[:, None]  # [B, T]
        past_mask = torch.where(past_valid, 0.0, NEG_INF)[:, None, None, :]  # [B, 1, 1, T]
        idx = torch.arange(length, device=x.device)
        chunk_mask = torch.where(idx[None, :] <= idx[:, None], 0.0, NEG_INF).repeat(g, 1)  # [g*L, L]
        scale = 1.0 / math.sqrt(hd)

        def rope(v: torch.Tensor) -> torch.Tensor:  # [B, heads, L, hd]
            half = hd // 2
            return v * cos + torch.cat((-v[..., half:], v[..., :half]), dim=-1) * sin

        hidden_out, present = [], []
        exit_logits = None
        for layer, block_index in enumerate(cfg.layer_map):
            blk = self.model.blocks[block_index]
            attn = blk.self_attn
            past_k, past_v = past[2 * layer], past[2 * layer + 1]  # [B, kvh, T, hd]
            xn = _rms_norm(x, blk.input_layernorm.weight, cfg.rms_norm_eps).reshape(b * length, hidden_size)
            q = F.linear(xn, attn.q_proj.weight).reshape(b, length, h, hd).transpose(1, 2)  # [B, h, L, hd]
            k = F.linear(xn, attn.k_proj.weight).reshape(b, length, kvh, hd).transpose(1, 2)  # [B, kvh, L, hd]
            v = F.linear(xn, attn.v_proj.weight).reshape(b, length, kvh, hd).transpose(1, 2)
            q, k = rope(q), rope(k)
            qg = (q * scale).reshape(b, kvh, g * length, hd)  # [B, kvh, g*L, hd]
            s_past = qg @ past_k.transpose(2, 3) + past_mask  # [B, kvh, g*L, T]
            s_new = qg @ k.transpose(2, 3) + chunk_mask  # [B, kvh, g*L, L]
            w = torch.softmax(torch.cat((s_past, s_new), dim=-1), dim=-1)
            ctx = w[..., :t] @ past_v + w[..., t:] @ v  # [B, kvh, g*L, hd]
            ctx = ctx.reshape(b, h, length, hd).transpose(1, 2).reshape(b * length, h * hd)
            x = x + F.linear(ctx, attn.o_proj.weight).reshape(b, length, hidden_size)
            xn = _rms_norm(x, blk.post_attention_layernorm.weight, cfg.rms_norm_eps).reshape(b * length, hidden_size)
            mlp = blk.mlp
            act = F.silu(F.linear(xn, mlp.gate_proj.weight)) * F.linear(xn, mlp.up_proj.weight)
            x = x + F.linear(act, mlp.down_proj.weight).reshape(b, length, hidden_size)
            hidden_out.append(x)
            present += [k, v]
            if layer + 1 == cfg.exit_layer:
                norm = self.model.exit_norm.weight if cfg.exit_norm == "own" else self.model.norm.weight
                exit_logits = self._head(x.reshape(b * length, hidden_size), norm).reshape(b, length, -1)
        logits = self._head(x.reshape(b * length, hidden_size), self.model.norm.weight).reshape(b, length, -1)
        return (logits, exit_logits, embeddings, *hidden_out, *present)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "positions"]
    for layer in range(num_layers):
        inputs += [f"past.key.{layer}", f"past.value.{layer}"]
    outputs = ["logits", "exit_logits", "embeddings"] + [f"hidden.{layer}" for layer in range(num_layers)]
    for layer in range(num_layers):
        outputs += [f"present.key.{layer}", f"present.value.{layer}"]
    return inputs, outputs


def trace_decode_program(llama: SharedLlama) -> onnx.ModelProto:
    cfg = llama.cfg
    program = DecodeProgram(llama).eval()
    batch, length, past_len = 2, 3, 5  # non-1 sizes so nothing specialises on them
    kv_shape = (batch, cfg.num_key_value_heads, past_len, cfg.head_dim)
    args = (torch.zeros(batch, length, dtype=torch.long), torch.tensor([5, 2]),
            *[torch.zeros(kv_shape) for _ in range(2 * cfg.num_hidden_layers)])
    inputs, outputs = io_names(cfg.num_hidden_layers)
    dynamic = {"input_ids": {0: "batch", 1: "chunk"}, "positions": {0: "batch"}}
    for name in inputs[2:]:
        dynamic[name] = {0: "batch", 2: "context"}
    for name in outputs:
        dynamic[name] = {0: "batch", 2: "chunk"} if name.startswith("present") else {0: "batch", 1: "chunk"}
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(program, args, buffer, input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                          opset_version=OPSET, do_constant_folding=False, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


@register_pass("trace", phase="import", provides=("decode_program", "separate_projections"))
def trace(state: CompileState) -> CompileState:
    """Trace the checkpoint's decode program (all N layers, chunked, cache read-only) into ONNX."""
    llama = model_from_state(state.cfg, state.tensors)
    graph = gs.import_onnx(trace_decode_program(llama))
    bypass_constant_identities(graph)
    linear_to_gemm(graph)
    state.graphs["decode"] = graph.toposort()
    state.notes.append(f"traced {state.cfg.num_hidden_layers} layers over {state.cfg.num_blocks} stored blocks")
    return state
