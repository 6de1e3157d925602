"""`speedc bench artifact OUT --plot FILE.png`: the bench report as a figure (matplotlib, the `bench` extra).

    [ tokens/s per system ]  [ speedup vs slots P, bound drawn ]  [ ms/token vs context ]*
      end to end               decode only (prefill excluded)       decode only
    * only when the report holds a --sweep length

`speedc bench concurrency OUT --plot FILE.png` (write_concurrency_plot):

    [ aggregate tokens/s vs clients, one line per system ]  [ per-sequence ms/token p50 vs clients ]
"""

from __future__ import annotations

import os
from pathlib import Path

from speedc.errors import SpeedcError


def _speedup_points(report: dict) -> tuple[list[int], list[float], list[float]]:
    rows = report.get("sweep", {}).get("slots", {}).get("rows")
    if rows:
        return [r["slots"] for r in rows], [r["speedup"] for r in rows], [r["bound"] for r in rows]
    return [report["slots"]], [report["speedup_p50"]], [report["bound"]]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpeedcError("--plot needs matplotlib: pip install 'speedc[bench]'") from None
    return plt


def _save(plt, fig, path: Path) -> Path:
    partial = path.with_name(f".{path.name}.partial{path.suffix}")  # never leave half a file at PATH
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(partial, dpi=110)
        os.replace(partial, path)
    except OSError as bad:
        raise SpeedcError(f"--plot {path}: cannot write it ({bad.strerror or bad})") from None
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
    return path


def write_plot(report: dict, path: Path) -> Path:
    """Draw REPORT (BenchReport JSON, optionally with "sweep") into PATH; returns PATH."""
    plt = _pyplot()
    length_rows = report.get("sweep", {}).get("length", {}).get("rows")
    panels = 3 if length_rows else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))

    systems = report["e2e_ms_per_token"]
    names = list(systems)
    tokens_per_second = [1000.0 / systems[name]["p50"] for name in names]
    axes[0].bar(range(len(names)), tokens_per_second, color=["tab:green" if n == "speed" else "tab:gray" for n in names])
    axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes[0].set_ylabel("tokens/s (end to end, p50)")
    axes[0].set_title("same ids, same weights")

    slots, speedups, bounds = _speedup_points(report)
    axes[1].plot(slots, speedups, "o-", color="tab:green", label="measured speed / autoregressive (decode only)")
    axes[1].plot(slots, bounds, "s--", color="tab:blue", label="bound P / (c(P)(1+(1-a)(P-1)))")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_xticks(slots)
    axes[1].set_xlabel("slots P")
    axes[1].set_ylabel("speedup, decode only (prefill excluded)")
    axes[1].set_title(f"acceptance a = {report['acceptance_rate']:.2f}")
    axes[1].legend(fontsize=8)

    if length_rows:
        contexts = [r["context"] for r in length_rows]
        axes[2].plot(contexts, [r["ms_per_token_autoregressive"] for r in length_rows], "o-", color="tab:gray",
                     label="autoregressive")
        axes[2].plot(contexts, [r["ms_per_token_speed"] for r in length_rows], "o-", color="tab:green", label="speed")
        axes[2].set_xscale("log", base=2)
        axes[2].set_xlabel("context (tokens)")
        axes[2].set_ylabel("decode ms / token (p50)")
        axes[2].legend(fontsize=8)
    fig.suptitle(f"{Path(report['artifact']).name}: {report['backend']}, P={report['slots']}")
    fig.tight_layout()
    return _save(plt, fig, path)


SYSTEM_STYLE = {"speed-adaptive": ("tab:green", "o-"), "speed-always": ("tab:olive", "^--"),
                "plain-batched": ("tab:gray", "s-"), "onnxruntime-genai": ("tab:blue", "d-.")}


def write_concurrency_plot(report: dict, path: Path) -> Path:
    """Draw a `speedc bench concurrency` REPORT (speedc/bench/concurrency.py JSON) into PATH; returns PATH."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.2))
    systems = list(dict.fromkeys(row["system"] for row in report["concurrency"]))
    for system in systems:
        rows = sorted((r for r in report["concurrency"] if r["system"] == system), key=lambda r: r["clients"])
        color, style = SYSTEM_STYLE.get(system, ("tab:purple", "x-"))
        clients = [r["clients"] for r in rows]
        axes[0].plot(clients, [r["tokens_per_second"] for r in rows], style, color=color, label=system)
        axes[1].plot(clients, [r["ms_per_token_p50"] for r in rows], style, color=color, label=system)
    levels = sorted({r["clients"] for r in report["concurrency"]})
    for ax, label in ((axes[0], "aggregate tokens/s (all clients)"), (axes[1], "per-sequence decode ms/token (p50)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_title("throughput (same ids as plain decoding alone)")
    axes[1].set_title("latency per sequence")
    fig.suptitle(f"{Path(report['artifact']).name}: continuous batching, P={report['slots']}, "
                 f"{report['new_tokens']} new tokens per request")
    fig.tight_layout()
    return _save(plt, fig, path)
