"""`speedc bench`: three benchmarks, one subcommand each, each with its own options.

    speedc bench artifact OUT            SPEED against plain decoding and peer systems on a built artifact
    speedc bench memory-bound            c(P) on a large random-weight model it builds at each depth
    speedc bench concurrency OUT         continuous batching at several client counts
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import click

from speedc.bench.peers import PEER_NAMES
from speedc.bench.synthetic import SHAPES
from speedc.cli.options import (FiniteFloat, backend_option, backend_options, flag, given_options, threads_option)
from speedc.errors import GenerationError


class BenchGroup(click.Group):
    """`speedc bench` with no benchmark named first: one line listing the three (not click's usage block)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            click.echo(f"error: {ctx.command_path} runs one of: {', '.join(self.commands)} "
                       f"(e.g. `{ctx.command_path} artifact OUT`; `{ctx.command_path} NAME --help` for its options)",
                       err=True)
            ctx.exit(1)
        return super().parse_args(ctx, args)


class BenchCommand(click.Command):
    """A bench subcommand: a bad option or value is one line, naming the benchmark an option belongs to
    when it is another's."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as err:
            siblings = ctx.parent.command.commands if ctx.parent else {}
            owners = [name for name, command in siblings.items() if command is not self and any(
                err.option_name in (*param.opts, *param.secondary_opts) for param in command.params)]
            group = ctx.command_path.rsplit(" ", 1)[0]
            if owners:
                click.echo(f"error: {err.option_name} does not go with `{ctx.command_path}`: it goes with "
                           + " and ".join(f"`{group} {owner}`" for owner in owners), err=True)
            else:
                click.echo(f"error: `{ctx.command_path}` has no option {err.option_name}", err=True)
        except click.UsageError as err:
            click.echo(f"error: {ctx.command_path}: {err.format_message()}", err=True)
        ctx.exit(1)


def plot_option(what: str):
    return click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help=f"Write a PNG: {what}.")


json_option = click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
prompts_option = click.option("--prompt", "prompts", multiple=True,
                              help="Prompt text (repeatable; default: a built-in set).")
new_tokens_option = click.option("--new-tokens", type=click.IntRange(2), default=128, show_default=True,
                                 help="Tokens decoded per prompt.")


@click.group(cls=BenchGroup)
def bench() -> None:
    """Measure SPEED: on an artifact against plain decoding and peers (artifact), the step cost c(P) on a
    large random-weight model (memory-bound), or continuous batching (concurrency)."""


@bench.command("artifact", cls=BenchCommand)
@click.argument("artifact", type=click.Path(path_type=Path))
@new_tokens_option
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Passes over the prompt set.")
@prompts_option
@click.option("--early-flush/--no-early-flush", default=None, help="SPEED with or without early flush (default: the engine's, on).")
@backend_options
@click.option("--peers/--no-peers", default=None,
              help="Also time the PyTorch reference, transformers generate and ORT GenAI fp32 / int4 (default: when "
                   "installed).")
@click.option("--peer", "only_peers", multiple=True, type=click.Choice(list(PEER_NAMES)),
              help="Run only these peers (repeatable; implies --peers).")
@click.option("--sweep", "sweeps", multiple=True, type=click.Choice(["slots", "length"]),
              help="Also sweep pipeline depth P = 1, 2, 4, 8 (recompiling; needs the compiler) or context 128..2048.")
@click.option("--memory/--no-memory", default=True, show_default=True,
              help="Peak RSS of each system, each measured in a fresh process.")
@plot_option("tokens/s per system (end to end), decode-only speedup vs pipeline depth with the bound")
@json_option
def bench_artifact(artifact, new_tokens, repeats, prompts, early_flush, backend, device, threads, kv_cache, peers,
                   only_peers, sweeps, memory, plot, as_json):
    """SPEED against plain decoding (and peers) on ARTIFACT: interleaved runs, identical ids checked first
    (peers at another precision, e.g. ORT GenAI int4: their agreement with SPEED's ids is reported instead).

    Reports ms/token p50/p90 and SPEED's speedup both decode only (prefill excluded) and end to end
    (prefill + decode), acceptance, tokens/step, c(P), the analytic bound, prefill time, peak RSS and
    weight bytes per system."""
    if only_peers and peers is False:
        raise GenerationError("--peer and --no-peers contradict each other")
    if plot is not None:
        check_plot_path(plot)  # before minutes of measuring, not after

    import tempfile

    from rich.console import Console

    from speedc.bench.memory import peak_rss_mb
    from speedc.bench.peers import load_peers, peers_available
    from speedc.bench.run import run_bench
    from speedc.bench.sweep import sweep_length, sweep_slots
    from speedc.runtimes.engine import Engine

    status = Console(stderr=True)
    if kv_cache is not None:  # every engine of the bench, those of its fresh processes (memory, sweeps) too
        os.environ["SPEEDC_KV_CACHE"] = kv_cache
    engine = Engine.load(artifact, backend=backend, device=device, threads=threads)
    use_peers = bool(only_peers) or (peers_available() if peers is None else peers)
    with tempfile.TemporaryDirectory() as tmp, status.status("bench") as spinner:
        workdir = Path(tmp)
        if use_peers:
            spinner.update("exporting and loading peers (the artifact's weights; GenAI also at int4)")
        peer_fns, peer_bytes = load_peers(artifact, engine.manifest, threads, workdir,
                                          tuple(only_peers) or None) if use_peers else ({}, {})
        spinner.update(f"interleaved runs: speed, autoregressive{''.join(', ' + p for p in peer_fns)}")
        report = run_bench(engine, prompts=list(prompts) or None, new_tokens=new_tokens, repeats=repeats,
                           early_flush=early_flush, peers=peer_fns)
        if memory:
            for system in ("speed", "autoregressive", *peer_fns):
                spinner.update(f"peak RSS: {system} in a fresh process")
                report.peak_rss_mb[system] = peak_rss_mb(system, artifact, workdir, new_tokens, threads, backend, device)
    report.weight_bytes = {"speedc": engine.manifest.store.stored_bytes,
                           "unrolled export": engine.manifest.store.unrolled_bytes_fp32, **peer_bytes}
    with status.status("sweeps") if sweeps else contextlib.nullcontext() as spinner:
        if "slots" in sweeps:
            report.sweep["slots"] = sweep_slots(engine, prompts=list(prompts) or None, new_tokens=new_tokens,
                                                repeats=repeats, threads=threads, backend=backend, device=device,
                                                progress=spinner.update)
        if "length" in sweeps:
            report.sweep["length"] = sweep_length(engine, prompts=list(prompts) or None, new_tokens=new_tokens,
                                                  repeats=repeats, progress=spinner.update)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        print_report(report, artifact, new_tokens)
    if plot is not None:  # after the report is out: a failing plot never loses the measurements
        from speedc.bench.plot import write_plot

        write_plot(report.to_json(), plot)
        status.print(f"wrote {plot}")


@bench.command("memory-bound", cls=BenchCommand)
@click.option("--shape", type=click.Choice(["zoo", *SHAPES]), default="zoo", show_default=True,
              help="The zoo family at --hidden, or a looped checkpoint's real shapes (bf16, its published layout, every "
                   "layer unless --layers).")
@click.option("--hidden", type=click.IntRange(64), default=1024, show_default=True, help="The zoo shape's hidden size.")
@click.option("--layers", type=click.IntRange(1), default=None, help="Use at most this many layers.")
@click.option("--recurrence", type=click.IntRange(1), default=None,
              help="With --shape huginn-3.5b: the core's repeats R (default 32, mean_recurrence).")
@click.option("--repeats", type=click.IntRange(5), default=100, show_default=True,
              help="Timed steps per depth (interleaved medians).")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="The artifact's weight storage (default fp32 for the zoo shape, bf16 for a looped shape's "
                   "checkpoint); the weight floor beside it stays fp32.")
@click.option("--profile", is_flag=True,
              help="Also the step's kernel time per op type beside the plain token's share (ONNX Runtime profiling).")
@click.option("--end-to-end", is_flag=True,
              help="Also SPEED vs plain decoding per depth, on weights whose residual updates are scaled so the early "
                   "exit agrees often (acceptance measured and reported; ids checked identical).")
@click.option("--residual-scale", type=FiniteFloat(0, 1, min_open=True), default=None,
              help="Scale of each block's residual update (default with --end-to-end: 0.0015 for the zoo shape, "
                   "untied, an acceptance near 0.8; for a looped shape 0.025 / sqrt(layers x (loops - 1)) with sandwich "
                   "norms, 0.015 / ... without: near 0.9 at full depth; smaller: higher acceptance; else 1).")
@click.option("--new-tokens", type=click.IntRange(2), default=128, show_default=True,
              help="With --end-to-end: tokens decoded per prompt.")
@click.option("--peers/--no-peers", default=None,
              help="With --end-to-end at a looped --shape: llama.cpp on a GGUF of the same checkpoint (default: when "
                   "installed).")
@click.option("--exit-threshold", type=FiniteFloat(0, 1), multiple=True,
              help="With --end-to-end at an Ouro shape: also decode with this exit threshold (repeatable), SPEED and "
                   "plain decoding, beside the full depth in the same rounds.")
@click.option("--exit-at-step", type=click.IntRange(0), multiple=True,
              help="Likewise with this fixed exit loop (from 0; repeatable).")
@click.option("--loops", type=click.IntRange(1), multiple=True,
              help="With --end-to-end at an Ouro or recurrent shape: also decode with this loop count (Ouro's "
                   "total_ut_steps, Huginn's num_steps; repeatable), SPEED and plain decoding, beside the full depth.")
@backend_option
@threads_option
@json_option
def bench_memory_bound(shape, hidden, layers, recurrence, repeats, weights, profile, end_to_end, residual_scale,
                       new_tokens, peers, exit_threshold, exit_at_step, loops, backend, threads, as_json):
    """Build a large random-weight model at each pipeline depth and report its step cost c(P), each
    beside the weight floor's (the same weight products and nothing else) measured in the same run."""
    if given_options("hidden") and shape != "zoo":
        raise GenerationError(f"--hidden sizes the zoo shape; {shape} has its own")
    needs_end_to_end = given_options("new_tokens", "exit_threshold", "exit_at_step", "loops") + (["peers"] if peers else [])
    if needs_end_to_end and not end_to_end:
        raise GenerationError(f"{flag(needs_end_to_end[0])} goes with --end-to-end (it decodes; c(P) alone does not)")

    from rich.console import Console

    from speedc.bench.synthetic import synthetic_step_costs

    chosen = SHAPES.get(shape)
    if recurrence is not None:
        if chosen is None or not chosen.recurrent:
            raise GenerationError("--recurrence goes with a recurrent-depth shape (--shape huginn-3.5b)")
        chosen = dataclasses.replace(chosen, loops=recurrence)
    rules = [{"exit_threshold": t} for t in exit_threshold] + [{"exit_at_step": k} for k in exit_at_step]
    if rules and (chosen is None or not chosen.name.startswith("ouro")):
        raise GenerationError("--exit-threshold / --exit-at-step go with an Ouro shape (--shape ouro-1.4b or ouro-2.6b)")
    if loops and (chosen is None or not (chosen.name.startswith("ouro") or chosen.recurrent)):
        raise GenerationError("--loops goes with an Ouro or recurrent shape (--shape ouro-1.4b, huginn-3.5b, parcae-770m)")
    rules += [{"loops": n} for n in loops]
    with Console(stderr=True).status("memory-bound step cost") as spinner:
        report = synthetic_step_costs(hidden=hidden, repeats=repeats, threads=threads, backend=backend,
                                      shape=chosen, layers=layers, end_to_end=end_to_end,
                                      residual_scale=residual_scale, new_tokens=new_tokens, weights=weights,
                                      profile=profile, peers=peers, exit_rules=rules, progress=spinner.update)
    if as_json:
        click.echo(json.dumps(report))
    else:
        print_memory_bound(report)


MAX_CLIENTS = 1024  # --clients: a level's pool holds a pool row per client


@bench.command("concurrency", cls=BenchCommand)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--clients", "levels", default="1,2,4,8,16", show_default=True,
              help="Client counts, comma-separated: a level runs that many sequences at once.")
