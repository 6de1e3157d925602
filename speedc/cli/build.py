"""Compiler commands: build and inspect."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
from pathlib import Path

import click

from speedc.cli.options import FiniteFloat
from speedc.errors import SpeedcError
from speedc.models import zoo


# CHECKPOINT / PATH are plain strings: `zoo:NAME` names a bundled model (models/zoo.py), resolved in
# the command so a bad name is a one-line user error; the library functions keep taking paths.
def weights_bar(done: int, total: int, width: int = 30) -> str:
    """'weights [#########.....]  62%  1.74 / 2.80 GB'"""
    filled = width * done // max(total, 1)
    return (f"weights [{'#' * filled}{'.' * (width - filled)}] {100 * done // max(total, 1):3d}%  "
            f"{done / 1e9:.2f} / {total / 1e9:.2f} GB")


@click.command(epilog=zoo.help_text())
@click.argument("checkpoint")
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Artifact directory to write.")
@click.option("--slots", type=click.IntRange(1), default=None,
              help="Pipeline slots P, the deepest pipeline depth (default: the schedule's choice).")
@click.option("--weights", "--dtype", "weights", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="Weight storage (default: the checkpoint's own precision when it is 16-bit, else fp32; 16-bit "
                   "halves the artifact, ONNX Runtime CPU computes in fp32; int8/int4 store block-quantized weights "
                   "for ONNX Runtime's MatMulNBits, int8 dot products on CPU). --dtype is an alias.")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128", "256"]), default=None,
              help="With --weights int8/int4: weights per quantization block, each with one scale (default 32).")
@click.option("--head-weights", type=click.Choice(["int8", "int4"]), default=None,
              help="With --weights int8/int4: the embedding / LM head's precision (default: --weights').")
@click.option("--target", type=click.Choice(["onnx", "trt"]), default="onnx", show_default=True)
@click.option("--exit-layer", type=click.IntRange(1), default=None, help="Override the early-exit point (logical layers).")
@click.option("--recurrence", type=click.IntRange(1), default=None,
              help="A recurrent-depth model's (Huginn's) core repeats R (default: its mean_recurrence); the pipeline "
                   "depth P must divide R.")
@click.option("--state-init", type=click.Choice(["zero", "random"]), default=None,
              help="A recurrent-depth model's start state: zero (default), or random as the published Huginn code "
                   "draws it, per token position under --seed (the same in plain decoding and SPEED).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None, help="With --state-init random: the draws' seed (default 0).")
@click.option("--alpha", type=FiniteFloat(0, 1), default=None,
              help="Expected speculation acceptance for the schedule's cost model (default: measured in training, else 0.7).")
@click.option("--eos-token-id", type=click.IntRange(0), default=None,
              help="End-of-text id to stop at (default: generation_config.json's, else config.json's; inspect shows which).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--allow-pickle", is_flag=True, help="Accept .bin/.pt weights (read with torch.load(weights_only=True)).")
@click.option("--dump-after", multiple=True, metavar="PASS", help="Write the ONNX graphs after PASS to OUT.dumps/ (repeatable).")
@click.option("--measure/--no-measure", default=True, show_default=True,
              help="Time the step graph against plain decoding on this machine (a few seconds) and store c(P) in the "
                   "artifact, so `speedc inspect` predicts from a measurement.")
@click.option("-v", "--verbose", is_flag=True, help="Print the pass pipeline with per-pass time, nodes and weight bytes.")
def build(checkpoint, out, slots, weights, block_size, head_weights, target, exit_layer, recurrence, state_init, seed, alpha,
          eos_token_id, force, allow_pickle, dump_after, measure, verbose):
    """Compile CHECKPOINT (a directory, or zoo:NAME) into a SPEED artifact: a P-slot speculative
    step graph with weight reuse, the plain prefill graph, one shared weights file, the tokenizer
    and a manifest."""
    checkpoint = zoo.resolve(checkpoint)  # first: a bad name fails before the compiler loads
    if seed is not None and state_init != "random":
        raise SpeedcError("--seed goes with --state-init random")
    if block_size is not None and weights not in ("int8", "int4"):
        raise SpeedcError("--block-size goes with --weights int8 or int4")
    from rich.console import Console

    from speedc.build import build as run_build
    from speedc.passes.base import BuildOptions
    from speedc.passes.block_quant import DEFAULT_BLOCK_SIZE

    console = Console(stderr=True)

    if verbose:
        click.echo(f"building {checkpoint} -> {out}\n     phase | pass            time | graph nodes | initializer bytes", err=True)
    terminated = exit_on_sigterm()
    with console.status("compiling", spinner="dots") if not verbose else contextlib.nullcontext() as status:
        def progress(message: str) -> None:
            if verbose:
                click.echo(f"  {message}", err=True)
            else:
                status.update(message)

        shown = [-1]

        def on_weight_bytes(done: int, total: int) -> None:
            percent = 100 * done // max(total, 1)
            step = 10 if verbose else 1  # verbose output is a log: a line per 10%
            if percent // step != shown[0] // step:
                shown[0] = percent
                progress(weights_bar(done, total))

        try:
            result = run_build(checkpoint, out, BuildOptions(slots=slots, dtype=weights, target=target, exit_layer=exit_layer,
                                                             alpha=alpha, eos_token_id=eos_token_id, recurrence=recurrence,
                                                             state_init=state_init, state_seed=seed or 0,
                                                             block_size=int(block_size or DEFAULT_BLOCK_SIZE), head_dtype=head_weights),
                               force=force, allow_pickle=allow_pickle, dump_after=list(dump_after), on_pass=print_pass if verbose else None,
                               measure_step_cost=measure, progress=progress, on_weight_bytes=on_weight_bytes)
        except Exception:
            # the SystemExit raised inside torch's `with torch.device(...)` can surface as another error (its mode
            # stack unwound twice: "trying to pop from empty mode stack"); the build cleaned up all the same
            if terminated:
                sys.exit(128 + signal.SIGTERM)
            raise
    if verbose:
        for note in result.notes:
            click.echo(f"  {note}", err=True)
    print_built(result, out)


def print_pass(report) -> None:
    """One line of --verbose's pass table."""
    nodes = " ".join(f"{g}={n}" for g, n in report.nodes.items())
    weights = " ".join(f"{g}={b / 1e6:.2f}MB" for g, b in report.initializer_bytes.items())
    click.echo(f"  {report.phase:>8} | {report.name:<10} {report.seconds * 1000:8.1f} ms | nodes {nodes} | weights {weights}",
               err=True)


