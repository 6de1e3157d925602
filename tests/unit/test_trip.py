"""models/trip.py: the one walker of a token's path. A recording stand-in for the ops shows, per plan kind,
what runs between the layers and in which order (the reference model, the trace, the phase-step program
and the PyTorch backend all walk with their own ops; tests/numeric checks their numbers)."""

from __future__ import annotations

from speedc.format.depth_plan import DepthPlan
from speedc.models.trip import read_out, walk


class Recorder:
    """TripOps that write down each call; the state is the list of what has happened to it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _do(self, name: str, x):
        self.calls.append(name)
        return x

    def layer(self, step, x):
        return self._do(f"L{step.layer}:b{step.block}", x)

    def norm(self, x):
        return self._do("norm", x)

    def prelude_norm(self, x):
        return self._do("prelude_norm", x)

    def start_state(self, entry):
        return self._do("start", entry)

    def inject(self, x, entry):
        return self._do("inject", x)

    def project_readout(self, x):
        return self._do("project", x)

    def enter_core(self, x, entry):
        self.calls.append("enter")
        return x, entry

    def after(self, step, x) -> None:
        pass


def walked(plan: DepthPlan, steps=None) -> list[str]:
    ops = Recorder()
    walk(plan, plan.trip() if steps is None else steps, ops, None)
    return ops.calls


def test_a_looped_plan_norms_after_each_repeat():  # Ouro, Nanbeige
    plan = DepthPlan((), (0, 1), 2, loop_norm=True)
    assert walked(plan) == ["enter", "L0:b0", "L1:b1", "norm", "L2:b0", "L3:b1", "norm"]
    assert walked(DepthPlan((), (0, 1), 2)) == ["enter", "L0:b0", "L1:b1", "L2:b0", "L3:b1"]


def test_an_injecting_plan_reads_e_at_every_repeat_and_norms_at_the_readout():  # Huginn
    plan = DepthPlan((0,), (1, 2), 2, (3,), injection="adapter-concat", readout_norm=True)
    assert walked(plan) == ["L0:b0", "start", "enter", "inject", "L1:b1", "L2:b2", "inject", "L3:b1", "L4:b2", "norm",
                            "L5:b3"]


def test_a_normed_prelude_and_a_projected_readout():  # Parcae
    plan = DepthPlan((0,), (1,), 2, (2,), injection="diagonal-decay", prelude_norm=True, readout_projection=True)
    assert walked(plan) == ["L0:b0", "prelude_norm", "start", "enter", "inject", "L1:b1", "inject", "L2:b1", "project",
                            "L3:b2"]
    ops = Recorder()
    read_out(plan, ops, None)  # a draft tap's readout: its entry, then the coda
    assert ops.calls == ["project", "L3:b2"]


def test_a_pipeline_slot_walks_the_prelude_and_one_stage():
    plan = DepthPlan((0,), (1, 2), 4, (3,), loop_norm=True)
    pipeline = plan.pipeline(2, draft_layer=3)
    assert [step.layer for step in pipeline.entry_steps()] == [0, 1, 2, 3, 4]
    # the stage holds whole repeats and ends before the core does: no readout entry inside it
    assert walked(plan, pipeline.entry_steps()) == ["L0:b0", "enter", "L1:b1", "L2:b2", "norm", "L3:b1", "L4:b2", "norm"]