@new_tokens_option
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Rounds over every level and system, interleaved (medians over them).")
@prompts_option
@click.option("--peers/--no-peers", default=None, help="Also ORT GenAI's own batching (default: when installed).")
@threads_option
@plot_option("aggregate tokens/s and per-sequence ms/token vs clients")
@json_option
def bench_concurrency(artifact, levels, new_tokens, repeats, prompts, peers, threads, plot, as_json):
    """Continuous batching on ARTIFACT at each client count: SPEED adaptive / always / batched plain
    decoding (aggregate tokens/s, per-sequence ms/token p50/p99, TTFT), ids checked identical first.
    Runs on ONNX Runtime on the CPU, early flush on."""
    from rich.console import Console

    from speedc.bench.concurrency import concurrency_bench, format_concurrency
    from speedc.bench.run import DEFAULT_PROMPTS
    from speedc.runtimes.engine import Engine

    try:
        clients = [int(x) for x in levels.split(",") if x.strip()]
    except ValueError:
        raise GenerationError(f"--clients must be comma-separated integers, got {levels!r}") from None
    if not clients or min(clients) < 1:
        raise GenerationError("--clients needs counts of at least 1")
    if max(clients) > MAX_CLIENTS:
        raise GenerationError(f"--clients: at most {MAX_CLIENTS} clients (every level's KV-cache pool is held at once)")
    if plot is not None:
        check_plot_path(plot)  # before minutes of measuring, not after
    engine = Engine.load(artifact, threads=threads)
    with Console(stderr=True).status("concurrency") as spinner:
        report = concurrency_bench(engine, list(prompts) or DEFAULT_PROMPTS, clients, new_tokens, repeats, threads=threads,
                                   peers=peers, progress=spinner.update)
    click.echo(json.dumps(report) if as_json else format_concurrency(report))
    if plot is not None:  # after the report is out: a failing plot never loses the measurements
        from speedc.bench.plot import write_concurrency_plot

        write_concurrency_plot(report, plot)
        Console(stderr=True).print(f"wrote {plot}")


