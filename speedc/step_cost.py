"""c(P) of an artifact, measured on the machine at hand: what `speedc build` stores in the manifest
and `speedc inspect --measure` shows, so predicted speedups rest on a measurement, not an assumption.

c(P) = (time of one full P-slot step) / (time of one plain token / P), interleaved medians
(speedc/bench/run.py measure_step_cost, the same routine `speedc bench` reports).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from speedc.runtimes.backends.protocol import resolve_threads

MEASURE_CONTEXT = 256  # cache rows of the measured step (prompt + generation of a short request)
MEASURE_REPEATS = 100


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
                     context: int = MEASURE_CONTEXT, repeats: int = MEASURE_REPEATS) -> dict | None:
    """{slots, step_cost, ...} for the artifact in DIRECTORY; None for a plain engine (P = 1)."""
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
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
