"""The backend's record of each in-flight token's draft candidates (runtimes/backends/protocol.py
DraftCandidates): a check of a token in slot s scores the top K that token's own draft gave when it ran
slot 0, s steps earlier, whatever else ran beside it, and the record follows its pool row when it moves."""

import numpy as np

from speedc.runtimes.backends.protocol import DraftCandidates, HeadRows, SpeedStepResult

P, B, K = 4, 3, 2


def drafts_of(step: int, rows: list[int]) -> np.ndarray:
    """Distinct candidates per (step, pool row): [len(rows), K]."""
    return np.asarray([[100 * step + 10 * row + k for k in range(K)] for row in rows], np.int64)


def test_a_check_reads_its_own_tokens_draft():
    record, n = DraftCandidates(P, B, K), 2
    for step in range(3):  # both pool rows draft every step: their tokens move one slot deeper each
        record.stepped([0, 1], drafts_of(step, [0, 1]))
    # now the token in slot s of row b drafted at step 3 - s (it ran slot 0 then)
    rows = [s * n + b for s in (1, 2, 3) for b in range(n)]
    expected = np.stack([drafts_of(3 - s, [b])[0] for s in (1, 2, 3) for b in range(n)])
    assert np.array_equal(record.checks(rows, n), expected)


def test_a_bubble_in_slot_zero_leaves_the_older_drafts_in_place():
    record = DraftCandidates(P, B, K)
    record.stepped([0], drafts_of(0, [0]))
    record.stepped([], np.zeros((0, K), np.int64))  # slot 0 a bubble this step
    assert np.array_equal(record.checks([2], 1), drafts_of(0, [0]))  # slot 2: the token that drafted at step 0


def test_the_record_moves_with_its_pool_row():
    record = DraftCandidates(P, B, K)
    record.stepped([2], drafts_of(0, [2]))
    record.move(2, 0)
    assert np.array_equal(record.checks([1], 1), drafts_of(0, [2]))  # pool row 0 now, slot 1


def test_each_sequence_reads_its_own_heads_back():
    """HeadRows.add places each sequence's heads; SpeedStepResult.of_sequence reads them back, in any mix."""
    heads, n = HeadRows(), 2
    first = heads.add(0, n, [True, False, True, True], checked=[2])  # slot 1 a bubble: no check there
    second = heads.add(1, n, [False, True, True, False], checked=[1, 2])
    assert (heads.final, heads.exit, heads.check) == ([3 * n + 0], [0], [2 * n + 0, 1 * n + 1, 2 * n + 1])
    result = SpeedStepResult(np.array([7]), np.arange(5.0)[None], np.array([8]), np.array([[8, 9]]), np.array([4, 5, 6]))
    mine, theirs = result.of_sequence(first), result.of_sequence(second)
    assert (mine.final_token, mine.guesses, mine.draft_candidates.tolist()) == (7, {0: 8, 2: 4}, [8, 9])
    assert mine.final_logits.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (theirs.final_token, theirs.final_logits, theirs.guesses, theirs.draft_candidates) == (None, None, {1: 5, 2: 6}, None)