def print_memory_bound(report: dict) -> None:
    click.echo(f"{report['label']}, {report['backend']}, shape {report['shape']}: hidden {report['hidden']}, "
               f"{report['blocks']} blocks x {report['passes']} passes, {report['unique_weight_mb']} MB unique "
               f"fp32 weights ({report['stored_weight_mb']} MB stored as {report['weights']}), context {report['context']}")
    if report["note"]:
        click.echo(f"  note: {report['note']}")
    for name, install in report.get("end_to_end", {}).get("peers_missing", {}).items():
        click.echo(f"  {name} peer not installed: {install}")
    floor = report["rows"][0].get("floor_weights", "fp32") if report["rows"] else "fp32"
    click.echo(f"  floor: the same weight products ({floor}, ONNX Runtime) with nothing else (speedc/bench/floor.py), same run")
    kernel = report.get("kernel")
    if kernel and kernel.get("kernel"):
        def by_rows(ms: dict, cost: dict) -> str:
            return (", ".join(f"{rows} rows {value:.1f} ms" for rows, value in ms.items()) + "; "
                    + ", ".join(f"c({rows}) = {value:.2f}" for rows, value in cost.items()))

        click.echo(f"  speedc kernel ({kernel['threads']} threads) over the blocks' {kernel['weight_mb']} MB; reading the "
                   f"bytes alone {kernel['stream_ms']:.1f} ms; the runtime takes {kernel['kernel']}:")
        for path, measured in kernel["paths"].items():
            click.echo(f"    {path}: {by_rows(measured['rows_ms'], measured['cost'])} "
                       f"(1 row at {measured['one_row_vs_stream']:.0%} of the floor)")
        click.echo("  the same products on ONNX Runtime's MatMulNBits (no zero row): "
                   f"{by_rows(kernel['matmulnbits_rows_ms'], kernel['matmulnbits_cost'])}")
    elif kernel:
        click.echo(f"  speedc kernel not measured: {kernel['why']}")
    products = {row.get("products") for row in report["rows"]} - {None}
    if products:
        click.echo(f"  the artifacts' weight products ran on: {', '.join(sorted(products))}")
    for row in report["rows"]:
        line = (f"  c(P={row['slots']}) = {row['step_cost']:.2f}  (step {row['step_ms']:.1f} ms, plain token "
                f"{row['token_ms']:.1f} ms)   floor c(P) = {row['floor_step_cost']:.2f}  (step {row['floor_step_ms']:.1f} ms, "
                f"token {row['floor_token_ms']:.1f} ms)   load {row['load_seconds']:.1f} s")
        if "speedup_decode" in row:
            policy = row["policy"]
            line += (f"\n      acceptance {row['acceptance']:.2f}: SPEED {row['speed_ms_per_token']:.1f} ms/token, plain "
                     f"{row['autoregressive_ms_per_token']:.1f} ms/token, speedup {row['speedup_decode']:.2f}x "
                     f"(decode only, ids identical); speculating at every step {row['speed_always_ms_per_token']:.1f} "
                     f"ms/token, {row['speedup_decode_always']:.2f}x"
                     f"\n      policy: {policy['speed_steps']} speed ({_by_depth(policy)}) / {policy['plain_steps']} plain steps, "
                     f"{policy['fallbacks']} fall-backs, {policy['probes']} probes, {policy['cost_samples']} plain steps "
                     f"timed; last c(P) {policy['step_cost']:.2f} ({policy['step_cost_source']}), bound {policy['bound']:.2f}")
        click.echo(line)
        for name, peer in row.get("peers", {}).items():
            if "failed" in peer:
                click.echo(f"      {name}: failed, {peer['failed']}; ran {peer['ran']}")
                continue
            click.echo(f"      {name}: {peer['ms_per_token']:.1f} ms/token, SPEED {peer['speed_speedup']:.2f}x faster; "
                       f"ids agree at {peer['agreement']:.0%} of positions; ran {peer['ran']}")
        for rule in row.get("exit_rules", []):
            click.echo(exit_rule_line(rule))
        if "profile" in row:
            click.echo(f"      {'op (kernel ms, profiled)':<30} {'step':>8} {'token/P':>8} {'step - token/P':>15}")
            for op in row["profile"][:12]:
                click.echo(f"      {op['op']:<30} {op['step_ms']:>8.3f} {op['token_share_ms']:>8.3f} "
                           f"{op['step_ms'] - op['token_share_ms']:>+15.3f}")