def exit_on_sigterm() -> list:
    """SIGTERM (a CI timeout, `kill`) exits like Ctrl-C, so the build's cleanup removes its unfinished folder.
    -> a list that holds True once it came."""
    terminated = []

    def on_sigterm(*_) -> None:
        terminated.append(True)
        sys.exit(128 + signal.SIGTERM)

    with contextlib.suppress(ValueError):  # (ValueError: not the main thread, e.g. a CliRunner in a thread)
        signal.signal(signal.SIGTERM, on_sigterm)
    return terminated


def print_built(result, out) -> None:
    """What a build made: its schedule, its weights, the step cost it measured."""
    from speedc.runtimes.step_costs import seed_step_cost

    m = result.manifest
    w = m.store
    click.echo(f"built {out} in {result.seconds:.1f} s: P={m.slots} slots x {m.stage_layers} layers, "
               f"weights {w.stored_bytes / 1e6:.2f} MB {m.dtype} = {w.stored_bytes / w.unique_bytes_fp32:.3f} x unique fp32 "
               f"bytes (an unrolled fp32 export stores {w.unrolled_bytes_fp32 / 1e6:.2f} MB)")
    measured = m.build.get("step_cost_measured")
    if measured:
        click.echo(f"step cost c(P={measured['slots']}) = {measured['step_cost']:.2f} measured on this machine "
                   f"({measured['backend']}, {measured['threads']} threads); `speedc inspect {shlex.quote(str(out))}` "
                   "predicts from it")
        if seed_step_cost(m)[1] != "measured at build":  # the runtime's rule for a build-time c it will not trust
            click.echo("  below 1 it is no measurement (P rows never cost less than one row's pass: this machine was "
                       "busy); the runtime seeds with the cost model's c(P) and measures its own steps")


@click.command(epilog=zoo.help_text())
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--alpha", type=FiniteFloat(0, 1), default=None, help="Acceptance to predict the speedup at.")
@click.option("--measure", is_flag=True, help="Measure the artifact's step cost c(P) on this machine now and predict from it.")
@click.option("--verify", is_flag=True, help="Check every file of the artifact against the sha256 in its manifest, "
              "weights.bin too (a full read); without it, what every load checks: each present at its recorded size, "
              "the small files by sha256.")
def inspect(path, as_json, alpha, measure, verify):
    """Show the layer map, the pipeline schedule (slots x steps) and sizes of PATH: a checkpoint
    (a directory, or zoo:NAME) or an artifact."""
    from speedc.inspect import describe, render

    info = describe(zoo.resolve(path), alpha, measure=measure, verify=verify)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        render(info)
