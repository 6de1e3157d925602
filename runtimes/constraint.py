"""Constrained decoding: a grammar (llguidance: JSON schema, regex, Lark / GBNF context-free grammar)
as a token mask on both heads of SPEED.

    constraint = GrammarConstraint(tokenizer, grammar, vocab_size)   # one per request
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


def check_grammar(grammar: str, tokenizer) -> str:
    """'' when GRAMMAR (llguidance's grammar string) is valid for TOKENIZER, else why not."""
    llg = _llguidance()
    return llg.LLMatcher.validate_grammar(grammar, tokenizer)


class GrammarConstraint:
    def __init__(self, tokenizer, grammar: str, vocab_size: int) -> None:
        llg = _llguidance()
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GenerationError(f"the grammar is not valid: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.mask_draft = True  # False: drafts as unconstrained (benchmarks/structured_output.py measures both)

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def allowed(self) -> np.ndarray:
        if self.matcher.is_error():
            raise GenerationError(f"the grammar matcher failed: {self.matcher.get_error()}")
        return self._mask()

    def advance(self, token: int) -> None:
        self.matcher.consume_token(int(token))  # an error state surfaces at the next allowed()

    def draft(self, candidates: np.ndarray, in_flight: list[int]) -> int | None:
        """The first of CANDIDATES the grammar allows after IN_FLIGHT; the only allowed id where there is
        one (a forced token); None where the in-flight tokens already break the grammar (they will be
        flushed) or nothing among the candidates fits."""
        if not self.mask_draft:
            return None
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
