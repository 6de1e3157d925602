"""Constrained decoding: a grammar (llguidance: JSON schema, regex, Lark / GBNF context-free grammar)
as a token mask on both heads of SPEED.

    constraint = GrammarConstraint(tokenizer, grammar, vocab_size, ends)   # compiled and tried: GenerationError
                                    # when the grammar is invalid or fails within its first two tokens
    constraint.copy()               another request's: the compiled grammar, its own state (cheap)
    constraint.allowed()            bool [V]: the ids the grammar allows after the confirmed tokens
    constraint.advance(token)       a confirmed (emitted) token
    constraint.draft(candidates, in_flight)
                                    the exit head's draft for the next speculative position: the best of
                                    its CANDIDATES (top K, best first) the grammar allows after the
                                    confirmed tokens and IN_FLIGHT (the speculated ones before it)

The final head's choice is masked exactly as plain decoding masks it (the picker applies allowed() to
the verified token's logits, then advances), so constrained SPEED equals constrained plain decoding.
The draft is masked along the speculative path: the matcher consumes the in-flight tokens, computes the
mask and rolls them back, so a flush needs no bookkeeping; a draft the grammar forbids would only be
flushed later, so masking it keeps the acceptance. The matcher is llguidance's (no dependencies; xgrammar
needs torch, which a runtime install leaves out).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

from speedc.errors import GenerationError


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GenerationError("structured output needs llguidance: pip install 'speedc[serve]' "
                              "(or pip install llguidance)") from None
    return llguidance


class GrammarTokenizer:
    """llguidance's view of a tokenizers.Tokenizer (built once per set of end ids: ~10 ms at 4K tokens)."""

    def __init__(self, tokenizer_json: str, vocab_size: int) -> None:
        self.json, self.vocab_size = tokenizer_json, vocab_size
        self._built: dict[frozenset[int], object] = {}
        self._lock = threading.Lock()

    def for_ends(self, ends: frozenset[int]):
        """The LLTokenizer whose end-of-sequence ids are ENDS (what a grammar's end allows)."""
        with self._lock:
            built = self._built.get(ends)
            if built is None:
                llg = _llguidance()
                built = self._built[ends] = llg.LLTokenizer(self.json, n_vocab=self.vocab_size,
                                                            eos_token=sorted(ends) or None)
            return built


def first_line(error: str, limit: int = 300) -> str:
    """llguidance's error text as one line: its first (the rest is parser state), at most LIMIT characters."""
    line = next((part.strip() for part in error.splitlines() if part.strip()), "unknown error")
    return line if len(line) <= limit else line[:limit - 3] + "..."


@contextmanager
def panics_as_errors(what: str):
    """A Rust panic inside llguidance (pyo3's PanicException, a BaseException) as a GenerationError of one line,
    so it ends its own request like any grammar error, and no backtrace reaches a client."""
    try:
        yield
    except GenerationError:
        raise
    except BaseException as failed:
        if type(failed).__name__ != "PanicException":
            raise
        raise GenerationError(f"{what}: {first_line(str(failed))}") from None


class GrammarConstraint:
    def __init__(self, tokenizer, grammar: str | None, vocab_size: int, ends: frozenset[int],
                 matcher=None) -> None:
        """Compile GRAMMAR for TOKENIZER (whose end ids are ENDS) and try it (_try_first_tokens); MATCHER: an
        already tried matcher instead (copy())."""
        self.vocab_size, self.ends = vocab_size, ends
        self.mask_draft = True  # False: drafts as unconstrained (benchmarks/structured_output.py measures both)
        if matcher is not None:
            self.matcher = matcher
            return
        llg = _llguidance()
        with panics_as_errors("the grammar is not valid"):
            self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GenerationError(f"the grammar is not valid: {first_line(self.matcher.get_error())}")
        self._try_first_tokens()

    def _try_first_tokens(self) -> None:
        """Compute the first mask, consume one allowed token, compute the next, then roll back: a grammar too big
        for the lexer or parser (a pattern such as (a{1000}){1000}, a list of thousands of alternatives), or one
        that allows nothing (a $ref cycle), fails here, before its request runs, and its work is cached in the
        matcher for the decode steps."""
        mask = self.allowed()
        if not mask.any():
            raise GenerationError("the grammar allows no output at all")
        first = int(np.flatnonzero(mask)[0])
        if self.matcher.is_stopped() or first in self.ends:
            return
        self.matcher.consume_token(first)
        try:
            self.allowed()
        finally:
            self.matcher.rollback(1)

    def copy(self) -> "GrammarConstraint":
        """A constraint at the same (start) state with a matcher of its own: another choice of the request."""
        return GrammarConstraint(None, None, self.vocab_size, self.ends, self.matcher.deep_copy())

    def _mask(self) -> np.ndarray:
        with panics_as_errors("the grammar failed"):
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def allowed(self) -> np.ndarray:
        mask = None if self.matcher.is_error() else self._mask()
        if self.matcher.is_error():
            raise GenerationError(f"the grammar failed: {first_line(self.matcher.get_error())}")
        return mask

    def advance(self, token: int) -> None:
        with panics_as_errors("the grammar failed"):
            self.matcher.consume_token(int(token))  # an error state surfaces at the next allowed()

    def draft(self, candidates: np.ndarray, in_flight: list[int]) -> int | None:
        """The first of CANDIDATES the grammar allows after IN_FLIGHT; the only allowed id where there is
        one (a forced token); None where the in-flight tokens already break the grammar (they will be
        flushed) or nothing among the candidates fits."""
        if not self.mask_draft:
            return None
        with panics_as_errors("the grammar failed"):
            consumed = self.matcher.try_consume_tokens([int(t) for t in in_flight]) if in_flight else 0
        try:
            if consumed < len(in_flight) or self.matcher.is_stopped():
                return None
            mask = self._mask()
            allowed = [int(t) for t in candidates if 0 <= t < self.vocab_size and mask[t]]
            if allowed:
                return allowed[0]
            only = np.flatnonzero(mask)
            return int(only[0]) if only.size == 1 else None
        finally:
            if consumed:
                self.matcher.rollback(consumed)
