"""Reference decoding with the PyTorch model: the behaviour every compiled path must reproduce.

    prefill(prompt) -> logits of the last prompt token
    loop: pick token (greedy argmax, or sample) -> stop on EOS / max tokens -> decode_one(token)

Sampling order: repetition penalty, temperature, top-k, top-p, then a draw from a seeded torch
generator. Greedy (temperature 0) is exact argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedc.errors import GenerationError
from speedc.models.llama import SharedLlama, new_kv_cache


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def pick_token(logits: torch.Tensor, history: list[int], sampling: Sampling, gen: torch.Generator | None) -> int:
    """logits [V] fp32 -> next token id."""
    logits = logits.float().clone()
    if sampling.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / sampling.repetition_penalty, vals * sampling.repetition_penalty)
    if sampling.greedy:
        return int(torch.argmax(logits))
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def generate(model: SharedLlama, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None = None,
             eos_token_id: int | None = None) -> list[int]:
    """Return the new token ids (the prompt excluded). Stops after EOS (included) or max_new_tokens."""
    cfg = model.cfg
    sampling = sampling or Sampling()
    if not prompt_ids:
        raise GenerationError("empty prompt: give at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= cfg.vocab_size:
        raise GenerationError(f"prompt ids must be in 0..{cfg.vocab_size - 1}")
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise GenerationError(f"prompt ({len(prompt_ids)}) + max new tokens ({max_new_tokens}) exceeds the context "
                              f"({cfg.max_position_embeddings})")
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device  # runs where the model lives (CPU or CUDA)
    cache = new_kv_cache(cfg, 1, total, dtype=dtype, device=device)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, start_pos=0).logits[0, -1].cpu()
    history = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = pick_token(logits, history, sampling, gen)
        out.append(token)
        history.append(token)
        if token == eos_token_id or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache, start_pos=len(history) - 1).logits[0, -1].cpu()
    return out
