"""`speedc inspect`: what a checkpoint or artifact is, and what SPEED will do with it.

The predicted speedup is the analytic bound P / (c(P) (1 + (1 - alpha)(P - 1))) (speedc/cost_model.py).
Each input is labelled with where it comes from: c(P) measured on a machine (stored at build, or
measured now with --measure) or the cost model's assumption; alpha from training metrics, the
--alpha option, or the default assumption.
"""

from __future__ import annotations

import json
from pathlib import Path

from speedc.format.artifact import MANIFEST, read_manifest
from speedc.errors import SpeedcError
from speedc.models.checkpoint.files import CONFIG_FILE, TRAINING_FILE
from speedc.cost_model import ALPHA_GRID, DEFAULT_ALPHA, analytic_bound, assumed_step_cost, describe_assumed_step_cost


def _from_checkpoint(path: Path, alpha: float | None) -> dict:
    from speedc.models.checkpoint.torch_io import open_checkpoint
    from speedc.models.checkpoint.files import acceptance_hint_from_training, has_speedc_section, token_id_sources
    from speedc.passes import schedule, share, trace  # noqa: F401  (importing registers the passes)
    from speedc.models.families import family_of
    from speedc.passes.base import BuildOptions, CompileState, graph_stats, run_passes

    cfg, weights = open_checkpoint(path)
    raw = json.loads((path / CONFIG_FILE).read_text())
    state = CompileState(cfg, weights, BuildOptions(alpha=alpha), has_speedc_section=has_speedc_section(path),
                         acceptance_hint=acceptance_hint_from_training(path))
    state, _ = run_passes(state, ["trace", "share", "schedule"])
    stored = sum(w.numel * 4 for w in weights.values())
    return {"kind": "checkpoint", "path": str(path), "model": cfg.describe(), "layer_map": state.layer_map,
            "exit_layer": state.exit_layer, "schedule": state.schedule.to_json(),
            "alpha_source": "--alpha" if alpha is not None else (
                f"measured in training ({TRAINING_FILE})" if state.acceptance_hint is not None else "default assumption"),
            "architecture": cfg.architecture,
            "token_ids": {"bos": cfg.bos_token_id, "eos": cfg.eos_token_id, "eos_all": list(cfg.eos_token_ids),
                          "from": token_id_sources(path)},
            "sizes": {"checkpoint weights (fp32)": stored,
                      "distinct weights (fp32)": graph_stats(state.graphs["decode"])[1]},
            "config_notes": family_of(raw).notes(raw), "notes": state.notes}


def _from_artifact(path: Path, alpha: float | None, verify: bool) -> dict:
    """VERIFY: hash every file against the manifest; without it, what every load checks (read_manifest)."""
    m = read_manifest(path, verify_hashes=verify)
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    quantization = m.store.quantization
    stored_label = "weights stored" + (f" ({m.dtype}, block {quantization['block_size']}: codes + scales)" if quantization
                                       else f" ({m.dtype})")
    sizes = {"unique weights (fp32)": m.store.unique_bytes_fp32, stored_label: m.store.stored_bytes,
             "an unrolled export would store (fp32)": m.store.unrolled_bytes_fp32,
             **{f"file {name}": size for name, size in files.items()}}
    return {"kind": "artifact", "path": str(path), "format_version": m.format_version, "speedc_version": m.speedc_version,
            "model": m.model, "layer_map": m.layer_map, "exit_layer": m.exit_layer, "schedule": m.schedule,
            "alpha_source": "--alpha" if alpha is not None else "the schedule's expected acceptance",
            "dtype": m.dtype, "quantization": quantization, "target": m.target, "sizes": sizes,
            "step_cost_measured": m.build.get("step_cost_measured"),
            "graphs": {name: {"inputs": len(g["inputs"]), "outputs": len(g["outputs"]),
                              **({"native_file": g["native_file"]} if "native_file" in g else {}),
                              **({"native_cache": g["native_cache"]} if "native_cache" in g else {})}
                       for name, g in m.graphs.items()},
            "notes": m.build.get("notes", []), "files_verified": verify,
            **({"kernel_here": _kernel_here()} if any("native_file" in g for g in m.graphs.values()) else {})}