def exit_rule_line(rule: dict) -> str:
    """One row of speedc.bench.synthetic.exit_rule_rows."""
    exits = ", ".join(f"loop {loop}: {count}" for loop, count in rule["exit_loops"].items())
    return (f"      {rule['rule']}: acceptance {rule['acceptance']:.2f}, exits {exits}; SPEED "
            f"{rule['speed_ms_per_token']:.1f} ms/token, plain decoding with the rule "
            f"{rule['autoregressive_ms_per_token']:.1f} ({rule['speedup_decode']:.2f}x); against the full depth "
            f"(SPEED {rule['full_speed_ms_per_token']:.1f} at acceptance {rule['full_acceptance']:.2f}, plain "
            f"{rule['full_autoregressive_ms_per_token']:.1f}): {rule['vs_speed_full_depth']:.2f}x, "
            f"{rule['vs_plain_full_depth']:.2f}x (ids identical)")


def check_plot_path(plot: Path) -> None:
    if plot.suffix.lower() != ".png":
        raise GenerationError(f"--plot {plot}: give a .png file name")
    folder = plot.parent if str(plot.parent) else Path(".")
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise GenerationError(f"--plot {plot}: {existing} is not a writable folder")


# Two speedups, each named wherever it is shown: the per-mode table times decoding only (the tokens
# after the first; prefill excluded), the systems table times whole calls (prefill + decode).
DECODE_ONLY = "decode only (prefill excluded)"
END_TO_END = "end to end (prefill + decode)"


