"""`speedc bench concurrency OUT --clients 1,2,4,8,16`: continuous batching under load.

For each concurrency c, c clients each submit one request at once (prompts cycled from the bench set),
and the batch runs until all are done, once per system and level in every repeat: systems and levels
interleaved (the systems in a new seeded order each repeat, so no system always runs right after the
same one), so host drift hits them alike. Each system keeps one scheduler per level over the repeats, warmed up
once, as a server keeps its one; at a level the batched systems share one backend (pool, step
bindings) and every level the same sessions, so they differ by their policies and loads alone (every
level's pool is held at once: the bench's memory is their sum):

    speed-adaptive     the default policies: per sequence, speculate while its own acceptance keeps the
                       analytic bound above 1 (runtimes/acceptance_policy.py), per step, while the
                       speculating sequences take at most row_budget rows (runtimes/speculation.py RowPolicy)
    speed-always       SPEED steps for every sequence at every concurrency (no budget, no per-sequence rule)
    plain-batched      plain decoding of all sequences in one graph run per token (the baseline)
    speed-unbatched    (concurrency 1 only) the single-sequence engine, Engine.generate in speed mode (a
                       batch of one on the engine's own pool, always speculating), so a regression there shows
    onnxruntime-genai  (peers, when onnxruntime-genai and torch are installed) ORT GenAI's own batching,
                       og.Engine, on its builder's fp32 export of the unrolled weights (bench/peers.py)

Reported per (c, system): aggregate tokens/s (all new tokens / wall time, medians over repeats), its
scaling (tokens/s over the same system's at the fewest clients in the same repeat, median: a ratio
measured in one run), per-sequence decode ms/token p50/p99 (first token to last, over every sequence of
every repeat) and time to first token p50. Ids are checked first: every system must produce, for each prompt, exactly
the ids of plain decoding of that prompt alone (greedy).
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np

from speedc.errors import SpeedcError
from speedc.models.sampling import SamplingParams
from speedc.runtimes.speculation import MODES
from speedc.runtimes.engine import Engine

SYSTEMS = {name: {"row_budget": MODES[mode].batch_row_budget, "per_sequence": MODES[mode].per_sequence}  # -> Engine.batch_scheduler's
           for name, mode in (("speed-adaptive", "speed"), ("speed-always", "speed-always"), ("plain-batched", "autoregressive"))}
GENAI = "onnxruntime-genai"
UNBATCHED = "speed-unbatched"


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _scheduler(engine: Engine, prompts: list[str], clients: int, new_tokens: int, options: dict, backend):
    """A system's scheduler for CLIENTS on the level's shared BACKEND, kept over the repeats as a server
    keeps its one (the engine of the unbatched row is kept too), after an untimed warm-up: fresh
    sessions' first runs at each row count allocate and prepack (a first prefill measured 180 ms against
    11 ms after), and the run's shapes of step make their bindings."""
    scheduler = engine.batch_scheduler(backend=backend, **options)
    sequences = _submit(scheduler, engine, prompts, clients, new_tokens)
    scheduler.run()
    _raise_failure(sequences, clients)
    return scheduler


def _raise_failure(sequences: list, clients: int) -> None:
    """A request that could not run (its KV cache out of memory even alone) ends the bench in one line."""
    failed = next((s.error for s in sequences if s.error is not None), None)
    if failed is not None:
        raise SpeedcError(f"concurrency {clients}: {failed}")


def _submit(scheduler, engine: Engine, prompts: list[str], clients: int, new_tokens: int) -> list:
    """One greedy request per client (prompts cycled), all at once."""
    return [scheduler.submit(engine.request_from(prompts[i % len(prompts)], dict(max_new_tokens=new_tokens, stop_at_eos=False)))
            for i in range(clients)]


def _run_once(scheduler, engine: Engine, prompts: list[str], clients: int, new_tokens: int) -> dict:
    scheduler.steps, scheduler.controller.mode_switches = dict.fromkeys(scheduler.steps, 0), 0  # count this run only
    start = time.perf_counter()
    sequences = _submit(scheduler, engine, prompts, clients, new_tokens)
    first, last = {}, {}
    while scheduler.busy:
        for sequence, token in scheduler.step():
            now = time.perf_counter()
            if token is not None:
                first.setdefault(sequence.id, now)
                last[sequence.id] = now
    wall = time.perf_counter() - start
    _raise_failure(sequences, clients)
    per_token = [(last[s.id] - first[s.id]) * 1e3 / (len(s.out) - 1) for s in sequences if len(s.out) > 1]
    return {"wall": wall, "tokens": sum(len(s.out) for s in sequences), "ids": [s.out for s in sequences],
            "per_token_ms": per_token, "ttft_ms": [(first[s.id] - start) * 1e3 for s in sequences],
            "steps": {**scheduler.steps, "switches": scheduler.mode_switches}}


