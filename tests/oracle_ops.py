"""Operations the independent oracles (tests/*_checkpoints.py) share, written from the published descriptions in
float64: each oracle passes its own constants (norm epsilon, rotary base)."""

from __future__ import annotations

from typing import Callable

import torch


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_adjacent(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x [L, heads, hd]: pair (x[2i], x[2i+1]) rotated by position * base^(-2i/hd) (Huginn's and Parcae's rotary,
    where Llama's pairs x[i] with x[i + hd/2])."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angle = positions.double()[:, None] * inv_freq[None, :]  # [L, hd/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    pairs = x.double().unflatten(-1, (-1, 2))  # [L, heads, hd/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def greedy(logits: Callable[[list[int]], torch.Tensor], prompt: list[int], new_tokens: int) -> list[int]:
    """NEW_TOKENS ids decoded greedily after PROMPT, each from LOGITS(ids so far) [L, vocab] rerun whole (no cache:
    an oracle recomputes every position)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(logits(ids)[-1].argmax()))
    return ids[len(prompt):]
