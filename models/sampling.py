"""Token selection: the one sampling rule of the runtimes and the reference decoder (numpy only).

Order: repetition penalty, then greedy argmax (temperature 0) or temperature -> top-k -> top-p ->
one uniform draw from a seeded PCG64 stream, inverted through the CDF. Every emitted position
consumes exactly one draw, in position order, so `speed` and `autoregressive` modes (which emit the
same positions in the same order) draw identical sequences from the same seed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from speedc.errors import GenerationError


def is_integer(value) -> bool:
    """An int (numpy's too), not a bool or a float: 3.0 as a count or an index fails later, deep in a step."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (int or float, numpy's too), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require(value, name: str, kind: str, *, optional: bool = False) -> None:
    """GenerationError naming NAME unless VALUE is KIND ("an integer" or "a number"), or None if OPTIONAL."""
    if optional and value is None:
        return
    if not (is_integer(value) if kind == "an integer" else is_real(value)):
        raise GenerationError(f"{name} must be {kind}, not {type(value).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        for name, value in (("temperature", self.temperature), ("top-p", self.top_p),
                            ("repetition penalty", self.repetition_penalty)):
            require(value, name, "a number")
        require(self.top_k, "top-k", "an integer")
        require(self.seed, "seed", "an integer", optional=True)
        if not 0 <= self.temperature < math.inf:  # also refuses nan
            raise GenerationError("temperature must be >= 0 (and finite)")
        if self.top_k < 0:
            raise GenerationError("top-k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError("top-p must be in (0, 1]")
        if not 0 < self.repetition_penalty < math.inf:
            raise GenerationError("repetition penalty must be > 0 (and finite)")
        if self.seed is not None and self.seed < 0:
            raise GenerationError("seed must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits(self) -> bool:
        """Greedy without a penalty can use the in-graph argmax; anything else needs the logits."""
        return not self.greedy or self.repetition_penalty != 1.0


class TokenPicker:
    """Stateful picker: one RNG stream per generation call."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed)) if not params.greedy else None

    def pick(self, logits: np.ndarray | None, argmax_token: int, history: list[int]) -> int:
        params = self.params
        if not params.needs_logits:
            return int(argmax_token)
        scores = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
        if params.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            vals = scores[seen]
            scores[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if params.greedy:
            return int(np.argmax(scores))
        # Shift before dividing: a tiny temperature then sends every other score to -inf, never
        # (inf - inf) = nan (1e-320 picked the last id every time), and the shift does not change softmax.
        with np.errstate(over="ignore"):  # overflow to -inf is the intended result
            scores = (scores - scores.max()) / params.temperature
        if params.top_k > 0 and params.top_k < scores.size:
            kth = np.partition(scores, -params.top_k)[-params.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_probs = probs[order]
            keep = np.cumsum(sorted_probs) - sorted_probs < params.top_p  # keeps at least the top token
            probs = np.zeros_like(probs)
            probs[order[keep]] = sorted_probs[keep]
            probs /= probs.sum()
        cdf = np.cumsum(probs)
        draw = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, draw, side="right"), probs.size - 1))
