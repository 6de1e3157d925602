"""`speedc bench OUT --concurrency 1,2,4,8,16`: continuous batching under load.

For each concurrency c, c clients each submit one request at once (prompts cycled from the bench set),
and the batch runs until all are done, once per system, interleaved over the repeats:

    speed-adaptive   the default row policy (runtimes/batch.py RowPolicy): SPEED steps while the step
                     has at most row_budget rows, plain steps above
    speed-always     SPEED steps at every concurrency (no budget)
    plain-batched    plain decoding of all sequences in one graph run per token (the baseline)

Reported per (c, system): aggregate tokens/s (all new tokens / wall time, medians over repeats),
per-sequence decode ms/token p50/p99 (first token to last, over every sequence of every repeat) and
time to first token p50. Ids are checked first: every system must produce, for each prompt, exactly
the ids of plain decoding of that prompt alone (greedy).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from speedc.errors import SpeedcError
from speedc.runtimes.engine import Engine

SYSTEMS = {"speed-adaptive": -1, "speed-always": None, "plain-batched": 0}  # system -> Engine.batch_scheduler row_budget


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _run_once(engine: Engine, prompts: list[str], clients: int, new_tokens: int, row_budget, threads) -> dict:
    scheduler = engine.batch_scheduler(max_batch=clients, row_budget=row_budget, threads=threads)
    start = time.perf_counter()
    sequences = [scheduler.submit(engine.request_from(prompts[i % len(prompts)], dict(max_new_tokens=new_tokens,
                                                                                     stop_at_eos=False)))
                 for i in range(clients)]
    first, last = {}, {}
    while scheduler.busy:
        for sequence, token in scheduler.step():
            now = time.perf_counter()
            if token is not None:
                first.setdefault(sequence.id, now)
                last[sequence.id] = now
    wall = time.perf_counter() - start
    per_token = [(last[s.id] - first[s.id]) * 1e3 / (len(s.out) - 1) for s in sequences if len(s.out) > 1]
    return {"wall": wall, "tokens": sum(len(s.out) for s in sequences), "ids": [s.out for s in sequences],
            "per_token_ms": per_token, "ttft_ms": [(first[s.id] - start) * 1e3 for s in sequences],
            "steps": dict(scheduler.steps)}


def concurrency_bench(engine: Engine, prompts: list[str], levels: list[int], new_tokens: int, repeats: int,
                      threads: int | None = None, progress=lambda text: None) -> dict:
    alone = {p: engine.generate(p, max_new_tokens=new_tokens, mode="autoregressive", stop_at_eos=False).ids for p in prompts}
    rows = []
    for clients in levels:
        runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
        for repeat in range(repeats):
            for name, budget in SYSTEMS.items():  # interleaved: machine noise hits every system alike
                progress(f"concurrency {clients}: {name}, repeat {repeat + 1}/{repeats}")
                run = _run_once(engine, prompts, clients, new_tokens, budget, threads)
                expected = [alone[prompts[i % len(prompts)]] for i in range(clients)]
                if run["ids"] != expected:
                    raise SpeedcError(f"concurrency {clients}, {name}: ids differ from plain decoding alone; no speed reported")
                runs[name].append(run)
        for name, done in runs.items():
            per_token = [ms for run in done for ms in run["per_token_ms"]]
            rows.append({"clients": clients, "system": name,
                         "tokens_per_second": round(statistics.median(r["tokens"] / r["wall"] for r in done), 1),
                         "ms_per_token_p50": round(_percentile(per_token, 50), 3),
                         "ms_per_token_p99": round(_percentile(per_token, 99), 3),
                         "ttft_ms_p50": round(_percentile([t for r in done for t in r["ttft_ms"]], 50), 2),
                         "steps": done[-1]["steps"]})
    return {"artifact": str(engine.directory), "slots": engine.manifest.slots, "new_tokens": new_tokens,
            "repeats": repeats, "identical_ids": True, "concurrency": rows}


def format_concurrency(report: dict) -> str:
    lines = [f"continuous batching, {report['artifact']} (P={report['slots']}), {report['new_tokens']} new tokens per "
             f"request, median of {report['repeats']}; ids equal plain decoding alone: {report['identical_ids']}",
             f"{'clients':>7} {'system':<15} {'tokens/s':>9} {'ms/tok p50':>10} {'p99':>8} {'TTFT p50 ms':>11}  steps"]
    for row in report["concurrency"]:
        lines.append(f"{row['clients']:>7} {row['system']:<15} {row['tokens_per_second']:>9.1f} {row['ms_per_token_p50']:>10.2f} "
                     f"{row['ms_per_token_p99']:>8.2f} {row['ttft_ms_p50']:>11.1f}  {row['steps']}")
    return "\n".join(lines)
