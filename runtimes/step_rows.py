"""A decode step's inputs, assembled from the scheduler's sequences (runtimes/batch.py step 3): which token
each row runs at which position, which rows are bubbles, and which heads run.

    plain step: n rows, row b = pool row b's frontier token (or a bubble)
    speed step: [P, n] rows, slot-major (row s*n + b): slot s of pool row b (decode.Pipeline.slots)

A bubble (an empty slot, a sequence still prefilling) runs just past what its sequence may read, at most the
pool's scratch row T (bubble_positions); what it writes there is overwritten before any row reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speedc.runtimes.backends.protocol import HeadRows, SequenceHeads
from speedc.runtimes.decode import exit_heads_wanted
from speedc.runtimes.sequence import DONE, Event, Sequence


def cached_positions(sequence: Sequence, capacity: int, slots: int) -> int:
    """Cache positions of SEQUENCE that may hold K/V it will read: prompt, emitted tokens, in-flight ones."""
    return min(capacity, len(sequence.request.prompt) + len(sequence.out) + slots)


def bubble_positions(occupied: list[Sequence], capacity: int, slots: int, length: int) -> list[int]:
    """Where each occupied sequence's bubbles run (index: pool row): just past what it may read
    (cached_positions), at most the pool's scratch row LENGTH. A bubble attends to every key below its
    position, so at T each cost an attention over the whole row (measured: the batch step's attention 3.5x
    the single-sequence step's at zoo:small, whose row holds its 1,024-token context)."""
    return [min(cached_positions(sequence, capacity, slots), length) for sequence in occupied]


def plain_rows(decoding: list[Sequence], bubbles: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool, list | None]:
    """A plain step's inputs (tokens, positions, valid [n]): each decoding sequence's frontier token at its
    position, bubbles elsewhere (BUBBLES: bubble_positions); whether any wants logits; each pool row's readout
    loops (a recurrent core's count: Sequence.readout_loops; None where no row has one)."""
    n = len(bubbles)
    tokens, positions, valid = np.zeros(n, np.int64), np.asarray(bubbles, np.int64), np.zeros(n, bool)
    readout = [None] * n
    for sequence in decoding:
        frontier = sequence.frontier()
        tokens[sequence.row], positions[sequence.row], valid[sequence.row] = frontier.token, frontier.pos, True
        readout[sequence.row] = sequence.readout_loops
    return (tokens, positions, valid, any(s.request.picker.needs_logits for s in decoding),
            readout if any(r is not None for r in readout) else None)


@dataclass
class SpeedRows:
    """A speed step's inputs and where each stepping sequence's heads come back."""
    entering: np.ndarray  # [n] the token entering slot 0 of each pool row (0: none)
    positions: np.ndarray  # [P, n]
    valid: np.ndarray  # [P, n]
    heads: HeadRows
    stepping: list[tuple[Sequence, SequenceHeads]]  # each stepping sequence and where its heads' results sit
    full: bool  # every stepping pipeline holds as many tokens as the depth it runs at
    want_logits: bool


def speed_rows(decoding: list[Sequence], bubbles: list[int], slots: int, pipeline_depth: int,
               events: list[Event]) -> SpeedRows:
    """Each decoding sequence's pipeline shifted one stage (decode.Pipeline.shift, slot spacing P /
    PIPELINE_DEPTH) and its rows placed; a sequence with nothing left that could lead to another emission
    is done (an event in EVENTS; the scheduler releases it after the step)."""
    spacing, n = slots // pipeline_depth, len(bubbles)
    entering = np.zeros(n, np.int64)
    positions = np.empty((slots, n), np.int64)
    positions[:] = bubbles  # [P, n]: each sequence's bubbles where bubble_positions says
    valid = np.zeros((slots, n), bool)
    heads, stepping = HeadRows(), []
    for sequence in decoding:
        pipeline = sequence.pipeline
        if pipeline.pending is None and pipeline.empty:
            pipeline.pending = sequence.frontier()  # (re)entering speculation after prefill or plain steps
        enter = pipeline.shift(sequence.last_useful, 1 if sequence.request.depth_rule else spacing)
        if pipeline.empty:
            sequence.stats.stop_reason = sequence.stats.stop_reason or "max_new_tokens"
            sequence.state = DONE
            events.append((sequence, None))
            continue
        b = sequence.row
        entering[b] = enter.token if enter is not None else 0
        for s, token in enumerate(pipeline.slots):
            if token is not None:
                positions[s, b], valid[s, b] = token.pos, True
        # The exit head drafts slot 0's successor over the whole vocabulary; an early-flush check of a
        # deeper slot scores only the candidates that token's own draft gave (kept by the backend).
        checked = [s for s in range(1, slots - 1) if pipeline.slots[s] is not None] if sequence.early_flush else []
        rule = sequence.request.depth_rule
        stepping.append((sequence, heads.add(b, n, [token is not None for token in pipeline.slots], checked,
                                             None if rule is None else exit_heads_wanted(pipeline, rule), sequence.drafts,
                                             sequence.readout_loops)))
    free = [s.row for s, _ in stepping if s.request.depth_rule is None]
    full = bool((valid[:, free].sum(axis=0) == pipeline_depth).all())
    want = any(s.request.picker.needs_logits and (places.final is not None or places.loop_finals)
               or places.loop_finals and s.request.depth_rule.weighted for s, places in stepping)
    return SpeedRows(entering, positions, valid, heads, stepping, full, want)
