"""The step timer: c(P) of an artifact, measured on the machine at hand: what `speedc build` stores in the manifest
and `speedc inspect --measure` shows, so predicted speedups rest on a measurement, not an assumption.

c(P) = (time of one full P-slot step) / (time of one plain token / P), interleaved medians
(measure_step_cost below, the same routine `speedc bench` reports). Beside it, what the
runtime itself measures while decoding (runtimes/step_costs.py, what its speculation policy decides
with): a plain and a speculating generation over a pool of the same length, their steps timed as they run.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from speedc.runtimes.backends.protocol import resolve_threads

MEASURE_CONTEXT = 256  # cache rows of the measured step (prompt + generation of a short request)
MEASURE_REPEATS = 100
# At most this long timing rounds (after MIN_ROUNDS): a real-size bf16 model's round (a step and a plain
# token) takes about 0.8 s on 2 cores, so 100 rounds made the build's measurement longer than the build.
MEASURE_SECONDS = 10.0
MIN_ROUNDS = 9
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
    from speedc.runtimes.engine import Engine

    engine = Engine.load(directory, backend=backend, threads=threads, verify=False)
    slots = engine.manifest.slots
    if slots == 1:
        return None
    context = min(context, engine.manifest.dims.max_context)
    cost = measure_step_cost(engine, context=context, repeats=repeats, seconds=MEASURE_SECONDS)
    return {"slots": slots, "step_cost": round(cost, 3), "context": context, "backend": engine.backend_name,
            "threads": resolve_threads(threads), "machine": machine_description(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **({"runtime": runtime_step_costs(engine, context)} if runtime else {})}


def interleaved_medians(*runs, repeats: int, warmup: int, seconds: float | None = None) -> tuple[float, ...]:
    """Median seconds of each of RUNS (callables), run in turn, round after round (a slow stretch of a
    shared machine hits them alike), after WARMUP untimed rounds; REPEATS timed rounds, or fewer (at
    least MIN_ROUNDS) once the timed rounds have taken SECONDS."""
    times: list[list[float]] = [[] for _ in runs]
    timed_from = None
    for round_ in range(warmup + repeats):
        if round_ == warmup:
            timed_from = time.perf_counter()
        elif (seconds is not None and timed_from is not None and round_ - warmup >= MIN_ROUNDS
              and time.perf_counter() - timed_from > seconds):
            break
        for run, kept in zip(runs, times):
            start = time.perf_counter()
            run()
            if round_ >= warmup:
                kept.append(time.perf_counter() - start)
    return tuple(statistics.median(kept) for kept in times)


def measure_step_times(backend, context: int, repeats: int = 200, seconds: float | None = None) -> tuple[float, float]:
    """(seconds of one full P-slot step, seconds of one plain token) of one sequence on BACKEND (a batch
    backend), both at a cache of `context` rows with the newest position in the middle, interleaved, medians."""
    from speedc.runtimes.backends.protocol import HeadRows

    slots = backend.slots
    context = max(context, 2 * slots)  # the oldest slot's position is >= 0 (a 5-token bench went negative)
    backend.reserve(context, 1)
    newest = context // 2
    positions = np.arange(newest, newest - slots, -1).reshape(slots, 1)  # [P, 1]: newest first
    filled = np.ones((slots, 1), dtype=bool)  # [P, 1]
    heads = HeadRows(final=[slots - 1], exit=[0])  # the oldest slot's final head, slot 0's draft
    token = np.ones(1, np.int64)  # [1]
    return interleaved_medians(lambda: backend.speed_step(token, positions, filled, heads, False),
                               lambda: backend.plain_step(token, positions[0], filled[0], False), repeats=repeats, warmup=5,
                               seconds=seconds)


def measure_step_cost(engine_or_backend, context: int, repeats: int = 200, seconds: float | None = None) -> float:
    """c(P): a full P-slot step against P single-slot stage passes (one plain token / P), SECONDS at most
    of timed rounds (interleaved_medians)."""
    backend = getattr(engine_or_backend, "backend", engine_or_backend)
    if backend.slots == 1:
        return 1.0
    step, token = measure_step_times(backend, context, repeats, seconds)
    return step / (token / backend.slots)


def runtime_step_costs(engine, context: int) -> dict:
    """The runtime's own measurement (StepCosts.report's row) for one sequence over a pool of CONTEXT positions:
    a plain generation and one speculating at every step, RUNTIME_NEW_TOKENS tokens each after a prompt of
    random ids filling the rest (greedy; the runtime times every decode step, its warm-up excluded)."""
    from speedc.runtimes.step_costs import context_band

    new_tokens = max(min(RUNTIME_NEW_TOKENS, context // 2), 8)
    prompt = [(7919 * i + 13) % engine.manifest.dims.vocab_size for i in range(max(context - new_tokens, 1))]
    for mode in ("autoregressive", "speed-always"):
        engine.generate(prompt, max_new_tokens=new_tokens, mode=mode, stop_at_eos=False)
    report = engine.step_costs().report()
    band = context_band(engine.backend.pool.length)
    row = next((r for r in report["measured"] if r["sequences"] == 1 and r["context_band"] == band), {})
    return {"new_tokens": new_tokens, "pool_length": engine.backend.pool.length, **row}
