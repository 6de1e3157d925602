"""A recurrent core's random start state, drawn per token position (the artifact's `model.initial_state`).

Huginn's published code starts each token's core state from a truncated normal draw. speedc offers it as
`speedc build --state-init random --seed S`: the state of the token at position p is

    z ~ Philox(key = (p, S)).standard_normal(H), every |z| > 3 redrawn from the same stream in order
    state = std * z

A counter-based generator keyed by (seed, position) gives a token the same draw whichever program runs it
(a prefill chunk, a plain step, slot 0 of a SPEED step) and whenever: plain decoding and SPEED see the
same states. numpy only (the runtime computes it; the graphs take it as the input initial_state).
"""

from __future__ import annotations

import numpy as np

TRUNCATE_AT = 3.0  # standard deviations (the published torch.nn.init.trunc_normal_(a=-3 std, b=3 std))


def draw(seed: int, position: int, width: int) -> np.ndarray:
    """The standard truncated-normal draw [WIDTH] float64 of POSITION under SEED."""
    stream = np.random.Generator(np.random.Philox(key=np.array([position, seed], dtype=np.uint64)))
    z = stream.standard_normal(width)
    outside = np.flatnonzero(np.abs(z) > TRUNCATE_AT)
    while outside.size:
        z[outside] = stream.standard_normal(outside.size)
        outside = outside[np.abs(z[outside]) > TRUNCATE_AT]
    return z


def initial_states(spec: dict, positions: np.ndarray, width: int, valid: np.ndarray | None = None) -> np.ndarray:
    """[len(positions), WIDTH] float32: SPEC's ({"seed", "std"}) state of each position (zeros where not VALID)."""
    out = np.zeros((len(positions), width), np.float32)
    for row, position in enumerate(np.asarray(positions).reshape(-1)):
        if valid is None or valid[row]:
            out[row] = spec["std"] * draw(int(spec["seed"]), int(position), width)
    return out