def _run_unbatched(engine: Engine, prompt: str, new_tokens: int) -> dict:
    """One request through the single-sequence engine (its own scheduler of one, on its own pool), timed as
    _run_once times (after the same kind of untimed warm-up)."""
    engine.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    start = time.perf_counter()
    times = []
    out = []
    for token in engine._decoding(prompt, new_tokens, "speed", SamplingParams(), stop=None, stop_at_eos=False,
                                  early_flush=None):  # greedy, token by token: the loop generate() drives
        times.append(time.perf_counter())
        out.append(token)
    wall = time.perf_counter() - start
    per_token = [(times[-1] - times[0]) * 1e3 / (len(out) - 1)] if len(out) > 1 else []
    return {"wall": wall, "tokens": len(out), "ids": [out], "per_token_ms": per_token,
            "ttft_ms": [(times[0] - start) * 1e3] if times else [], "steps": {}}


def _run_genai(batched, prompt_ids: list[list[int]], clients: int, new_tokens: int) -> dict:
    start = time.perf_counter()
    ids, times, runs, widest = batched([prompt_ids[i % len(prompt_ids)] for i in range(clients)], new_tokens)
    wall = time.perf_counter() - start
    per_token = [(last - first) * 1e3 / (len(out) - 1) for out, (first, last) in zip(ids, times) if len(out) > 1]
    return {"wall": wall, "tokens": sum(len(out) for out in ids), "ids": ids, "per_token_ms": per_token,
            "ttft_ms": [(first - start) * 1e3 for first, _ in times],
            "steps": {"runs": runs, "most_sequences_per_run": widest}}


def genai_available(engine: Engine) -> str | None:
    """Why ORT GenAI cannot join the concurrency bench on ENGINE's artifact, or None when it can."""
    from speedc.bench.peers import genai_installed, peers_available

    if not genai_installed():
        return "onnxruntime-genai is not installed (pip install 'speedc[bench]')"
    if not peers_available():
        return "its export needs torch and transformers (pip install 'speedc[dev]')"
    if engine.tokenizer is None:
        return "the artifact has no tokenizer (ORT GenAI's builder needs one)"
    return None


def concurrency_bench(engine: Engine, prompts: list[str], levels: list[int], new_tokens: int, repeats: int,
                      threads: int | None = None, peers: bool | None = None, progress=lambda text: None) -> dict:
    """PEERS: also ORT GenAI's batching (None: when it can run here; the report says why not otherwise)."""
    import tempfile
    from pathlib import Path

    alone = {p: engine.generate(p, max_new_tokens=new_tokens, mode="autoregressive", stop_at_eos=False).ids for p in prompts}
    prompt_ids = [engine.encode(p) for p in prompts]
    genai_note = genai_available(engine) if peers is not False else "not asked (--no-peers)"
    with tempfile.TemporaryDirectory() as tmp:
        genai_dir = None
        if genai_note is None:
            from speedc.bench.peers import PEERS, prepare_peers

            progress("exporting the unrolled weights with ORT GenAI's model builder")
            if GENAI in prepare_peers(engine.directory, engine.manifest, threads, Path(tmp), only=(GENAI,)):
                genai_dir = PEERS[GENAI].export_dir(Path(tmp))
            else:
                genai_note = "its export covers the Llama architecture only"
        elif peers:
            raise SpeedcError(f"--peers: ORT GenAI cannot run: {genai_note}")
        rows = _measure(engine, prompts, prompt_ids, alone, levels, new_tokens, repeats, threads, genai_dir, progress)
    return {"artifact": str(engine.directory), "slots": engine.manifest.slots, "new_tokens": new_tokens,
            "repeats": repeats, "identical_ids": True, "concurrency": rows,
            "onnxruntime_genai": "og.Engine, static batching scheduler" if genai_dir else f"not run: {genai_note}"}


