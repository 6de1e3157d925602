"""`speedc quality`: validation loss and agreement of artifacts with a reference build (speedc/quality.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("reference", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="Prompt for the greedy continuations (repeatable; default: a built-in set).")
@click.option("--new-tokens", type=click.IntRange(1), default=64, show_default=True, help="Greedy continuation length.")
@click.option("--val-tokens", type=click.IntRange(8), default=256, show_default=True,
              help="Validation positions (the tail of the bundled Shakespeare corpus, the zoo models' held-out split).")
@click.option("--text", "text_file", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Validation text file instead of the bundled corpus tail.")
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: one per physical core this process may use).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def quality(reference, artifacts, prompts, new_tokens, val_tokens, text_file, threads, as_json):
    """Quality of ARTIFACTS (e.g. --weights int8 / int4 builds) against REFERENCE (the fp32 build of the
    same checkpoint): validation loss, teacher-forced top-1 agreement, greedy agreement, SPEED acceptance."""
    from rich.console import Console
    from rich.table import Table

    from speedc.quality import compare, to_json

    text = text_file.read_text(encoding="utf-8") if text_file else None
    with Console(stderr=True).status("measuring") as status:
        rows = compare(reference, list(artifacts), prompts=list(prompts) or None, new_tokens=new_tokens,
                       val_tokens=val_tokens, text=text, threads=threads, progress=status.update)
    if as_json:
        click.echo(json.dumps(to_json(rows), indent=2))
        return
    table = Table(title=f"quality against {reference} ({rows[0].val_tokens} validation positions, "
                        f"{rows[0].continuations} greedy continuations of {new_tokens} tokens)")
    for column in ("artifact", "weights", "MB", "val loss", "top-1 agree", "greedy agree", "identical", "SPEED acceptance"):
        table.add_column(column, justify="left" if column == "artifact" else "right")
    for r in rows:
        table.add_row(r.artifact, r.dtype, f"{r.stored_bytes / 1e6:.2f}", f"{r.val_loss:.4f}", f"{r.top1_agreement:.3f}",
                      f"{r.greedy_agreement:.3f}", f"{r.identical_continuations}/{r.continuations}", f"{r.speed_acceptance:.3f}")
    Console().print(table)