def _kernel_here() -> dict:
    """The paths of speedc's product kernel on this CPU and the one the runtime takes (building the kernel
    on first use), or why it cannot run here."""
    from speedc.runtimes.kernels import native

    kernel = native.load()
    if kernel is None:
        return {"path": None, "why": native.unavailable_reason()}
    return {"path": kernel.path, "paths": [p for p in kernel.paths if p not in native.STAND_INS]}


def prediction(info: dict, alpha: float | None, measured: dict | None) -> dict:
    """The predicted speedup of the chosen P and where each input of the bound comes from."""
    sched = info["schedule"]
    slots = sched["slots"]
    alpha = sched["alpha"] if alpha is None else alpha
    is_measured = True
    if slots == 1:
        cost, source = 1.0, "plain engine (P = 1): nothing to amortise"
    elif measured and measured.get("slots") == slots:
        cost = measured["step_cost"]
        source = (f"measured {measured.get('when', 'at build')} on {measured['machine']} ({measured['backend']}, "
                  f"{measured['threads']} threads, context {measured['context']}, {measured['measured_at']})")
    else:
        cost, source = assumed_step_cost(slots), f"{describe_assumed_step_cost()}: an assumption, not measured"
        is_measured = False
    return {"slots": slots, "step_cost": cost, "step_cost_source": source, "alpha": alpha,
            "alpha_source": info.get("alpha_source", ""), "speedup_bound": round(analytic_bound(slots, alpha, cost), 3),
            "by_alpha": {f"{a:.2f}": round(analytic_bound(slots, a, cost), 3) for a in ALPHA_GRID},
            "measured": is_measured}


def describe(path: Path, alpha: float | None = None, *, measure: bool = False, verify: bool = False) -> dict:
    path = Path(path)
    if (path / MANIFEST).exists():
        info = _from_artifact(path, alpha, verify)
        measured = info["step_cost_measured"]
        if measure:
            from speedc.step_timer import measure_artifact

            measured = measure_artifact(path, runtime=True)
            if measured is not None:
                measured["when"] = "now (inspect --measure)"
            info["step_cost_measured_now"] = measured
    elif (path / CONFIG_FILE).exists():
        if verify:
            raise SpeedcError(f"{path}: --verify checks an artifact's files against its manifest; a checkpoint has none")
        if measure:
            raise SpeedcError(f"{path}: --measure times a compiled step graph; build the checkpoint first "
                              "(speedc build CHECKPOINT -o OUT)")
        info, measured = _from_checkpoint(path, alpha), None
    else:
        raise SpeedcError(f"{path}: neither a speedc artifact ({MANIFEST}) nor a checkpoint ({CONFIG_FILE})")
    info["prediction"] = prediction(info, alpha, measured)
    if info["prediction"]["alpha_source"] == "default assumption":
        info["prediction"]["alpha_source"] = f"default assumption ({DEFAULT_ALPHA})"
    return info


def depths_line(slots: int, measured: dict | None) -> str:
    """Which pipeline depths the artifact's engine graph runs (and, measured here, what each costs)."""
    if slots == 1:
        return "depths held: P = 1 only (plain engine)"
    runtime = (measured or {}).get("runtime") or {}
    cost = (f": a plain token {runtime['plain_ms']:.2f} ms, a full P={slots} step {runtime['full_ms']:.2f} ms here"
            if "plain_ms" in runtime and "full_ms" in runtime else " (--measure: what each costs here)")
    shallower = [d for d in range(slots - 1, 1, -1) if slots % d == 0]
    spaced = (f"; its slots also run as a pipeline of depth {', '.join(map(str, shallower))} (entries spaced, "
              "same program)" if shallower else "")
    return (f"depths held: P = {slots} (the batch step program) and P = 1 (plain tokens: the prefill program), "
            f"over one copy of the weights{spaced}; `--mode speed` runs whichever pays on the host{cost}")


def schedule_diagram(slots: int, steps: int) -> list[str]:
    """Rows = slots, columns = steps of a full pipeline (no mispredictions): which token each slot holds."""
    lines = []
    for s in range(slots):
        cells = []
        for t in range(steps):
            pos = t - s
            cells.append(f"x{pos}".rjust(4) if pos >= 0 else "   .")
        tail = "  <- enters (speculated by slot 0's exit head)" if s == 0 else (
            "  -> leaves: final head verifies" if s == slots - 1 else "")
        lines.append(f"slot {s}: " + " ".join(cells) + tail)
    return lines


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


