"""Pass infrastructure: the state passes hand on, a registry of named passes, and the runner.

A pass is a function `state -> state` registered under a name and a phase, with the facts about the
state it REQUIRES, PROVIDES and CONSUMES (FACTS below). The runner checks them before each pass, so a
removed or reordered pass is a one-line BuildError naming what is missing and who should have
provided it, never a KeyError deep inside a pass. The build driver lists the pipeline explicitly
(PIPELINE in speedc/build.py); this module only knows how to run a list, time each pass, and
optionally dump the graphs after chosen passes.

This module imports no torch: the checkpoint's tensors are TensorSources (byte ranges of its files).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx_graphsurgeon as gs

from speedc.errors import BuildError
from speedc.models.config import ModelConfig
from speedc.format.depth_plan import DepthPlan
from speedc.models.checkpoint.tensor_source import TensorSource
from speedc.format.graph_values import constant_nbytes
from speedc.cost_model import Schedule

PassFn = Callable[["CompileState"], "CompileState"]

# What a pass can rely on about the state. Passes declare these; the runner keeps the set current.
FACTS: dict[str, str] = {
    "decode_program": "the traced N-layer decode program (graph 'decode')",
    "separate_projections": "one Gemm per q/k/v/gate/up projection",
    "layer_map": "the layer map, its depth plan and the early-exit point derived from the weights",
    "schedule": "the pipeline schedule (P, slot -> layers)",
    "programs": "the prefill graph and (P > 1) the batch step graph (many sequences' pipelines per step)",
    "layer_presents": "per-layer present.key/value outputs of the prefill and batch step graphs",
    "heads": "the final and early-exit heads with in-graph argmax",
    "cache_io": "cache inputs in the runtime's layout and stacked new_key/new_value outputs",
    "fused_attention": "the ONNX Runtime graph variants with fused GroupQueryAttention",
    "fused_projections": "sibling projections stacked into one Gemm",
    "clean": "folded, dead-code-free, toposorted graphs in their storage precision",
    "quantized_weights": "weights stored block-quantized for --weights int8/int4 (MatMulNBits, GatherBlockQuantized)",
    "engine_graph": "one engine graph per variant holding the programs as If branches (the artifact's graphs)",
    "native_graphs": "each engine graph's twin whose weight products run speedc's kernel (int8/int4)",
    "native_attention": "the fused engine graph's twin attends on speedc's kernel over the runtime's float16 KV pool",
}


@dataclass
class BuildOptions:
    slots: int | None = None  # None: the schedule pass chooses
    dtype: str | None = None  # weight storage: fp32 | fp16 | bf16 | int8 | int4; None: the checkpoint's own 16-bit precision, else fp32
    block_size: int = 32  # int8 / int4: weights per quantization block (passes/block_quant.py)
    head_dtype: str | None = None  # int8 / int4: the embedding / LM head's precision (None: dtype's)
    target: str = "onnx"  # onnx | trt
    exit_layer: int | None = None  # override the checkpoint's exit point
    alpha: float | None = None  # expected acceptance for the schedule's cost model; None: from training metrics
    eos_token_id: int | None = None  # override the checkpoint's end-of-text id
    recurrence: int | None = None  # the core's repeat count R (a recurrent-depth model, e.g. Huginn); None: the checkpoint's
    state_init: str | None = None  # a recurrent core's start state: "zero" | "random" (drawn per position); None: zero
    state_seed: int = 0  # with state_init "random": the draws' seed


@dataclass
class CompileState:
    cfg: ModelConfig
    weights: dict[str, TensorSource]  # checkpoint tensor name -> where its bytes are (nothing loaded)
    options: BuildOptions = field(default_factory=BuildOptions)
    has_speedc_section: bool = True  # False: plain HF checkpoint, sharing and exit come from analysis
    acceptance_hint: float | None = None  # exit/final top-1 agreement measured in training, if known
    graphs: dict[str, gs.Graph] = field(default_factory=dict)
    native_graphs: dict[str, gs.Graph] = field(default_factory=dict)  # engine graph -> its native twin (native_products)
    native_artifact_id: str | None = None  # the id the twins' products name this artifact's weights by
    native_cache: dict[str, str] = field(default_factory=dict)  # engine graph -> its twin's KV pool dtype (native_attention)
    exit_layer: int | None = None  # logical layers before the early-exit head (share pass decides)
    exit_norm: str | None = None  # initializer name of the exit head's RMSNorm weight
    # The phases of a token's trip over the layer map the share pass derived from the weights (cfg.depth_plan:
    # what config.json declares and the decode program was traced with).
    depth_plan: DepthPlan | None = None
    schedule: Schedule | None = None  # the schedule pass decides
    weight_parts: dict[str, list] = field(default_factory=dict)  # stacked weight -> [(part, first row, rows)]
    weight_aliases: dict[str, str] = field(default_factory=dict)  # a model tensor share merged away -> the one holding its values
    notes: list[str] = field(default_factory=list)
    facts: set[str] = field(default_factory=set)  # FACTS that hold now (kept by run_passes)
    consumed_by: dict[str, str] = field(default_factory=dict)  # fact -> the pass that consumed it

    @property
    def layer_map(self) -> list[int] | None:
        """The layer map the share pass derived from the weights: its depth plan's (None before share)."""
        return None if self.depth_plan is None else self.depth_plan.layer_map


