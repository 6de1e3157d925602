"""Pass infrastructure: the state passes hand on, a registry of named passes, and the runner.

A pass is a function `state -> state` registered under a name and a phase. The build driver lists
the pipeline explicitly (see PIPELINE in speedc/build.py); this module only knows how to run a list,
time each pass, and optionally dump the graphs after chosen passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs
import torch

from speedc.models.config import ModelConfig

PassFn = Callable[["CompileState"], "CompileState"]


@dataclass
class BuildOptions:
    slots: int | None = None  # None: the schedule pass chooses
    dtype: str = "fp32"  # fp32 | fp16 (weight storage)
    target: str = "onnx"  # onnx | trt
    exit_layer: int | None = None  # override the checkpoint's exit point
    alpha: float | None = None  # expected acceptance for the schedule's cost model; None: from training metrics


@dataclass
class CompileState:
    cfg: ModelConfig
    tensors: dict[str, torch.Tensor]
    options: BuildOptions = field(default_factory=BuildOptions)
    has_speedc_section: bool = True  # False: plain HF checkpoint, sharing and exit come from analysis
    acceptance_hint: float | None = None  # exit/final top-1 agreement measured in training, if known
    graphs: dict[str, gs.Graph] = field(default_factory=dict)
    layer_map: list[int] | None = None  # derived from the weights by the share pass
    exit_layer: int | None = None  # logical layers before the early-exit head (share pass decides)
    exit_norm: str | None = None  # initializer name of the exit head's RMSNorm weight
    schedule: "object | None" = None  # passes.schedule.Schedule
    weight_parts: dict[str, list] = field(default_factory=dict)  # stacked weight -> [(part, first row, rows)]
    notes: list[str] = field(default_factory=list)


@dataclass
class RegisteredPass:
    name: str
    phase: str
    fn: PassFn
    doc: str


PASSES: dict[str, RegisteredPass] = {}


def register_pass(name: str, *, phase: str) -> Callable[[PassFn], PassFn]:
    def wrap(fn: PassFn) -> PassFn:
        PASSES[name] = RegisteredPass(name, phase, fn, (fn.__doc__ or "").strip().splitlines()[0])
        return fn

    return wrap


@dataclass
class PassReport:
    name: str
    phase: str
    seconds: float
    nodes: dict[str, int]
    initializer_bytes: dict[str, int]


def graph_stats(graph: gs.Graph) -> tuple[int, int]:
    """(node count, bytes of distinct initializers)."""
    seen, total = set(), 0
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant) and tensor.name not in seen:
            seen.add(tensor.name)
            total += tensor.values.nbytes
    return len(graph.nodes), total


def run_passes(state: CompileState, names: list[str], *, dump_after: set[str] | None = None,
               dump_dir: Path | None = None, on_pass: Callable[[PassReport], None] | None = None
               ) -> tuple[CompileState, list[PassReport]]:
    reports = []
    for name in names:
        registered = PASSES[name]
        start = time.perf_counter()
        state = registered.fn(state)
        elapsed = time.perf_counter() - start
        stats = {g: graph_stats(graph) for g, graph in state.graphs.items()}
        report = PassReport(name, registered.phase, elapsed, {g: s[0] for g, s in stats.items()},
                            {g: s[1] for g, s in stats.items()})
        reports.append(report)
        if on_pass:
            on_pass(report)
        if dump_after and name in dump_after and dump_dir is not None:
            dump_graphs(state, name, dump_dir)
    return state, reports


def dump_graphs(state: CompileState, after: str, dump_dir: Path) -> list[Path]:
    """Write each graph as ONNX (weights inline) to DUMP_DIR/after-{pass}-{graph}.onnx."""
    import onnx

    dump_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for graph_name, graph in state.graphs.items():
        path = dump_dir / f"after-{after}-{graph_name}.onnx"
        onnx.save(gs.export_onnx(graph.copy()), str(path))
        written.append(path)
    return written
