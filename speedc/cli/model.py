"""Model commands: train."""

from __future__ import annotations

from pathlib import Path

import click

from speedc.cli.options import FiniteFloat, given_options
from speedc.models.presets import PRESETS


@click.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--corpus", multiple=True, default=["shakespeare"], show_default=True,
              help="Bundled corpus name (shakespeare, stdlib), a text file, or a folder of .txt files. Repeatable.")
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True,
              help="Model shape (models/presets.py).")
@click.option("--steps", type=click.IntRange(1), default=1000, show_default=True, help="Total optimizer steps (with --resume: the new total).")
@click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--seq-len", type=click.IntRange(8), default=128, show_default=True)
@click.option("--lr", type=FiniteFloat(0, min_open=True), default=2e-3, show_default=True, help="Peak learning rate (cosine decay to 10%).")
@click.option("--exit-weight", type=FiniteFloat(0), default=0.5, show_default=True, help="Weight of the early-exit loss.")
@click.option("--eval-every", type=click.IntRange(1), default=200, show_default=True)
@click.option("--save-every", type=click.IntRange(1), default=200, show_default=True, help="Checkpoint period in steps.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(0), default=0, help="torch threads (0: default).")
@click.option("--bf16/--no-bf16", default=True, show_default=True, help="bf16 autocast for training steps (evaluation stays fp32).")
@click.option("--resume", is_flag=True, help="Continue the run saved in OUT with its settings; --steps (the new total), "
              "--eval-every, --save-every and --threads may change, other settings must match the run's.")
def train(out: Path, corpus, preset, steps, batch_size, seq_len, lr, exit_weight, eval_every, save_every, seed, threads, bf16, resume):
    """Train a shared-weight decoder with the early-exit loss into checkpoint directory OUT.

    Trains a byte-level BPE tokenizer on the corpus, checkpoints every --save-every steps (OUT is
    loadable at any time), and reports validation loss at the exit and at the end plus exit/final
    top-1 and top-2 agreement: the speculation acceptance the runtime will see.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from speedc.models.train import TrainOptions, train as run_training

    opts = TrainOptions(corpus=list(corpus), preset=preset, steps=steps, batch_size=batch_size, seq_len=seq_len,
                        lr=lr, exit_weight=exit_weight, eval_every=eval_every, save_every=save_every, seed=seed,
                        threads=threads, bf16=bf16)
    with Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  transient=False) as bar:
        task = bar.add_task("train", total=steps, metrics="")

        started: list[int] = []

        def report(step: int, total: int, metrics: dict) -> None:
            if not started:
                started.append(step)
                click.echo(f"training: first step done ({step}/{total}); Ctrl-C saves and stops", err=True)
            shown = " ".join(f"{k}={v}" for k, v in metrics.items())
            bar.update(task, completed=step, total=total, metrics=shown)
            if "val_loss_final" in metrics:
                bar.console.print(f"step {step}: {shown}")

        given = frozenset(given_options("preset", "steps", "batch_size", "seq_len", "lr", "exit_weight", "eval_every",
                                        "save_every", "seed", "threads", "bf16"))
        state = run_training(out, opts, resume=resume, progress=report, given=given)
    last = state["history"][-1]
    click.echo(f"saved {out} after {state['step']} steps, {state['wall_seconds']:.0f} s: "
               f"val loss exit {last['val_loss_exit']} final {last['val_loss_final']}, "
               f"agreement top-1 {last['agree_top1']} top-2 {last['agree_top2']}")