def render(info: dict) -> None:
    from rich.console import Console

    console = Console()
    sched = info["schedule"]
    console.print(f"[bold]{info['kind']}[/bold] {info['path']}")
    model = info["model"]
    if isinstance(model, dict):  # an artifact's manifest dims
        model = (f"{model.get('architecture', 'llama')}: N={model['num_layers']} layers over "
                 f"{model.get('num_unique_blocks', '?')} unique blocks, hidden "
                 f"{model['hidden_size']}, {model['num_kv_heads']} kv heads x {model['head_dim']}, vocab "
                 f"{model['vocab_size']}, context {model['max_context']}, eos "
                 f"{'/'.join(map(str, model.get('eos_token_ids') or [model['eos_token_id']]))}")
    console.print(f"model: {model}")
    if "token_ids" in info:
        ids = info["token_ids"]
        console.print(f"architecture {info['architecture']}; token ids: bos {ids['bos']} (from {ids['from']['bos_token_id']}), "
                      f"eos {'/'.join(map(str, ids.get('eos_all') or [ids['eos']]))} (from {ids['from']['eos_token_id']}); "
                      "`speedc build --eos-token-id` overrides")
    for note in info.get("config_notes", []):
        console.print(f"config: {note}")
    console.print(f"layer map: {info['layer_map']}  (exit after layer {info['exit_layer']})")
    if info["kind"] == "artifact":
        _render_weights(console, info)
    _render_schedule(console, sched)
    _render_depth_rules(console, info, sched)
    _render_prediction(console, info, sched)
    _render_tables(console, info, sched)


def _render_weights(console, info: dict) -> None:
    """An artifact's weights: storage, the products' kernel on this CPU, the files' check."""
    q = info.get("quantization")
    stored = next(v for k, v in info["sizes"].items() if k.startswith("weights stored"))
    unique = info["sizes"]["unique weights (fp32)"]
    head = f" (embedding / LM head {q['head_bits']}-bit)" if q and q.get("head_bits", q["bits"]) != q["bits"] else ""
    how = (f"block-quantized, {q['bits']}-bit codes{head}, block {q['block_size']}, one fp32 scale per block, "
           f"accuracy level {q['accuracy_level']} (MatMulNBits)" if q else "float")
    console.print(f"weights: {info['dtype']} ({how}): {_megabytes(stored)} stored once, "
                  f"{stored / max(unique, 1):.3f} x the unique fp32 bytes")
    twins = [g["native_file"] for g in info["graphs"].values() if "native_file" in g]
    if twins:
        console.print(f"products: speedc's int8 kernel where it loads ({', '.join(twins)}: the same graphs with the "
                      "products as SpeedcBlockProduct, reading weights.bin in place), else ONNX Runtime's MatMulNBits")
        caches = {g["native_cache"] for g in info["graphs"].values() if "native_cache" in g}
        if caches:
            console.print(f"attention: on the same kernel where it loads, over a {', '.join(sorted(caches))} KV-cache pool "
                          "(SpeedcAttention), else ONNX Runtime's GroupQueryAttention over a float32 one")
        here = info["kernel_here"]
        console.print(f"  on this CPU: the kernel's {here['path']} path (it runs {', '.join(here['paths'])})" if here["path"]
                      else f"  on this CPU: MatMulNBits (the kernel cannot load: {here['why']})")
    console.print("files: every one present and its sha256 the manifest's" if info.get("files_verified") else
                  "files: every one present at its recorded size, the small ones by sha256, as every load checks "
                  "(--verify: every file's sha256, weights.bin too)")


