"""Pass `schedule` (phase analysis): choose the pipeline depth P and the slot -> layer table.

A stage is S = N/P consecutive logical layers; slot s runs stage s (layers s*S .. s*S+S-1) each step.
One weight load can serve all P slots only if every stage runs the same block sequence:

    cycle M=4, N=16:  stage blocks 0 1 2 3 | 0 1 2 3 | 0 1 2 3 | 0 1 2 3   -> P=4 (or P=2, S=8)
    sequence M=4:     stage blocks 0 0 0 0 | 1 1 1 1 | ...                 -> no P>1 shares weights

Cost model: a step with P filled slots costs c(P) = 1 + beta*(P-1) single-slot stage passes (beta
from measurements on ONNX Runtime CPU: c(4) = 1.15); plain decoding costs P stage passes per token,
so with speculation acceptance alpha

    speedup(P, alpha) = P / (c(P) * (1 + (1 - alpha) * (P - 1)))

The pass picks the valid P with the best predicted speedup at the expected alpha (the checkpoint's
measured exit/final agreement when known) and records why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from speedc.errors import BuildError
from speedc.models.layer_map import valid_slot_counts
from speedc.passes.base import CompileState, register_pass

STEP_COST_SLOPE = 0.05  # beta: c(P) = 1 + beta (P - 1)
DEFAULT_ALPHA = 0.7
ALPHA_GRID = [0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def step_cost(slots: int, slope: float = STEP_COST_SLOPE) -> float:
    return 1.0 + slope * (slots - 1)


def predicted_speedup(slots: int, alpha: float, cost: float | None = None) -> float:
    cost = step_cost(slots) if cost is None else cost
    return slots / (cost * (1.0 + (1.0 - alpha) * (slots - 1)))


@dataclass
class Schedule:
    slots: int  # P
    stage_layers: int  # S = N / P
    slot_layers: list[list[int]]  # slot s -> logical layers it runs
    stage_blocks: list[int]  # the block sequence every stage runs
    alpha: float  # acceptance the choice assumed
    valid_slots: list[int]
    curve: dict[int, dict[str, float]]  # P -> {alpha: predicted speedup}
    reason: str

    @property
    def speculative(self) -> bool:
        return self.slots > 1

    def to_json(self) -> dict:
        return asdict(self)


def make_schedule(layer_map: list[int], exit_layer: int, alpha: float, requested: int | None) -> Schedule:
    n = len(layer_map)
    valid = valid_slot_counts(layer_map, exit_layer)
    curve = {p: {f"{a:.2f}": round(predicted_speedup(p, a), 3) for a in ALPHA_GRID} for p in valid}
    if requested is not None:
        if requested not in valid:
            raise BuildError(f"--slots {requested} does not divide the schedule: valid slot counts for this layer map "
                             f"and exit layer {exit_layer} are {valid}")
        slots = requested
        reason = f"--slots {requested} requested"
    else:
        slots = max(valid, key=lambda p: (round(predicted_speedup(p, alpha), 6), -p))
        if len(valid) == 1:
            blocks = max(layer_map) + 1
            why = ("no block repeats (unshared model): SPEED cannot amortise any weight load"
                   if blocks == n else "no stage partition lets the slots share one weight load")
            reason = f"{why}; building the plain engine (P=1)"
        elif slots == 1:
            reason = f"at expected acceptance {alpha:.2f} no pipeline depth beats plain decoding; plain engine"
        else:
            reason = (f"P={slots} has the best predicted speedup {predicted_speedup(slots, alpha):.2f}x at expected "
                      f"acceptance {alpha:.2f} among valid P {valid}")
    stage = n // slots
    return Schedule(
        slots=slots, stage_layers=stage,
        slot_layers=[list(range(s * stage, (s + 1) * stage)) for s in range(slots)],
        stage_blocks=layer_map[:stage], alpha=alpha, valid_slots=valid, curve=curve, reason=reason)


@register_pass("schedule", phase="analysis")
def schedule(state: CompileState) -> CompileState:
    """Pick P and the slot -> logical-layer table from the layer map and the cost model."""
    alpha = state.options.alpha if state.options.alpha is not None else (state.acceptance_hint or DEFAULT_ALPHA)
    state.schedule = make_schedule(state.layer_map, state.exit_layer, alpha, state.options.slots)
    state.notes.append(f"schedule: {state.schedule.reason}")
    return state
