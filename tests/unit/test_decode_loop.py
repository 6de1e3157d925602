"""SPEED's bookkeeping, as the engine runs one sequence (the scheduler, runtimes/batch.py, driven by
engine.scheduled), against a scripted batch backend whose speculation outcomes we choose.

The backend knows a fixed "true" continuation TRUTH and models the KV cache honestly: each pass (slot
index) records whether the row it wrote at a position came from a correct token with a clean context.
A head predicts the truth only from a clean context, so a speculation the loop fails to flush (or a
stale row it lets a valid slot read) turns into wrong output. Exit guesses of clean slots are scripted
per (depth, position); unclean slots always guess wrong(pos), so wrong chains never contradict themselves.
An early-flush check scores only the candidates the token's own draft gave (as the batch step does: the
backend keeps them beside the token's row): a draft's candidates hold both the truth and wrong(pos), so a
check returns its scripted guess.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from speedc.models.sampling import SamplingParams, TokenPicker
from speedc.runtimes.acceptance_policy import AlwaysSpeculate
from speedc.runtimes.batch import BatchScheduler
from speedc.runtimes.speculation import RowPolicy
from speedc.runtimes.backends.protocol import SpeedStepResult
from speedc.runtimes.decode import Request, run_to_end
from speedc.runtimes.engine import scheduled

V = 64
TRUTH = [int(t) for t in np.random.default_rng(7).permutation(V)]  # distinct tokens: an eos id occurs once
L = 3  # prompt = TRUTH[:L]; the prefill emits TRUTH[L]
PS = [2, 3, 4, 5]
K = 4  # candidate ids a draft gives (contract.CHECK_CANDIDATES)


def wrong(pos: int) -> int:
    return (TRUTH[pos] + 1) % V


def misses(positions, catch_depth: int = 99):
    """Clean slots guess wrong for `positions` at every depth below catch_depth (slot 0 always)."""
    return lambda depth, pos: pos in positions and depth < catch_depth


NO_MISS = misses(set())
ALL_MISS = misses(range(V), catch_depth=1)


def draft_candidates(guess: int, pos: int) -> np.ndarray:
    """The top K a draft of position POS gives: its guess first, then the truth and wrong(pos), then fillers."""
    ranked = list(dict.fromkeys([guess, TRUTH[pos], wrong(pos)]))
    ranked += [t for t in range(V) if t not in ranked][:K - len(ranked)]
    return np.asarray(ranked, np.int64)


class ScriptedBackend:
    """A batch backend of one pool row (the scheduler's interface, runtimes/backends/protocol.py)."""
    stage_layers, vocab_size, max_context, check_width, keeps_prefixes = 1, V, V, K, False

    def __init__(self, slots: int, wrong_guess=NO_MISS):
        self.slots, self.wrong_guess = slots, wrong_guess
        # the pool's size and rules (a KVPool's fields): one row of every position, never growing
        self.pool = SimpleNamespace(capacity=V, length=V, width=1, max_batch=1, would_grow=lambda positions, sequences: False)
        self.calls: list[tuple] = []  # ("prefill" | "plain", ids, start) | ("step", token, positions, valid)
        self.deepest_wrong = -1  # deepest slot a wrong (unclean) token ever ran in
        self.rows = [dict() for _ in range(self.slots)]  # pass -> {pos: row written cleanly?}
        self.inflight = [None] * self.slots  # per slot [token, pos, clean, draft's candidates], tracked here, not trusted

    @property
    def speculative(self) -> bool:
        return self.slots > 1

    @property
    def early_checks(self) -> bool:
        return self.speculative

    def reserve(self, positions: int, sequences: int | None = None) -> None:
        assert positions <= self.pool.capacity and sequences in (None, 1)

    def free_pool(self) -> None:
        pass

    def move(self, source: int, target: int, length: int | None = None) -> None:
        raise AssertionError("one sequence never moves")

    def _clean_before(self, passes, pos: int) -> bool:
        return all(self.rows[s].get(i, False) for s in passes for i in range(pos))

    def _logits(self, tokens: list[int], want: bool):
        return np.where(np.arange(V)[None] == np.asarray(tokens)[:, None], 10.0, 0.0) if want else None  # [R, V]

    def _through_all_layers(self, kind: str, ids: list[int], start: int, want: bool):
        self.calls.append((kind, list(ids), start))
        assert start + len(ids) <= self.pool.capacity
        for j, tok in enumerate(ids):  # every layer at every position: rows of all passes
            clean = tok == TRUTH[start + j] and self._clean_before(range(self.slots), start + j)
            for s in range(self.slots):
                self.rows[s][start + j] = clean
        nxt = start + len(ids)
        token = TRUTH[nxt] if clean else wrong(nxt)
        return np.asarray([token]), self._logits([token], want)

    def prefill(self, first, chunks, start, want_logits, readout_repeats=None):
        assert first == 0 and len(chunks) == 1 and readout_repeats is None
        return self._through_all_layers("prefill", chunks[0], start, want_logits)

    def plain_step(self, tokens, positions, valid, want_logits, readout_repeats=None):
        assert len(tokens) == 1 and valid[0] and readout_repeats is None
        return self._through_all_layers("plain", [int(tokens[0])], int(positions[0]), want_logits)

    def speed_step(self, entering, positions, valid, heads, want_logits):
        assert positions.shape == valid.shape == (self.slots, 1)
        positions, valid = positions[:, 0].copy(), valid[:, 0].copy()  # the loop reuses its arrays
        token = int(entering[0])
        self.calls.append(("step", token, positions, valid))
        # Heads run for tokens only: the oldest slot's final, slot 0's draft, deeper slots' checks.
        assert heads.final == ([self.slots - 1] if valid[-1] else []) and heads.exit == ([0] if valid[0] else [])
        assert all(valid[row] and 0 < row < self.slots - 1 for row in heads.check)
        shifted = [[token, int(positions[0]), True, None] if valid[0] else None] + self.inflight[:-1]
        exits = np.full(self.slots, -1, dtype=np.int64)  # bubbles guess -1: using it would break output
        final = -1
        for s in range(self.slots):
            if not valid[s]:
                shifted[s] = None  # flushed by the loop: gone
                continue
            # The loop may only mark valid a slot whose token really entered and moved here.
            assert shifted[s] is not None and shifted[s][1] == positions[s], (s, shifted, positions)
            assert positions[s] < self.pool.capacity
            tok, pos, clean, _ = shifted[s]
            clean = clean and tok == TRUTH[pos] and self._clean_before([s], pos)
            self.rows[s][pos] = shifted[s][2] = clean
            if not clean:
                self.deepest_wrong = max(self.deepest_wrong, s)
            exits[s] = TRUTH[pos + 1] if clean and not self.wrong_guess(s, pos + 1) else wrong(pos + 1)
            if s == self.slots - 1:
                final = TRUTH[pos + 1] if clean else wrong(pos + 1)
        self.inflight = shifted
        checks = []
        for row in heads.check:
            assert exits[row] in shifted[row][3]  # the check scores its token's own draft's candidates
            checks.append(int(exits[row]))
        finals = [final] if heads.final else []
        drafts = [int(exits[0])] if heads.exit else []
        candidates = [draft_candidates(g, int(positions[0]) + 1) for g in drafts]
        if drafts:
            shifted[0][3] = candidates[0]
        return SpeedStepResult(np.asarray(finals, np.int64), self._logits(finals, want_logits) if finals else None,
                               np.asarray(drafts, np.int64), np.asarray(candidates, np.int64).reshape(len(drafts), K),
                               np.asarray(checks, np.int64))

    @property
    def steps(self):
        return [c for c in self.calls if c[0] == "step"]


def _recorded(decoding, backend, steps_at_yield):
    """Pass the decoding through, remembering how many steps had run at each emission."""
    while True:
        try:
            token = next(decoding)
        except StopIteration as done:
            return done.value
        steps_at_yield.append(len(backend.steps))
        yield token


def run(P, n, script=NO_MISS, *, early=False, stop=None, mode="speed", params=SamplingParams()):
    """One sequence as Engine.generate runs it: a scheduler of one, speed always speculating (or plain only)."""
    backend = ScriptedBackend(P, script)
    request = Request(list(TRUTH[:L]), n, TokenPicker(params), stop or (lambda out: None))
    policy = RowPolicy(row_budget=None if mode == "speed" else 0)
    scheduler = BatchScheduler(backend, policy=policy, acceptance=AlwaysSpeculate(), prefill_chunk=V, first_token_alone=True)
    decoding = scheduled(scheduler, scheduler.submit(request, early_flush=early))
    steps_at_yield: list[int] = []
    out, stats = run_to_end(_recorded(decoding, backend, steps_at_yield))
    assert stats.steps == (len(backend.steps) if mode == "speed" else len(backend.calls) - 1)
    backend.steps_at_yield = steps_at_yield
    if mode == "speed":
        assert all(c[0] != "plain" for c in backend.calls)  # speed mode always speculates
        # Positions that cannot lead to an emission never enter: last useful = L + n - 2.
        entered = [c[2][0] for c in backend.steps if c[3][0]]
        assert all(p <= L + n - 2 for p in entered), entered
        # Emissions happen exactly at the steps whose oldest slot was valid (plus the prefill's).
        oldest_valid = [i + 1 for i, c in enumerate(backend.steps) if c[3][-1]]
        assert steps_at_yield == [0] + oldest_valid  # and the loop stops right after its last one
    else:
        assert not backend.steps
    return out, stats, backend


def expected(P, n, miss_positions, catch):
    """Analytic counts, all tokens up to max_new_tokens. All-correct: the prefill emits position L; the
    token at L needs P-1 fill steps to reach the oldest slot, then one emission per step, so
    (P-1) + (n-1) steps. A miss at q (wrong token entered right after q-1) is found `catch` steps after it
    entered (by the slot holding q-1 at depth catch; P-1 = last layer) and TRUTH[q] enters `catch` steps
    late: +catch steps each. Only misses with L+1 <= q <= L+n-2 (last useful) ever enter. A flush drops
    the wrong token and the `catch`-1 younger tokens behind it, clipped at the last useful position.
    Every emission but the final one verifies a successor: accepted + mispredicted = n-2."""
    counted = [q for q in miss_positions if L + 1 <= q <= L + n - 2]
    c = min(catch, P - 1)
    mis = 0 if c < P - 1 else len(counted)
    return dict(steps=(P - 1) + (n - 1) + c * len(counted), accepted=n - 2 - mis, mispredicted=mis,
                early_flushes=len(counted) - mis, flushed_tokens=sum(min(c, L + n - 1 - q) for q in counted))


def counts(stats):
    return {k: getattr(stats, k) for k in ("steps", "accepted", "mispredicted", "early_flushes", "flushed_tokens")}


PATTERN = {L + 2, L + 3, L + 7, L + 10, L + 11}  # back-to-back misses, one at last useful, one past it
N_PATTERN = 12  # last useful = L+10: L+11 never enters, so 4 counted misses

# Hand-worked from `expected` for the pattern (P -> steps, flushed): no early flush costs P-1 per miss:
# steps 5(P-1)+11, flushed 3(P-1)+1 (the miss at L+10 only drops itself). Early flush caught at depth 1
# (P >= 3): 1 step and 1 token per miss: steps (P-1)+11+4. P=2 has no middle slot to flush from.
PATTERN_NO_EARLY = {2: (16, 4), 3: (21, 7), 4: (26, 10), 5: (31, 13)}
PATTERN_EARLY_1 = {2: (16, 4), 3: (17, 4), 4: (18, 4), 5: (19, 4)}


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("case", ["all_right", "all_wrong", "pattern", "pattern_catch2", "wrong_everywhere"])
def test_output_and_exact_counts(P, early, case):
    n = N_PATTERN
    script, miss_at, catch = {
        "all_right": (NO_MISS, set(), 0),
        "all_wrong": (ALL_MISS, set(range(V)), 1),
        "pattern": (misses(PATTERN, 1), PATTERN, 1),
        "pattern_catch2": (misses(PATTERN, 2), PATTERN, 2),
        "wrong_everywhere": (misses(PATTERN), PATTERN, P - 1),  # deeper heads agree: nothing to flush early
    }[case]
    out, stats, backend = run(P, n, script, early=early)
    plain, plain_stats, _ = run(P, n, script, mode="autoregressive")
    assert out == plain == TRUTH[L:L + n] and plain_stats.steps == n - 1
    assert stats.new_tokens == n and stats.stop_reason == "max_new_tokens"
    assert counts(stats) == expected(P, n, miss_at, catch if early else P - 1)
    if case == "all_wrong" and not early:
        assert stats.steps == P * (n - 1)  # every emitted token costs a full pass through the pipeline
    if case == "pattern":
        steps, flushed = (PATTERN_EARLY_1 if early else PATTERN_NO_EARLY)[P]
        assert (stats.steps, stats.flushed_tokens) == (steps, flushed)
    if case != "all_right":  # a wrong token never runs deeper than the stage before it is caught
        assert backend.deepest_wrong == min(catch if early else P - 1, P - 1) - 1


@pytest.mark.parametrize("P", [3, 4, 5])
def test_early_flush_fires_before_last_layer(P):
    n = 10
    on = run(P, n, misses({L + 4}, 1), early=True)[1]
    off = run(P, n, misses({L + 4}, 1), early=False)[1]
    assert (on.early_flushes, on.mispredicted, off.early_flushes, off.mispredicted) == (1, 0, 0, 1)
    assert off.steps - on.steps == P - 2  # caught after 1 stage instead of P-1


# A false alarm: slot 0 guessed right but the depth-1 head says otherwise. Hand-worked: the right token is
# flushed (1), the wrong guess enters; one step later q-1 sits at depth 2, which contradicts it: an early
# flush for P >= 4, the last layer for P = 3 (mispredicted). The truth re-enters 2 steps late either way.
FALSE_ALARM = {2: (0, 0, 0, 0), 3: (2, 1, 1, 2), 4: (2, 2, 0, 2), 5: (2, 2, 0, 2)}  # extra steps, early, mis, flushed


@pytest.mark.parametrize("P", PS)
def test_false_alarm_early_flush(P):
    n, q = 10, L + 4
    out, stats, _ = run(P, n, lambda depth, pos: depth == 1 and pos == q, early=True)
    assert out == TRUTH[L:L + n]
    extra, early, mis, flushed = FALSE_ALARM[P]
    assert (stats.steps, stats.early_flushes, stats.mispredicted, stats.flushed_tokens) == \
        ((P - 1) + (n - 1) + extra, early, mis, flushed)


def test_bubbles_refill_after_flush():
    # P=4, n=10, slot 0 guesses L+3 wrong: L+2 entered at step 3, reaches the oldest slot at step 6, which
    # flushes 3 tokens; TRUTH[L+3] enters at step 7 into an empty pipeline; the tail drains after L+8.
    out, stats, backend = run(4, 10, misses({L + 3}))
    masks = ["".join("1" if v else "0" for v in c[3]) for c in backend.steps]
    assert masks == ["1000", "1100", "1110", "1111", "1111", "1111",
                     "1000", "1100", "1110", "1111", "1111", "1111", "0111", "0011", "0001"]
    step7 = backend.steps[6]
    assert (step7[1], int(step7[2][0])) == (TRUTH[L + 3], L + 3)  # the verified token re-enters
    assert backend.steps_at_yield == [0, 4, 5, 6, 10, 11, 12, 13, 14, 15]  # none while the oldest is a bubble
    assert out == TRUTH[L:L + 10] and stats.flushed_tokens == 3


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("mode", ["speed", "early", "autoregressive"])
@pytest.mark.parametrize("reason,k", [("eos", 4), ("eos", 0), ("stop_string", 4), ("max_new_tokens", 0)])
def test_stop_reasons(P, mode, reason, k):
    eos = TRUTH[L + k]
    stop = {"eos": lambda out: "eos" if out[-1] == eos else None,
            "stop_string": lambda out: "stop_string" if out[-2:] == TRUTH[L + k - 1:L + k + 1] else None,
            "max_new_tokens": lambda out: None}[reason]
    n = 1 if reason == "max_new_tokens" else 20  # max_new_tokens=1: only the prefill's token
    out, stats, backend = run(P, n, stop=stop, mode="speed" if mode != "autoregressive" else mode,
                              early=mode == "early")
    assert out == TRUTH[L:L + k + 1] and stats.stop_reason == reason and stats.new_tokens == k + 1
    # All guesses right: k tokens after the prefill's cost P-1 fill steps then one step each.
    assert stats.steps == (k if mode == "autoregressive" else (P - 1 + k if k else 0))


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("n,script,steps,entered", [
    (2, NO_MISS, lambda P: P, 1),  # only the prefill token is worth running: its final head gives #2
    (3, NO_MISS, lambda P: P + 1, 2),
    (3, ALL_MISS, lambda P: 2 * P, 3),  # TRUTH[L], wrong(L+1), then TRUTH[L+1] after the flush
])
def test_last_useful_position(P, n, script, steps, entered):
    out, stats, backend = run(P, n, script)
    assert out == TRUTH[L:L + n]
    assert stats.steps == steps(P)
    assert sum(bool(c[3][0]) for c in backend.steps) == entered


@pytest.mark.parametrize("n", [1, 2, 7])
def test_autoregressive_one_step_per_token(n):
    out, stats, backend = run(4, n, mode="autoregressive")
    assert out == TRUTH[L:L + n] and stats.steps == stats.new_tokens - 1 == n - 1
    assert [c[2] for c in backend.calls] == [0] + list(range(L, L + n - 1))  # consecutive positions


@pytest.mark.parametrize("P", [2, 4])
def test_logits_path(P):
    # A repetition penalty forces the loop to pick from final_logits instead of the in-graph argmax.
    params = SamplingParams(repetition_penalty=1.3)
    out, _, _ = run(P, 9, misses({L + 2, L + 5}, 1), early=True, params=params)
    assert out == run(P, 9, mode="autoregressive", params=params)[0] == TRUTH[L:L + 9]


# Two false alarms in one step (the slot at r, depth 2, doubts r+1; the slot at r+1, depth 1, doubts r+2):
# the deepest contradiction must win (flush r+1 and r+2). Hand-worked timeline for P=5 (k: r enters):
# k+2 flush 2, wrong(r+1) enters; k+3 depth 3 flushes it (1), TRUTH[r+1] enters k+4 (+3 steps); its
# depth-1 false alarm on r+2 costs 2 more flushes of 1 (+2 steps). P=4: the k+3 catch is the last layer.
DOUBLE_ALARM = {4: (5, 3, 1, 5), 5: (5, 4, 0, 5)}  # extra steps, early, mispredicted, flushed


@pytest.mark.parametrize("P", [4, 5])
def test_deepest_contradiction_wins(P):
    n, r = 12, L + 4
    out, stats, _ = run(P, n, lambda depth, pos: (depth, pos) in {(2, r + 1), (1, r + 2)}, early=True)
    assert out == TRUTH[L:L + n]
    extra, early, mis, flushed = DOUBLE_ALARM[P]
    assert (stats.steps, stats.early_flushes, stats.mispredicted, stats.flushed_tokens) == \
        ((P - 1) + (n - 1) + extra, early, mis, flushed)


def test_growing_the_pool_at_admission_is_the_prompts_time_not_the_decodings(monkeypatch):
    """A request the pool must grow for pays that (new pages zeroed: about a second a GB) before its first token:
    prefill_seconds holds it, decode_seconds does not (a clock that only the growth advances)."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    backend = ScriptedBackend(4)
    grown = []
    backend.pool.would_grow = lambda positions, sequences: not grown

    def reserve(positions, sequences=None):
        if not grown:
            grown.append(positions)
            clock[0] += 100.0

    backend.reserve = reserve
    scheduler = BatchScheduler(backend, policy=RowPolicy(), acceptance=AlwaysSpeculate(), prefill_chunk=V)
    out, stats = run_to_end(scheduled(scheduler, scheduler.submit(Request(list(TRUTH[:L]), 6, TokenPicker(SamplingParams()),
                                                                          lambda out: None))))
    assert out == TRUTH[L:L + 6] and grown == [L + 6]
    assert stats.prefill_seconds == 100.0 and stats.decode_seconds == 0.0
