"""A prefix cache: the K/V rows of sequences that ended, kept by their tokens, so a later request whose
prompt begins with the same tokens (the previous turn of a chat, a shared system prompt) copies those
rows into its pool row instead of prefilling them again.

    cache.store(tokens, rows)     rows: every pool's [.., .., kv_heads, len(tokens), head_dim] K and V
    cache.lookup(prompt, keep)    -> (entry, m): the entry sharing the longest token prefix with PROMPT,
                                     m at most len(prompt) - KEEP (the last prompt token always runs: its
                                     logits give the first new token)

Rows at position i depend only on tokens 0..i (causal attention), so an entry sharing m tokens with a
prompt holds that prompt's rows 0..m-1, whatever followed them. On ONNX Runtime's CPU kernels a row
computed in a prefill chunk of two tokens or more is bitwise the same wherever the chunk begins (tested;
a run of one token gives rows ~1e-6 apart, so the scheduler keeps prompt rows only and prefills at least
two tokens after a hit), so the output with a cache hit equals the output without. The pool keeps a row per sequence, contiguous per layer
(what one batched step reads), so rows are copied in and out rather than shared between requests.

Bounded by BUDGET bytes: least recently used entries are evicted first; an entry whose tokens are a
prefix of a newer one's is dropped (the newer one answers every lookup it would).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class PrefixEntry:
    tokens: np.ndarray  # [L] int64
    rows: list[np.ndarray]  # each pool's K or V rows of positions 0..L-1

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.rows)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    length = min(len(a), len(b))
    differ = np.flatnonzero(a[:length] != b[:length])
    return int(differ[0]) if differ.size else length


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # oldest use first
        self._keys = iter(range(1 << 62))
        self._lock = threading.Lock()  # schedulers of one engine take turns; a server's metrics read from another thread
        self.hits = self.hit_tokens = self.lookups = self.evictions = 0
        self.nbytes = 0  # what the entries hold

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], keep: int = 1) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with PROMPT (marked used) and how many positions to reuse,
        leaving at least KEEP tokens to prefill."""
        tokens = np.asarray(prompt, np.int64)
        with self._lock:
            self.lookups += 1
            best, best_length = None, 0
            for key, entry in self._entries.items():
                length = common_prefix(entry.tokens, tokens)
                if length > best_length:
                    best, best_length = key, length
            reuse = min(best_length, len(prompt) - keep)
            if best is None or reuse < 1:
                return None, 0
            self._entries.move_to_end(best)
            self.hits += 1
            self.hit_tokens += reuse
            return self._entries[best], reuse

    def store(self, tokens: list[int], rows: list[np.ndarray]) -> None:
        """Keep ROWS (positions 0..len(tokens)-1) for TOKENS, evicting the least recently used to fit."""
        entry = PrefixEntry(np.asarray(tokens, np.int64), rows)
        if not len(tokens) or entry.nbytes > self.budget:
            return
        with self._lock:
            for key, old in list(self._entries.items()):
                shared = common_prefix(old.tokens, entry.tokens)
                if shared == len(entry.tokens):  # already held (it or a longer one): mark it used
                    self._entries.move_to_end(key)
                    return
                if shared == len(old.tokens):  # the new one answers every lookup the old one would
                    self._drop(key)
            while self._entries and self.nbytes + entry.nbytes > self.budget:
                self._drop(next(iter(self._entries)))  # the least recently used
                self.evictions += 1
            self._entries[next(self._keys)] = entry
            self.nbytes += entry.nbytes

    # ---- a scheduler's sequences (runtimes/batch.py) ------------------------------------------------
    def reuse(self, sequence, pool) -> None:
        """SEQUENCE (runtimes/sequence.Sequence) just took its pool row in POOL (a KVPool): its prompt's longest
        cached prefix goes there, and its prefill starts after it with at least two tokens (PrefillTurns.chunk_size;
        its prefill_target is one short of the prompt under an exit rule). A prompt whose log-probabilities are
        asked runs whole: each of its tokens' logits is needed."""
        request = sequence.request
        if request.prompt_logprobs is not None:
            return
        entry, reuse = self.lookup(request.prompt, keep=2 + len(request.prompt) - sequence.prefill_target)
        if entry is not None:
            pool.write_rows(sequence.row, entry.rows, reuse)
            sequence.prefilled = sequence.stats.cached_tokens = reuse

    def keep(self, sequence, pool) -> None:
        """SEQUENCE is leaving its pool row in POOL: its prompt's rows (those prefilled) are stored. Not the generated
        tokens' rows: a decode step computes a token's rows a run of one (not bitwise a prefill's, see
        PrefillTurns.chunk_size); a chat's next turn holds them in its prompt, prefilled then and kept after it. Nor
        the rows of a prompt prefilled a token a run (its log-probabilities asked)."""
        if sequence.row < 0 or sequence.request.prompt_logprobs is not None:
            return
        tokens = sequence.request.prompt[:sequence.prefilled]
        if len(tokens) > 1:
            self.store(tokens, pool.read_rows(sequence.row, len(tokens)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
