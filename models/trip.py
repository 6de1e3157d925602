r"""The one walker of a token's path: what happens between the layers of a depth plan, written once.

    steps (LayerStep, speedc/format/depth_plan.py) ──┐
                                              ├─ walk ──> x after the last step
    ops (TripOps: this caller's tensors) ─────┘

    at a step that enters the core:  [prelude_norm]  then, with an injection, e = x and x = start_state(e);
                                     ops.enter_core(x, e) (a pipeline step adds the slots behind here)
    at a step that injects:          x = inject(x, e)
    every step:                      x = ops.layer(step, x)        (the block, its cache, its attention)
    where a normed repeat ends:      x = norm(x)
    where the core ends:             x = readout_entry(x)          ([norm] (Huginn), [projection] (Parcae))
    then:                            ops.after(step, x)            (taps, hidden outputs)

The reference model (models/llama.py), the decode program's trace (passes/trace.py), the phase-step
program (passes/phase_step_program.py) and the PyTorch backend all walk here with their own ops, so a
depth feature (an injection kind, a readout, an exit rule) is a plan field, a branch below, and an op.
Standard library only: the ops own every tensor.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from speedc.format.depth_plan import DepthPlan, LayerStep


class TripOps(Protocol):
    def layer(self, step: LayerStep, x: Any) -> Any: ...  # block step.block over x at logical layer step.layer
    def norm(self, x: Any) -> Any: ...  # model.norm
    def prelude_norm(self, x: Any) -> Any: ...  # model.prelude_norm (Parcae)
    def start_state(self, entry: Any) -> Any: ...  # the core's start state beside the entry state (zero or drawn)
    def inject(self, x: Any, entry: Any) -> Any: ...  # a repeat's input from the state and e
    def project_readout(self, x: Any) -> Any: ...  # model.readout (Parcae's C)
    def enter_core(self, x: Any, entry: Any) -> tuple[Any, Any]: ...  # the rows that run the core, and their e
    def after(self, step: LayerStep, x: Any) -> None: ...  # x is the state after STEP (and its norm / readout entry)


def walk(plan: DepthPlan, steps: Iterable[LayerStep], ops: TripOps, x: Any) -> Any:
    """X through STEPS of PLAN's trip (all of plan.trip(), or a pipeline slot's share of it)."""
    entry = None
    for step in steps:
        if step.enters_core:
            if plan.prelude_norm:
                x = ops.prelude_norm(x)
            if plan.injection:
                entry, x = x, ops.start_state(x)
            x, entry = ops.enter_core(x, entry)
        if step.injects:
            x = ops.inject(x, entry)
        x = ops.layer(step, x)
        if step.norm_after:
            x = ops.norm(x)
        if step.ends_core:
            x = readout_entry(plan, ops, x)
        ops.after(step, x)
    return x


def readout_entry(plan: DepthPlan, ops: TripOps, x: Any) -> Any:
    """The core's state as a readout's coda takes it."""
    if plan.readout_norm:
        x = ops.norm(x)
    return ops.project_readout(x) if plan.readout_projection else x


def read_out(plan: DepthPlan, ops: TripOps, x: Any) -> Any:
    """A readout apart from the trip (a draft tap inside the core): its entry, then the coda's steps."""
    return walk(plan, plan.coda_steps(), ops, readout_entry(plan, ops, x))
