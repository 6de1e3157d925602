"""The pipeline schedule and SPEED's cost model: shared by the schedule pass, bench and inspect.

Standard library only (no torch, no numpy), so the runtime path, bench and inspect can use it.

The model's depth plan (speedc/format/depth_plan.py: prelude, core x R, coda) says which P are possible: P
divides the core repeats R, each slot runs K = R/P of them (a stage of S = K x core layers, the same
block sequence in every slot, so one weight load serves all P slots), and the draft tap lies in slot 0.
A plan with a prelude or coda is pipelined only where the graphs run those phases (plain engine else).

Cost model: a step with P filled slots costs c(P) single-slot stage passes; plain decoding costs P
stage passes per token, and a failed speculation costs P-1 extra steps, so at acceptance alpha

    speedup(P, alpha) <= P / (c(P) * (1 + (1 - alpha) * (P - 1)))          (the analytic bound)

c(P) is hardware-dependent. Where nothing was measured, ASSUMED_STEP_COST_SLOPE gives
c(P) = 1 + beta (P - 1), for the compiler (the schedule pass chooses P before anything is measured)
and for the runtime (runtimes/acceptance_policy.py, an artifact built without a measurement) alike. It
is an assumption, labelled so wherever it is shown; `speedc build` and `speedc bench` measure the real
c(P) of an artifact on the machine at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from speedc.errors import BuildError
from speedc.format.cache_layout import CacheLayout
from speedc.format.depth_plan import DepthPlan

# beta of the assumed c(P) = 1 + beta (P - 1); not a measurement. 0.2: c(4) = 1.6 and c(8) = 2.4, the middle
# of what this project measured on its 2-core CPU (SPEED.md, README): c(4) 1.15-1.4 for fp32 steps at the
# weight-streaming floor, 1.72-1.96 for the default fp16 zoo artifacts at build, 1.6-2.0 with int8/int4
# kernels; c(8) 1.72 (fp32) to 2.9-3.3 (int8/int4). The memory-bound ideal 0.05 (c(4) = 1.15) chose P = 8
# over P = 4 at the default acceptance, where every measured (c(4), c(8)) pair makes P = 4 the faster; a
# slope at the top of the range would have the runtime give up speculation that wins.
ASSUMED_STEP_COST_SLOPE = 0.2
DEFAULT_ALPHA = 0.7  # expected acceptance when the checkpoint carries no measured agreement
ALPHA_GRID = [0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def assumed_step_cost(slots: int) -> float:
    return 1.0 + ASSUMED_STEP_COST_SLOPE * (slots - 1)


def describe_assumed_step_cost() -> str:
    return f"assumed c(P) = 1 + {ASSUMED_STEP_COST_SLOPE} (P - 1)"


def analytic_bound(slots: int, alpha: float, cost: float) -> float:
    """Upper bound of SPEED's speedup over plain decoding at step cost c(P) = COST."""
    return slots / (cost * (1.0 + (1.0 - alpha) * (slots - 1)))


def predicted_speedup(slots: int, alpha: float, cost: float | None = None) -> float:
    return analytic_bound(slots, alpha, assumed_step_cost(slots) if cost is None else cost)


@dataclass
class Schedule:
    slots: int  # P
    stage_layers: int  # S = N / P
    slot_layers: list[list[int]]  # slot s -> logical layers it runs
    stage_blocks: list[int]  # the block sequence every stage runs
    alpha: float  # acceptance the choice assumed
    valid_slots: list[int]
    curve: dict[int, dict[str, float]]  # P -> {alpha: predicted speedup at the assumed c(P)}
    reason: str
    depth_plan: DepthPlan  # what the graphs and the cache layout follow (the manifest holds its to_json)
    readouts: dict  # SlotPlan.readouts: where the draft and final heads read

    @property
    def speculative(self) -> bool:
        return self.slots > 1

    @property
    def cache_layout(self) -> CacheLayout:
        return self.depth_plan.cache_layout(self.slots)

    def to_json(self) -> dict:
        return {**asdict(self), "depth_plan": self.depth_plan.to_json()}


def speedup_curve(valid_slots: list[int]) -> dict[int, dict[str, float]]:
    return {p: {f"{a:.2f}": round(predicted_speedup(p, a), 3) for a in ALPHA_GRID} for p in valid_slots}


def make_schedule(plan: DepthPlan, exit_layer: int, alpha: float, requested: int | None,
                  pipelined_phases: bool = False) -> Schedule:
    """Choose P among the depths PLAN allows: the requested one, else the best predicted speedup at ALPHA.
    PIPELINED_PHASES: the graphs can run the plan's prelude / coda."""
    layer_map, n = plan.layer_map, plan.num_layers
    valid = plan.valid_slots(exit_layer, pipelined_phases)
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
            why = ("no block repeats (unshared model): SPEED cannot amortise any weight load" if blocks == n else
                   f"depth plan {plan.describe()}: its prelude / coda do not pipeline with the draft after layer {exit_layer}"
                   if plan.repeats > 1 and not plan.cycle else "no stage partition lets the slots share one weight load")
            reason = f"{why}; building the plain engine (P=1)"
        elif slots == 1:
            reason = f"at expected acceptance {alpha:.2f} no pipeline depth beats plain decoding; plain engine"
        else:
            reason = (f"P={slots} has the best predicted speedup {predicted_speedup(slots, alpha):.2f}x at expected "
                      f"acceptance {alpha:.2f} ({describe_assumed_step_cost()}) among valid P {valid}")
    pipeline = plan.pipeline(slots, exit_layer)
    return Schedule(
        slots=slots, stage_layers=pipeline.stage_layers, slot_layers=pipeline.slot_layers(),
        stage_blocks=pipeline.stage_blocks, alpha=alpha, valid_slots=valid, curve=speedup_curve(valid), reason=reason,
        depth_plan=plan, readouts=pipeline.readouts())
