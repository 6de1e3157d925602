"""The decode loops: plain autoregressive, and SPEED's pipelined speculation.

SPEED loop, one step (P slots, slot 0 youngest; each slot holds (token, position) or a bubble):

    1. the pending token enters slot 0; every other slot moved one deeper after the last step
    2. backend.step: every slot runs one stage; the oldest slot's final head gives the true token y
       for position q = oldest.pos + 1, every slot's exit head gives a guess for its successor
    3. emit y (the full model's token, exactly as plain decoding picks it)
    4. verify: the in-flight token for position q must equal y, else flush every slot at >= q and
       let y enter next (the pipeline refills: P-1 steps without emission)
    5. early flush (optional): a deeper slot's exit guess is better informed than the guess that
       entered; if it contradicts the in-flight successor, flush now instead of at the last layer
    6. otherwise slot 0's exit guess enters next step

Every emitted token comes from the final head of a token whose predecessors were all verified, so
the output equals plain decoding; speculation only decides which work is reused.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Generator

import numpy as np

from speedc.runtimes.backend import Backend
from speedc.models.sampling import TokenPicker


@dataclass
class DecodeStats:
    mode: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # graph runs after prefill
    accepted: int = 0  # speculations confirmed at the last layer
    mispredicted: int = 0  # speculations contradicted at the last layer (flush + refill)
    early_flushes: int = 0  # flushes triggered by a deeper exit head
    flushed_tokens: int = 0  # in-flight tokens discarded by any flush
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        checked = self.accepted + self.mispredicted
        return self.accepted / checked if checked else 0.0

    @property
    def failed_speculations(self) -> int:
        """Speculations that did not survive: contradicted at the last layer or by an early flush
        (what the analytic bound's 1 - alpha counts)."""
        return self.mispredicted + self.early_flushes

    @property
    def tokens_per_step(self) -> float:
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(acceptance_rate=round(self.acceptance_rate, 4), tokens_per_step=round(self.tokens_per_step, 4),
                    decode_tokens_per_second=round((self.new_tokens - 1) / self.decode_seconds, 2)
                    if self.decode_seconds > 0 else None)
        return data


@dataclass
class _Slot:
    token: int
    pos: int


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    picker: TokenPicker
    stop: Callable[[list[int]], str | None]  # new ids -> stop reason or None
    history: list[int] = field(default_factory=list)


Decoding = Generator[int, None, tuple[list[int], DecodeStats]]  # yields confirmed tokens, returns (ids, stats)


def run_to_end(decoding: Decoding) -> tuple[list[int], DecodeStats]:
    while True:
        try:
            next(decoding)
        except StopIteration as done:
            return done.value


def emit_token(request: Request, out: list[int], token: int, stats: DecodeStats) -> bool:
    """Record a confirmed token; True when generation is over."""
    out.append(token)
    request.history.append(token)
    stats.new_tokens = len(out)
    reason = request.stop(out)
    if reason is None and len(out) >= request.max_new_tokens:
        reason = "max_new_tokens"
    if reason:
        stats.stop_reason = reason
        return True
    return False


def _prefill(backend: Backend, request: Request, stats: DecodeStats) -> int:
    start = time.perf_counter()
    backend.reset(len(request.prompt) + request.max_new_tokens)
    want = request.picker.params.needs_logits
    argmax, logits = backend.prefill(request.prompt, 0, want)
    request.history = list(request.prompt)
    token = request.picker.pick(logits, argmax, request.history)
    stats.prompt_tokens = len(request.prompt)
    stats.prefill_seconds = time.perf_counter() - start
    return token


def decode_autoregressive(backend: Backend, request: Request) -> Decoding:
    """One token through all N layers per step (the prefill graph with a chunk of one)."""
    stats = DecodeStats("autoregressive")
    out: list[int] = []
    token = _prefill(backend, request, stats)
    start = time.perf_counter()
    want = request.picker.params.needs_logits
    while True:
        done = emit_token(request, out, token, stats)
        yield token
        if done:
            break
        position = len(request.prompt) + len(out) - 1
        argmax, logits = backend.prefill([token], position, want)
        stats.steps += 1
        token = request.picker.pick(logits, argmax, request.history)
    stats.decode_seconds = time.perf_counter() - start
    return out, stats


def decode_speed(backend: Backend, request: Request, *, early_flush: bool = False) -> Decoding:
    """SPEED: P tokens in flight, one stage each per step, verified at the last layer."""
    slots_n = backend.slots
    if slots_n == 1:
        out, stats = yield from decode_autoregressive(backend, request)
        stats.mode = "speed (plain engine: P=1)"
        return out, stats
    stats = DecodeStats("speed" + (" +early-flush" if early_flush else ""))
    out: list[int] = []
    first = _prefill(backend, request, stats)
    start = time.perf_counter()
    done = emit_token(request, out, first, stats)
    yield first
    if done:
        stats.decode_seconds = time.perf_counter() - start
        return out, stats
    want = request.picker.params.needs_logits
    # A token at position q is worth computing only if position q+1 may still be emitted.
    last_useful = len(request.prompt) + request.max_new_tokens - 2
    slots: list[_Slot | None] = [None] * slots_n
    pending: _Slot | None = _Slot(first, len(request.prompt))
    positions = np.zeros(slots_n, dtype=np.int64)
    valid = np.zeros(slots_n, dtype=bool)

    def flush_from(q: int) -> None:
        for i, slot in enumerate(slots):
            if slot is not None and slot.pos >= q:
                slots[i] = None
                stats.flushed_tokens += 1

    def holder(q: int) -> _Slot | None:
        return next((s for s in slots if s is not None and s.pos == q), None)

    while True:
        enter = pending if pending is not None and pending.pos <= last_useful else None
        slots = [enter] + slots[:-1]
        if all(s is None for s in slots):
            break  # nothing left that could lead to another emission
        for i, slot in enumerate(slots):
            valid[i] = slot is not None
            positions[i] = slot.pos if slot is not None else 0
        result = backend.step(enter.token if enter else 0, positions, valid, want, all_exits=early_flush)
        stats.steps += 1
        pending = None
        oldest = slots[-1]
        if oldest is not None:
            q = oldest.pos + 1
            y = request.picker.pick(result.final_logits, result.final_token, request.history)
            done = emit_token(request, out, y, stats)
            yield y
            if done:
                break
            successor = holder(q)
            if successor is not None and successor.token == y:
                stats.accepted += 1
            else:
                stats.mispredicted += successor is not None
                flush_from(q)
                pending = _Slot(y, q)
        if pending is None and early_flush:
            for depth in range(slots_n - 2, 0, -1):  # deepest (best informed) first
                slot = slots[depth]
                if slot is None:
                    continue
                guess = int(result.exit_tokens[depth])
                successor = holder(slot.pos + 1)
                if successor is not None and successor.token != guess:
                    flush_from(slot.pos + 1)
                    pending = _Slot(guess, slot.pos + 1)
                    stats.early_flushes += 1
                    break
        if pending is None and slots[0] is not None:
            pending = _Slot(int(result.exit_tokens[0]), slots[0].pos + 1)
    stats.decode_seconds = time.perf_counter() - start
    return out, stats