def print_report(report, artifact: Path, new_tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"{artifact} ({report.backend}, P={report.slots}, {report.repeats} runs x {new_tokens} tokens)")
    table = Table(title=f"per mode, {DECODE_ONLY}")
    for column in ("mode", "decode ms/token p50", "p90", "min", "decode tokens/s"):
        table.add_column(column)
    for mode, row in report.ms_per_token.items():
        table.add_row(mode, f"{row['p50']:.3f}", f"{row['p90']:.3f}", f"{row['min']:.3f}", f"{report.tokens_per_second[mode]:.1f}")
    console.print(table)
    peers_table = Table(title=f"per system, {END_TO_END}, ids against SPEED's")
    for column in ("system", "ms/new token p50", "p90", "SPEED speedup, end to end", "ids vs SPEED"):
        peers_table.add_column(column)
    for name, row in report.e2e_ms_per_token.items():
        ratio = report.speed_speedup_e2e.get(name)
        peers_table.add_row(name, f"{row['p50']:.3f}", f"{row['p90']:.3f}", "-" if ratio is None else f"{ratio:.2f}x",
                            ids_column(name, report))
    console.print(peers_table)
    if any(not a["same_weights"] for a in report.peer_agreement.values()):
        console.print("agreement: share of new tokens equal to SPEED's at the same position; prefix: share before each "
                      "run's first difference (peers at another precision; same-weight peers must be identical)")
    if report.peak_rss_mb:
        console.print("peak RSS (each system in a fresh process): "
                      + ", ".join(f"{k} {v:.0f} MB" for k, v in report.peak_rss_mb.items()))
    console.print("weight bytes stored: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in report.weight_bytes.items()))
    console.print(f"identical ids: {report.identical_ids}   "
                  f"SPEED speedup, decode only (p50): {report.speedup_decode_p50:.2f}x   "
                  f"end to end (p50): {report.speedup_e2e_p50:.2f}x")
    console.print(f"acceptance: {report.acceptance_rate:.3f}   tokens/step: {report.tokens_per_step:.3f}   "
                  f"flushes: {report.flushes['last_layer']} at the last layer, {report.flushes['early']} early "
                  f"({report.flushes['tokens_discarded']} tokens discarded)")
    console.print(f"step cost c(P={report.slots}) = {report.step_cost:.2f}   analytic bound {report.bound:.2f}x   "
                  f"decode-only speedup / bound {report.achieved_over_bound:.2f}   prefill p50 {report.prefill_ms_p50:.2f} ms")
    policy = report.policy
    console.print(f"speculating at every step (speed-always): {report.speedup_always_p50:.2f}x plain, decode only; the "
                  f"default mode's policy: {policy['speed_steps']} speed ({_by_depth(policy)}) / {policy['plain_steps']} plain steps, "
                  f"{policy['fallbacks']} fall-backs, {policy['probes']} probes, {policy['cost_samples']} plain steps timed; "
                  f"last c(P) {policy['step_cost']:.2f} ({policy['step_cost_source']}), bound {policy['bound']:.2f}")
    for kind, sweep in report.sweep.items():
        print_sweep(console, kind, sweep)


def _by_depth(policy: dict) -> str:
    """Speed steps per pipeline depth, e.g. "P=4 120, P=2 30"."""
    return ", ".join(f"P={depth} {steps}" for depth, steps in policy["depth_steps"].items()) or "none"


def ids_column(system: str, report) -> str:
    """'-' for SPEED itself, 'identical (required)' where a difference would have refused the report,
    else the peer's agreement with SPEED's ids."""
    if system == "speed":
        return "-"
    agreement = report.peer_agreement.get(system)
    if agreement is None or agreement["same_weights"]:  # autoregressive, or a peer on the artifact's weights
        return "identical (required)"
    if agreement["identical_ids"]:
        return "identical (other precision)"
    return f"agreement {agreement['agreement']:.3f}, prefix {agreement['prefix_agreement']:.3f}"


def print_sweep(console, kind: str, sweep: dict) -> None:
    """One row per depth or context (80 columns hold it; plain decoding's ms/token is in --json): the default mode's
    speedup beside speculating at every step's, and its speed / plain steps (where it fell back)."""
    from rich.table import Table

    key = "slots" if kind == "slots" else "context"
    table = Table(title=f"sweep {kind}" + (" (recompiled at each P)" if kind == "slots" else "")
                  + f": {DECODE_ONLY}; always: speculating at every step")
    for column in (key, "speed ms/token", "speedup", "always", "steps: speed / plain", "accept rate", "c(P)", "bound"):
        table.add_column(column)
    for row in sweep["rows"]:
        table.add_row(str(row[key]), f"{row['ms_per_token_speed']:.3f}", f"{row['speedup']:.2f}x",
                      f"{row['speedup_always']:.2f}x", f"{row['speed_steps']}/{row['plain_steps']}",
                      f"{row['acceptance']:.3f}", f"{row['step_cost']:.2f}", f"{row['bound']:.2f}x")
    console.print(table)
    for value, why in sweep["skipped"].items():
        console.print(f"  {key} {value} skipped: {why}")
