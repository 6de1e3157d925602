"""c(P) of an artifact, measured on the machine at hand: what `speedc build` stores in the manifest
and `speedc inspect --measure` shows, so predicted speedups rest on a measurement, not an assumption.

c(P) = (time of one full P-slot step) / (time of one plain token / P), interleaved medians
(speedc/bench/run.py measure_step_cost, the same routine `speedc bench` reports). Beside it, what the
runtime itself measures while decoding (runtimes/step_costs.py, what its speculation policy decides
with): a plain and a speculating generation over a pool of the same length, their steps timed as they run.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from speedc.runtimes.backends.protocol import resolve_threads

MEASURE_CONTEXT = 256  # cache rows of the measured step (prompt + generation of a short request)
MEASURE_REPEATS = 100
RUNTIME_NEW_TOKENS = 64  # decode steps of each generation the runtime times (the rest of the context: prompt)


def machine_description() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def measure_artifact(directory: Path, *, backend: str = "onnx", threads: int | None = None,
                     context: int = MEASURE_CONTEXT, repeats: int = MEASURE_REPEATS, runtime: bool = False) -> dict | None:
    """{slots, step_cost, ...} for the artifact in DIRECTORY; None for a plain engine (P = 1). RUNTIME: also what
    the runtime measures while decoding (`runtime`: runtime_step_costs)."""
    from speedc.bench.run import measure_step_cost
    from speedc.runtimes.engine import Engine

    engine = Engine.load(directory, backend=backend, threads=threads, verify=False)
    slots = engine.manifest.slots
    if slots == 1:
        return None
    context = min(context, engine.manifest.model["max_context"])
    cost = measure_step_cost(engine, context=context, repeats=repeats)
    return {"slots": slots, "step_cost": round(cost, 3), "context": context, "backend": engine.backend_name,
            "threads": resolve_threads(threads), "machine": machine_description(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **({"runtime": runtime_step_costs(engine, context)} if runtime else {})}


def runtime_step_costs(engine, context: int) -> dict:
    """The runtime's own measurement (StepCosts.report's row) for one sequence over a pool of CONTEXT positions:
    a plain generation and one speculating at every step, RUNTIME_NEW_TOKENS tokens each after a prompt of
    random ids filling the rest (greedy; the runtime times every decode step, its warm-up excluded)."""
    from speedc.runtimes.step_costs import context_band

    new_tokens = max(min(RUNTIME_NEW_TOKENS, context // 2), 8)
    prompt = [(7919 * i + 13) % engine.manifest.model["vocab_size"] for i in range(max(context - new_tokens, 1))]
    for mode in ("autoregressive", "speed-always"):
        engine.generate(prompt, max_new_tokens=new_tokens, mode=mode, stop_at_eos=False)
    report = engine.step_costs().report()
    band = context_band(engine.backend.length)
    row = next((r for r in report["measured"] if r["sequences"] == 1 and r["context_band"] == band), {})
    return {"new_tokens": new_tokens, "pool_length": engine.backend.length, **row}
