"""`speedc bench`: SPEED against plain decoding and peer systems, or the memory-bound step cost."""

from __future__ import annotations

import json
from pathlib import Path

import click

from speedc.errors import GenerationError


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path), required=False)
@click.option("--memory-bound", is_flag=True,
              help="Instead: build a random ~200 MB model of the zoo shape and report c(P) only (no speedups).")
@click.option("--memory-bound-hidden", type=click.IntRange(64), default=1024, show_default=True, hidden=True)
@click.option("--new-tokens", type=click.IntRange(2), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Passes over the prompt set.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable; default: a built-in set).")
@click.option("--early-flush/--no-early-flush", default=None, help="SPEED with or without early flush (default: the engine's, on).")
@click.option("--backend", type=click.Choice(["onnx", "torch"]), default="onnx", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: all cores).")
@click.option("--peers/--no-peers", default=None,
              help="Also time the PyTorch reference and transformers generate (default: when installed).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(artifact, memory_bound, memory_bound_hidden, new_tokens, repeats, prompts, early_flush, backend, device,
          threads, peers, as_json):
    """Measure SPEED against plain decoding (and peers) on ARTIFACT: interleaved runs, identical ids checked first.

    With --memory-bound, measure the step cost c(P) on a large random-weight model instead."""
    if memory_bound:
        from speedc.bench_synthetic import synthetic_step_costs

        report = synthetic_step_costs(hidden=memory_bound_hidden, threads=threads)
        if as_json:
            click.echo(json.dumps(report))
        else:
            click.echo(f"{report['label']}: hidden {report['hidden']}, {report['blocks']} blocks x {report['passes']} passes, "
                       f"{report['unique_weight_mb']} MB unique weights, context {report['context']}")
            for row in report["rows"]:
                click.echo(f"  c(P={row['slots']}) = {row['step_cost']:.2f}")
        return
    if artifact is None:
        raise GenerationError("give an ARTIFACT to benchmark (or --memory-bound)")
    import tempfile

    from speedc.bench import run_bench
    from speedc.bench_peers import load_peers, peers_available
    from speedc.runtimes.engine import Engine

    engine = Engine.load(artifact, backend=backend, device=device, threads=threads)
    use_peers = peers_available() if peers is None else peers
    with tempfile.TemporaryDirectory() as workdir:
        peer_fns, peer_bytes = load_peers(artifact, engine.manifest, threads, Path(workdir)) if use_peers else ({}, {})
        report = run_bench(engine, prompts=list(prompts) or None, new_tokens=new_tokens, repeats=repeats,
                           early_flush=early_flush, peers=peer_fns)
    report.weight_bytes = {"speedc": engine.manifest.weights["stored_bytes"],
                           "unrolled export": engine.manifest.weights["unrolled_bytes_fp32"], **peer_bytes}
    if as_json:
        click.echo(json.dumps(report.to_json()))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{artifact} ({report.backend}, P={report.slots}, {report.repeats} runs x {new_tokens} tokens)")
    for column in ("mode", "ms/token p50", "p90", "min", "tokens/s"):
        table.add_column(column)
    for mode, row in report.ms_per_token.items():
        table.add_row(mode, f"{row['p50']:.3f}", f"{row['p90']:.3f}", f"{row['min']:.3f}", f"{report.tokens_per_second[mode]:.1f}")
    console = Console()
    console.print(table)
    peers_table = Table(title="end to end (prompt + generation) ms per new token, same ids checked")
    for column in ("system", "p50", "p90", "SPEED speedup"):
        peers_table.add_column(column)
    for name, row in report.e2e_ms_per_token.items():
        ratio = report.speed_speedup_e2e.get(name)
        peers_table.add_row(name, f"{row['p50']:.3f}", f"{row['p90']:.3f}", "-" if ratio is None else f"{ratio:.2f}x")
    console.print(peers_table)
    console.print("weight bytes stored: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in report.weight_bytes.items()))
    console.print(f"identical ids: {report.identical_ids}   speedup (p50): {report.speedup_p50:.2f}x   "
                  f"acceptance: {report.acceptance_rate:.3f}   tokens/step: {report.tokens_per_step:.3f}")
    console.print(f"step cost c(P={report.slots}) = {report.step_cost:.2f}   analytic bound {report.bound:.2f}x   "
                  f"achieved / bound {report.achieved_over_bound:.2f}   prefill p50 {report.prefill_ms_p50:.2f} ms")
