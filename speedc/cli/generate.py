"""`speedc generate`: run an artifact (ONNX Runtime by default: no torch imported)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from speedc.cli.options import FiniteFloat, backend_options, compile_option, flag, given_options
from speedc.errors import BatchError, GenerationError
from speedc.runtimes.exit_rule import depth_settings
from speedc.runtimes.speculation import DEFAULT_ROW_BUDGET, MODES


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",")]  # "1,,2" is refused, not read as 1,2
    except ValueError:
        raise GenerationError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _refuse_batch_options_without_file() -> None:
    """The batching options shape --prompts-file's run; with one prompt they were silently ignored."""
    given = given_options("max_batch", "kv_cache_mb", "row_budget")
    if given:
        raise GenerationError(f"{flag(given[0])} goes with --prompts-file (a single prompt decodes alone)")


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--prompts-file", type=click.Path(path_type=Path), default=None,
              help="One prompt per line, decoded together (continuous batching); output in input order.")
@click.option("--max-batch", type=int, default=8, show_default=True, help="With --prompts-file: sequences in flight.")
@click.option("--kv-cache-mb", type=FiniteFloat(), default=None,
              help="With --prompts-file: most memory for the KV-cache pool (default: every pool row may hold the full "
                   "context; the pool holds only what its sequences need: their number, the longest prompt + --max-new-tokens).")
@click.option("--row-budget", type=click.IntRange(min=0), default=None,
              help=f"With --prompts-file: speculate while a step has at most this many rows (default {DEFAULT_ROW_BUDGET}; "
                   "0: never).")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--mode", type=click.Choice(list(MODES)), default="speed", show_default=True,
              help="speed: SPEED while it pays on this host (step costs measured as it runs, the text's acceptance), "
                   "plain decoding else; speed-always: speculate at every step (to measure SPEED itself); "
                   "autoregressive: plain decoding. The same tokens in every mode.")
@click.option("--temperature", type=FiniteFloat(), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=FiniteFloat(), default=1.0, show_default=True)
@click.option("--repetition-penalty", type=FiniteFloat(), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="RNG seed for sampling (same seed, same text in every mode).")
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-text token.")
@click.option("--early-flush/--no-early-flush", default=None,
              help="Flush as soon as a deeper exit head contradicts the in-flight successor (default: on).")
@click.option("--loops", type=int, default=None,
              help="Loops each token runs (Ouro's total_ut_steps; Huginn's num_steps, Parcae's recurrence), up to the "
                   "artifact's; default: all.")
@click.option("--exit-at-step", type=int, default=None,
              help="Read every token's logits after this loop (from 0; Ouro's exit_at_step). Deeper loops do not run.")
@click.option("--exit-threshold", type=FiniteFloat(), default=None,
              help="Read each token's logits at the first loop where its exit gate's cumulative probability reaches "
                   "this (Ouro's exit_threshold, 0..1).")
@click.option("--weighted-exit", is_flag=True,
              help="Logits = every loop's, weighted by the exit gate's probabilities (Ouro's use_weighted_exit).")
@backend_options
@compile_option
@click.option("--stream", is_flag=True, help="Print text as tokens are confirmed.")
@click.option("--stats", is_flag=True, help="Print decode statistics to stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with ids, text and stats.")
def generate(artifact, prompt, prompt_ids, prompts_file, max_batch, kv_cache_mb, row_budget, max_new_tokens, mode, temperature, top_k, top_p, repetition_penalty, seed,
             stop, ignore_eos, early_flush, loops, exit_at_step, exit_threshold, weighted_exit, backend, device, threads,
             kv_cache, compile_step, stream, stats, as_json):
    """Generate from a compiled ARTIFACT with SPEED (or plain autoregressive decoding)."""
    from speedc.runtimes.engine import Engine

    if sum(x is not None for x in (prompt, prompt_ids, prompts_file)) != 1:
        raise GenerationError("give exactly one of --prompt, --prompt-ids or --prompts-file")
    options = dict(max_new_tokens=max_new_tokens, mode=mode, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, repetition_penalty=repetition_penalty, stop=list(stop) or None,
                   stop_at_eos=not ignore_eos, early_flush=early_flush)
    depth = depth_settings(loops, exit_at_step, exit_threshold, weighted_exit)
    options.update({name: value for name, value in depth.items() if value not in (None, False)})
    if prompts_file is not None:
        if stream:
            raise GenerationError("--stream prints one sequence; with --prompts-file use --json or plain output")
        prompts = _read_prompts(prompts_file)
        engine = Engine.load(artifact, backend=backend, device=device, threads=threads, lazy=True,  # opened when the batch starts
                             compile_step=compile_step, kv_cache=kv_cache)
        _generate_file(engine, prompts, options, max_batch=max_batch, kv_cache_mb=kv_cache_mb, row_budget=row_budget,
                       threads=threads, stats=stats, as_json=as_json)
        return
    _refuse_batch_options_without_file()
    if stream and as_json:
        raise GenerationError("--stream prints text as it comes, --json one object at the end: choose one")
    source = prompt if prompt is not None else _parse_ids(prompt_ids)
    engine = Engine.load(artifact, backend=backend, device=device, threads=threads, compile_step=compile_step, kv_cache=kv_cache)
    if stream:
        pieces = engine.stream(source, **options)
        for piece in pieces:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
        result_stats = pieces.stats
    else:
        result = engine.generate(source, **options)
        result_stats = result.stats
        if as_json:
            # products: what ran the weight products (e.g. "speedc kernel (i8mm, 2 threads)", "MatMulNBits (why)")
            click.echo(json.dumps(result.to_json() | {"products": getattr(engine.backend, "products", None)}))
        else:
            click.echo(result.text if result.text is not None else ",".join(map(str, result.ids)))
    if stats and not as_json:
        _print_stats(result_stats)


