"""Token selection: the one sampling rule of the runtimes and the reference decoder (numpy only).

Order: logit bias, repetition penalty (prompt and output), frequency and presence penalties (output
only, as OpenAI defines them), then greedy argmax (temperature 0) or temperature -> top-k -> top-p ->
one uniform draw from a seeded PCG64 stream, inverted through the CDF. Every emitted position
consumes exactly one draw, in position order, so `speed` and `autoregressive` modes (which emit the
same positions in the same order) draw identical sequences from the same seed.

Log-probabilities (when asked) are the final head's own: a float64 log-softmax of the logits row
before any bias or penalty (what vLLM calls raw log-probabilities), recorded per emitted token. Both
modes hand the picker bitwise the same row for a position, so they record the same values.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # record each emitted token's log-probability and this many top alternatives

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
        for name, value in (("presence penalty", self.presence_penalty), ("frequency penalty", self.frequency_penalty)):
            require(value, name, "a number")
            if not -2.0 <= value <= 2.0:
                raise GenerationError(f"{name} must be in [-2, 2]")
        for pair in self.logit_bias:
            if len(pair) != 2 or not is_integer(pair[0]) or not is_real(pair[1]) or not -100 <= pair[1] <= 100:
                raise GenerationError(f"logit bias {pair!r:.40}: give (token id, bias in [-100, 100]) pairs")
        require(self.logprobs, "logprobs", "an integer", optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def needs_logits(self) -> bool:
        """Greedy without a penalty or log-probabilities can use the in-graph argmax; anything else needs the logits."""
        return not self.greedy or self.penalized or self.logprobs is not None


MAX_TOP_LOGPROBS = 20  # top alternatives one position may report (OpenAI's chat limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability of TOKEN and the TOP alternatives ((id, log-probability), best first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one logits row."""
    scores = np.asarray(logits, dtype=np.float64).reshape(-1)
    shifted = scores - scores.max()
    return shifted - math.log(np.exp(shifted).sum())


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """TOKEN's log-probability under LOGITS, with the TOP best ids (ties: the lower id first)."""
    values = log_softmax(logits)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        top = min(top, values.size)
        candidates = np.argpartition(-values, top - 1)[:top]
        order = sorted(candidates.tolist(), key=lambda i: (-values[i], i))
        best = tuple((int(i), float(values[i])) for i in order)
    return TokenLogprob(int(token), float(values[token]), best)


class TokenPicker:
    """Stateful picker: one RNG stream per generation call. CONSTRAINT (optional): a token mask that
    follows the picked tokens (allowed() -> bool [V] before a pick, advance(token) after it; e.g.
    runtimes/constraint.py's grammar), applied after the penalties, before the choice."""

    def __init__(self, params: SamplingParams, constraint=None) -> None:
        params.validate()
        self.params = params
        self.constraint = constraint
        self.rng = np.random.Generator(np.random.PCG64(params.seed)) if not params.greedy else None
        self.picked: dict[int, int] = {}  # id -> times this picker chose it (the output's counts, for the penalties)
        self.logprobs: list[TokenLogprob] = []  # one per pick, when params.logprobs is set

    @property
    def needs_logits(self) -> bool:
        return self.params.needs_logits or self.constraint is not None

    def pick(self, logits: np.ndarray | None, argmax_token: int, history: list[int]) -> int:
        token = self._choose(logits, argmax_token, history)
        if self.constraint is not None:
            self.constraint.advance(token)
        self.picked[token] = self.picked.get(token, 0) + 1
        if self.params.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.params.logprobs))
        return token

    def _choose(self, logits: np.ndarray | None, argmax_token: int, history: list[int]) -> int:
        params = self.params
        if not self.needs_logits:
            return int(argmax_token)
        scores = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            np.add.at(scores, np.asarray(ids, np.int64), np.asarray(biases, np.float64))
        if params.repetition_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            vals = scores[seen]
            scores[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if (params.frequency_penalty or params.presence_penalty) and self.picked:
            ids = np.fromiter(self.picked, np.int64, len(self.picked))
            counts = np.fromiter(self.picked.values(), np.float64, len(self.picked))
            scores[ids] -= counts * params.frequency_penalty + params.presence_penalty
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            if not allowed.any():
                raise GenerationError("the grammar allows no token here")
            scores[~allowed] = -np.inf
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
