"""Reference decoding with the PyTorch model: the behaviour every compiled path must reproduce.

    prefill(prompt) -> logits of the last prompt token
    loop: pick token (models/sampling.py, the one sampling rule) -> stop on EOS / max tokens -> decode_one(token)

The reference picks tokens with the same TokenPicker the runtimes use (same order of operations,
same seeded stream), so a seeded reference run and a seeded speedc run draw the same sequence.
"""

from __future__ import annotations

import torch

from speedc.errors import GenerationError
from speedc.models.llama import SharedLlama, new_kv_cache
from speedc.models.sampling import SamplingParams, TokenPicker


@torch.no_grad()
def generate(model: SharedLlama, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
             eos_token_id: int | None = None) -> list[int]:
    """Return the new token ids (the prompt excluded). Stops after EOS (included) or max_new_tokens."""
    cfg = model.cfg
    picker = TokenPicker(sampling or SamplingParams())
    if not prompt_ids:
        raise GenerationError("empty prompt: give at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= cfg.vocab_size:
        raise GenerationError(f"prompt ids must be in 0..{cfg.vocab_size - 1}")
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise GenerationError(f"prompt ({len(prompt_ids)}) + max new tokens ({max_new_tokens}) exceeds the context "
                              f"({cfg.max_position_embeddings})")
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device  # runs where the model lives (CPU or CUDA)
    cache = new_kv_cache(cfg, 1, total, dtype=dtype, device=device)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, start_pos=0).logits[0, -1]
    history = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        scores = logits.float().cpu().numpy()  # [V]
        token = picker.pick(scores, int(scores.argmax()), history)
        out.append(token)
        history.append(token)
        if token == eos_token_id or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache, start_pos=len(history) - 1).logits[0, -1]
    return out