def _generate_file(engine, prompts: list[str], options: dict, *, max_batch: int, kv_cache_mb, row_budget, threads,
                   stats: bool, as_json: bool) -> None:
    """--prompts-file: every prompt decoded together (continuous batching), a line (or JSON object) each in
    input order; prompts that could not run are reported after the others."""
    rules = MODES[options.pop("mode")]
    budget = rules.batch_row_budget if row_budget is None or not rules.speculates else row_budget
    failure = None
    try:
        results = engine.generate_batch(prompts, max_batch=max_batch, kv_cache_mb=kv_cache_mb, row_budget=budget,
                                        per_sequence=rules.per_sequence, threads=threads, **options)
    except BatchError as failed:  # some prompts could not run: print the others, then the error
        results, failure = failed.results, failed
    for result in results:
        if result is None:
            if as_json:
                click.echo(json.dumps({"error": str(failure)}))  # its place in input order
            continue
        if as_json:
            click.echo(json.dumps(result.to_json() | {"products": getattr(engine.backend, "products", None)}))
        else:
            click.echo(_one_line(result.text) if result.text is not None else ",".join(map(str, result.ids)))
    if stats and not as_json:
        for result in results:
            if result is not None:
                _print_stats(result.stats)
    if failure is not None:
        raise failure


def _one_line(text: str) -> str:
    """A completion on one output line (backslash, newline and carriage return escaped), so the plain
    output of --prompts-file has exactly one line per prompt; --json carries the exact text."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _read_prompts(path: Path) -> list[str]:
    """One prompt per line: lines end at \\n or \\r\\n only (a form feed or U+2028 inside a prompt stays in
    it, as `wc -l` counts), a UTF-8 byte-order mark is not part of the first prompt; "-" reads stdin."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as bad:
        raise GenerationError(f"--prompts-file {path}: cannot read it ({bad.__class__.__name__})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline ending the last line
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    for number, line in enumerate(lines, 1):
        if not line:  # a line of spaces is a prompt, as --prompt "  " is
            raise GenerationError(f"--prompts-file {path}: line {number} is empty (one prompt per line)")
    if not lines:
        raise GenerationError(f"--prompts-file {path}: no prompts")
    return lines


def _print_stats(stats) -> None:
    from rich.console import Console
    from rich.table import Table

    data = stats.to_json()
    table = Table(title="decode stats", show_header=False)
    for key in ("mode", "prompt_tokens", "new_tokens", "steps", "speed_steps", "depth_steps", "plain_steps", "fallbacks",
                "probes", "cost_samples", "depth", "accepted", "mispredicted", "early_flushes", "flushed_tokens", "acceptance_rate",
                "tokens_per_step", "step_cost", "step_cost_source", "bound", "prefill_seconds", "decode_seconds",
                "decode_tokens_per_second", "stop_reason", "depth_rule", "exit_loops"):
        value = data[key]
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    if data["policy"]:
        table.add_row("policy", data["policy"])
    for row in (data["host_costs"] or {}).get("measured", []):
        table.add_row(f"measured here: {row['sequences']} seq, context <= {row['context_band']}", _cost_row(row))
        for depth, values in row.get("depths", {}).items():
            table.add_row(f"  the P slots as {depth}", _cost_row(values))
    Console(stderr=True).print(table)


def _cost_row(row: dict) -> str:
    """One StepCosts.report row: the step times and the c(P) each gives."""
    parts = [f"{kind} {row[kind + '_ms']:.2f} ms" for kind in ("plain", "speed", "full") if kind + "_ms" in row]
    if "step_cost" in row:
        parts.append(f"c {row['step_cost']:.2f} (full step)")
    if "mean_step_cost" in row:
        parts.append(f"{row['mean_step_cost']:.2f} (mean step)")
    return ", ".join(parts)
