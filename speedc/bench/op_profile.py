"""Where a step's time goes, per op type: ONNX Runtime's profiler over the P-slot step (the batch step
graph, one sequence) and the plain token it replaces, run as `measure_step_times` runs them. Each op's step time is shown beside its
share of a plain token (token time / P), so the difference is what that op adds to c(P) - 1.

Profiled runs are slower than plain ones (the profiler records every kernel); the breakdown is for
finding what to remove, c(P) itself comes from unprofiled runs."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

from speedc.step_timer import measure_step_times


def kernel_ms_per_run(profile_file: str, program: str) -> dict[str, float]:
    """Op type -> kernel milliseconds per run of PROGRAM (contract.PREFILL / BATCH_STEP), from the engine
    session's ONNX Runtime profile: its branch's nodes are named PROGRAM/... (passes/merge_programs.py);
    a run of it is one run of each of its nodes. The If around a branch is not counted (it holds it)."""
    events = json.loads(Path(profile_file).read_text())
    totals: dict[str, float] = defaultdict(float)
    runs: dict[str, int] = defaultdict(int)  # node -> its runs
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.startswith(program + "/") and name.endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"] / 1000
            runs[name] += 1
    count = max(runs.values(), default=1)
    return {op: total / count for op, total in totals.items()}


def step_op_profile(directory: Path, manifest, *, threads: int | None, context: int, repeats: int = 30) -> list[dict]:
    """[{op, step_ms, token_share_ms}] sorted by step time: the step's kernel time per op type, and
    the plain token's divided by P."""
    from speedc.format import contract
    from speedc.runtimes.backends.onnx import BatchBackend

    with tempfile.TemporaryDirectory() as tmp:
        backend = BatchBackend(directory, manifest, 1, manifest.dims.max_context, threads=threads,
                               profile_prefix=f"{tmp}/")
        measure_step_times(backend, context, repeats)
        profile = backend.end_profiling()
        step = kernel_ms_per_run(profile, contract.BATCH_STEP)
        token = kernel_ms_per_run(profile, contract.PREFILL)
    # the warm-up runs are profiled too: per-run averages include them on both sides alike
    rows = [{"op": op, "step_ms": round(step.get(op, 0.0), 3), "token_share_ms": round(token.get(op, 0.0) / backend.slots, 3)}
            for op in set(step) | set(token)]
    return sorted(rows, key=lambda row: -row["step_ms"])