def _render_depth_rules(console, info: dict, sched: dict) -> None:
    """What a request may choose of the depth (runtimes/exit_rule.py), where the plan allows it."""
    from speedc.format.depth_plan import DepthPlan

    plan = sched["depth_plan"]
    loops, slots = plan["repeats"], sched["slots"]
    if DepthPlan.from_json(plan).recurrent:
        console.print(f"depth rules per request: loops 1..{loops} (the core's repeats, Huginn's num_steps; {loops // slots} "
                      "a pipeline slot)" if slots > 1 else
                      "depth rules per request: none in a plain build (P = 1); loops needs the pipeline (--slots)")
        return
    if not plan.get("loop_exits"):
        return
    gate = "" if info["kind"] != "artifact" else (
        ", exit_threshold and weighted_exit (its exit gate is stored)" if "exit_gate" in info["model"] else
        " (no exit gate stored: exit_threshold and weighted_exit are refused)")
    console.print(f"depth rules per request: loops 1..{loops}, exit_at_step 0..{loops - 1}{gate}; they run with one loop "
                  f"a slot (P = {loops})" + ("" if slots == loops else f": not this artifact's P={slots}"))


def _render_schedule(console, sched: dict) -> None:
    from speedc.format.depth_plan import DepthPlan

    console.print(f"depth plan: {DepthPlan.from_json(sched['depth_plan']).describe()}")
    console.print(f"schedule: P={sched['slots']} slots x S={sched['stage_layers']} layers; {sched['reason']}")
    for s, layers in enumerate(sched["slot_layers"]):
        console.print(f"  slot {s}: logical layers {layers[0]}..{layers[-1]} (blocks {sched['stage_blocks']})")
    if sched["slots"] > 1:
        console.print("pipeline (steps ->):")
        for line in schedule_diagram(sched["slots"], sched["slots"] + 3):
            console.print("  " + line)


def _render_prediction(console, info: dict, sched: dict) -> None:
    pred = info["prediction"]
    if info["kind"] == "artifact":
        console.print(depths_line(sched["slots"], info.get("step_cost_measured_now")))
    console.print(f"step cost c(P={pred['slots']}) = {pred['step_cost']:.2f}: {pred['step_cost_source']}")
    runtime = (info.get("step_cost_measured_now") or {}).get("runtime") or {}
    if "step_cost" in runtime:
        console.print(f"the runtime timing its own steps while decoding (pool of {runtime['pool_length']} positions, "
                      f"{runtime['new_tokens']} tokens plain and speculating): c(P) = {runtime['step_cost']:.2f} "
                      f"(full step {runtime['full_ms']:.2f} ms, plain token {runtime['plain_ms']:.2f} ms); its mean "
                      f"step, refills included, {runtime['mean_step_cost']:.2f}: what `--mode speed` decides with")
    console.print(f"predicted speedup over plain decoding (analytic bound; a miss costs P-1 steps, early flush can do "
                  f"better) at alpha {pred['alpha']:.2f} "
                  f"({pred['alpha_source']}): [bold]{pred['speedup_bound']:.2f}x[/bold]"
                  + ("" if pred["measured"] else "  [yellow](assumed c(P): run `speedc inspect ART --measure` or "
                                                 "`speedc bench artifact ART` for this machine's)[/yellow]"))


def _render_tables(console, info: dict, sched: dict) -> None:
    from rich.table import Table

    pred = info["prediction"]
    by_alpha = Table(title=f"predicted speedup at P={pred['slots']}, c(P) = {pred['step_cost']:.2f} "
                           f"({'measured' if pred['measured'] else 'assumed'}), by acceptance alpha")
    for a in pred["by_alpha"]:
        by_alpha.add_column(f"a={a}")
    by_alpha.add_row(*[f"{v:.2f}x" for v in pred["by_alpha"].values()])
    console.print(by_alpha)
    if len(sched["curve"]) > 1:
        curve = Table(title=f"schedule choice: predicted speedup per valid P ({describe_assumed_step_cost()}: an assumption)")
        alphas = list(next(iter(sched["curve"].values())).keys())
        curve.add_column("P")
        for a in alphas:
            curve.add_column(f"a={a}")
        for p, row in sched["curve"].items():
            curve.add_row(str(p), *[f"{row[a]:.2f}" for a in alphas])
        console.print(curve)
    sizes = Table(title="sizes")
    sizes.add_column("what")
    sizes.add_column("bytes", justify="right")
    for name, value in info["sizes"].items():
        sizes.add_row(name, _megabytes(value))
    console.print(sizes)