def _measure(engine, prompts, prompt_ids, alone, levels, new_tokens, repeats, threads, genai_dir, progress) -> list[dict]:
    from speedc.bench.peers import genai_batched
    from speedc.runtimes.backends.onnx import make_batch_backend, row_capacity

    systems: dict[int, dict[str, object]] = {}
    own = engine.backend  # its session serves every level (and the single-sequence engine)
    for clients in dict.fromkeys(levels):
        # Per level one backend (pool, step bindings) for every batched system, and one set of sessions
        # for all levels: two sessions of one graph ran 2-4% apart here, steadily, which would read as a
        # difference between policies or between client counts.
        backend = make_batch_backend(engine.directory, engine.manifest, clients, row_capacity(engine.manifest, clients, None),
                                     device=engine.device, threads=threads, fused=own.fused, session=own.session)
        level = {}
        for name, options in SYSTEMS.items():
            progress(f"concurrency {clients}: {name}, warm-up")
            level[name] = _scheduler(engine, prompts, clients, new_tokens, options, backend)
        if clients == 1:
            level[UNBATCHED] = None
        if genai_dir is not None:
            level[GENAI] = None  # one engine for every level (below): its model is the unrolled fp32 export
        systems[clients] = level
    genai = genai_batched(genai_dir, max(systems), threads) if genai_dir is not None else None
    runs: dict[tuple[int, str], list[dict]] = {(clients, name): [] for clients, level in systems.items() for name in level}
    for repeat in range(repeats):
        for clients, level in systems.items():  # the levels interleaved too: a ratio between them is not host drift
            # A new order each repeat (seeded): a rotation would keep each system behind the same one, and the
            # one before matters: a batched system after the single-sequence engine (then on sessions of its
            # own, its own copy of the weights) started with a cold cache (speed-adaptive ran 4-20% below
            # speed-always at one client, both the same steps, when it followed the engine in 5 repeats of 7).
            names = list(level)
            random.Random(repeat * 1009 + clients).shuffle(names)
            for name in names:  # interleaved: machine noise hits every system alike
                system = level[name]
                progress(f"repeat {repeat + 1}/{repeats}: concurrency {clients}, {name}")
                if name == GENAI:
                    run = _run_genai(genai, prompt_ids, clients, new_tokens)
                elif name == UNBATCHED:
                    run = _run_unbatched(engine, prompts[0], new_tokens)
                else:
                    run = _run_once(system, engine, prompts, clients, new_tokens)
                expected = [alone[prompts[i % len(prompts)]] for i in range(clients)]
                if run["ids"] != expected:
                    raise SpeedcError(f"concurrency {clients}, {name}: ids differ from plain decoding alone; no speed reported")
                runs[clients, name].append(run)
    fewest = min(systems)
    rows = []
    for (clients, name), done in runs.items():
        rates = [r["tokens"] / r["wall"] for r in done]
        base = [r["tokens"] / r["wall"] for r in runs.get((fewest, name), [])]
        per_token = [ms for run in done for ms in run["per_token_ms"]]
        rows.append({"clients": clients, "system": name, "tokens_per_second": round(statistics.median(rates), 1),
                     # this system's rate over its own at the fewest clients, repeat by repeat (paired in time)
                     "scaling": round(statistics.median(a / b for a, b in zip(rates, base)), 3) if base else None,
                     "ms_per_token_p50": round(_percentile(per_token, 50), 3),
                     "ms_per_token_p99": round(_percentile(per_token, 99), 3),
                     "ttft_ms_p50": round(_percentile([t for r in done for t in r["ttft_ms"]], 50), 2),
                     "steps": done[-1]["steps"]})
    return rows


def format_concurrency(report: dict) -> str:
    lines = [f"continuous batching, {report['artifact']} (P={report['slots']}), {report['new_tokens']} new tokens per "
             f"request, median of {report['repeats']}; ids equal plain decoding alone: {report['identical_ids']}",
             f"ORT GenAI: {report.get('onnxruntime_genai', 'not run')}",
             f"{'clients':>7} {'system':<17} {'tokens/s':>9} {'scaling':>8} {'ms/tok p50':>10} {'p99':>8} {'TTFT p50 ms':>11}  steps"]
    for row in report["concurrency"]:
        scaling = f"{row['scaling']:.2f}x" if row.get("scaling") is not None else "-"
        lines.append(f"{row['clients']:>7} {row['system']:<17} {row['tokens_per_second']:>9.1f} {scaling:>8} "
                     f"{row['ms_per_token_p50']:>10.2f} {row['ms_per_token_p99']:>8.2f} {row['ttft_ms_p50']:>11.1f}  {row['steps']}")
    lines.append("scaling: a system's tokens/s over its own at the fewest clients, per repeat (the levels run interleaved), median")
    return "\n".join(lines)
