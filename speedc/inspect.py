"""`speedc inspect`: what a checkpoint or artifact is, and what SPEED will do with it."""

from __future__ import annotations

import json
from pathlib import Path

from speedc.artifact import MANIFEST, read_manifest
from speedc.errors import SpeedcError


def _from_checkpoint(path: Path, alpha: float | None) -> dict:
    from speedc.build import acceptance_hint_from_training, has_speedc_section
    from speedc.models.checkpoint import load_checkpoint
    from speedc.passes.base import BuildOptions, CompileState, graph_stats, run_passes

    cfg, tensors = load_checkpoint(path)
    state = CompileState(cfg, tensors, BuildOptions(alpha=alpha), has_speedc_section=has_speedc_section(path),
                         acceptance_hint=acceptance_hint_from_training(path))
    state, _ = run_passes(state, ["trace", "share", "schedule"])
    stored = sum(t.numel() * 4 for t in tensors.values())
    return {"kind": "checkpoint", "path": str(path), "model": cfg.describe(), "layer_map": state.layer_map,
            "exit_layer": state.exit_layer, "schedule": state.schedule.to_json(),
            "sizes": {"checkpoint_weight_bytes_fp32": stored,
                      "distinct_weight_bytes_fp32": graph_stats(state.graphs["decode"])[1]},
            "notes": state.notes}


def _from_artifact(path: Path) -> dict:
    m = read_manifest(path, verify_hashes=False)
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    return {"kind": "artifact", "path": str(path), "format_version": m.format_version, "speedc_version": m.speedc_version,
            "model": m.model, "layer_map": m.layer_map, "exit_layer": m.exit_layer, "schedule": m.schedule,
            "dtype": m.dtype, "target": m.target,
            "sizes": {"unique_weight_bytes_fp32": m.weights["unique_bytes_fp32"], "stored_weight_bytes": m.weights["stored_bytes"],
                      "unrolled_export_weight_bytes_fp32": m.weights["unrolled_bytes_fp32"], "files": files},
            "graphs": {name: {"inputs": len(g["inputs"]), "outputs": len(g["outputs"])} for name, g in m.graphs.items()},
            "notes": m.build.get("notes", [])}


def describe(path: Path, alpha: float | None = None) -> dict:
    path = Path(path)
    if (path / MANIFEST).exists():
        info = _from_artifact(path)
    elif (path / "config.json").exists():
        info = _from_checkpoint(path, alpha)
    else:
        raise SpeedcError(f"{path}: neither a speedc artifact (manifest.json) nor a checkpoint (config.json)")
    if alpha is not None:
        from_curve = info["schedule"]["curve"].get(str(info["schedule"]["slots"]), {})
        info["predicted_speedup_at_alpha"] = {"alpha": alpha, "table": from_curve}
    return info


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


def render(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sched = info["schedule"]
    console.print(f"[bold]{info['kind']}[/bold] {info['path']}")
    console.print(f"model: {info['model']}")
    console.print(f"layer map: {info['layer_map']}  (exit after layer {info['exit_layer']})")
    console.print(f"schedule: P={sched['slots']} slots x S={sched['stage_layers']} layers; {sched['reason']}")
    for s, layers in enumerate(sched["slot_layers"]):
        console.print(f"  slot {s}: logical layers {layers[0]}..{layers[-1]} (blocks {sched['stage_blocks']})")
    if sched["slots"] > 1:
        console.print("pipeline (steps ->):")
        for line in schedule_diagram(sched["slots"], sched["slots"] + 3):
            console.print("  " + line)
    table = Table(title=f"predicted speedup vs plain decoding (c(P) = 1 + 0.05 (P-1)); assumed alpha {sched['alpha']:.2f}")
    alphas = list(next(iter(sched["curve"].values())).keys())
    table.add_column("P")
    for a in alphas:
        table.add_column(f"a={a}")
    for p, row in sched["curve"].items():
        table.add_row(str(p), *[f"{row[a]:.2f}" for a in alphas])
    console.print(table)
    sizes = info["sizes"]
    console.print("sizes: " + json.dumps({k: v for k, v in sizes.items()}))