@dataclass
class RegisteredPass:
    name: str
    phase: str
    fn: PassFn
    doc: str
    requires: tuple[str, ...]
    provides: tuple[str, ...]
    consumes: tuple[str, ...]


PASSES: dict[str, RegisteredPass] = {}


def register_pass(name: str, *, phase: str, requires: tuple[str, ...] = (), provides: tuple[str, ...] = (),
                  consumes: tuple[str, ...] = ()) -> Callable[[PassFn], PassFn]:
    unknown = sorted(set(requires + provides + consumes) - set(FACTS))
    if unknown:
        raise ValueError(f"pass {name}: unknown facts {unknown} (declare them in passes/base.py FACTS)")

    def wrap(fn: PassFn) -> PassFn:
        PASSES[name] = RegisteredPass(name, phase, fn, (fn.__doc__ or "").strip().splitlines()[0],
                                      tuple(requires), tuple(provides), tuple(consumes))
        return fn

    return wrap


def providers_of(fact: str) -> list[str]:
    return [p.name for p in PASSES.values() if fact in p.provides]


def require_facts(state: CompileState, needed: tuple[str, ...] | set[str], who: str) -> None:
    """BuildError naming the first fact in NEEDED that does not hold, and why."""
    for fact in needed:
        if fact in state.facts:
            continue
        if fact in state.consumed_by:
            why = f"pass {state.consumed_by[fact]} ran before it and consumed them (a pass is out of order)"
        else:
            makers = " or ".join(providers_of(fact)) or "no registered pass"
            why = f"no earlier pass provided them (pass {makers} is missing or runs after it)"
        raise BuildError(f"{who} needs {FACTS[fact]}, but {why}")


@dataclass
class PassReport:
    name: str
    phase: str
    seconds: float
    nodes: dict[str, int]
    initializer_bytes: dict[str, int]


def graph_stats(graph: gs.Graph) -> tuple[int, int]:
    """(node count, bytes of distinct initializers), subgraphs (an engine graph's branches) included."""
    seen, total, nodes = set(), 0, 0
    for part in (graph, *graph.subgraphs(recursive=True)):
        nodes += len(part.nodes)
        for tensor in part.tensors().values():
            if isinstance(tensor, gs.Constant) and tensor.name not in seen:
                seen.add(tensor.name)
                total += constant_nbytes(tensor)
    return nodes, total


def run_passes(state: CompileState, names: list[str], *, dump_after: set[str] | None = None,
               dump_dir: Path | None = None, on_pass: Callable[[PassReport], None] | None = None
               ) -> tuple[CompileState, list[PassReport]]:
    reports = []
    for name in names:
        registered = PASSES.get(name)
        if registered is None:
            raise BuildError(f"no such pass {name!r} (registered: {', '.join(PASSES)})")
        require_facts(state, registered.requires, f"pass {name}")
        start = time.perf_counter()
        state = registered.fn(state)
        elapsed = time.perf_counter() - start
        state.facts |= set(registered.provides)
        for fact in registered.consumes:
            state.facts.discard(fact)
            state.consumed_by[fact] = name
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
