"""The paper's claim on our corpus: a shared-weight model (2 unique blocks x 4 passes) against the
plain model with its parameters (2x1) and the plain model with its depth (8x1), same hidden size,
same training budget (steps x batch x sequence length).

    python benchmarks/paper_table.py train     # trains runs/paper/{2x1,2x4,8x1}; resumes if stopped
    python benchmarks/paper_table.py measure   # builds each, measures latency, writes the table
    python benchmarks/paper_table.py all       # both

The claim tested: 2x4 beats 2x1 on validation loss, and 2x4 decoded with SPEED runs within 1.3x of
2x1's plain latency. Latencies are measured in one run, interleaved (2x1 plain, 2x4 plain, 2x4 SPEED,
8x1 plain, repeat), on the same prompts and number of new tokens, greedy; SPEED's ids are checked
against plain decoding of the same model before any number is written.

The table goes to stdout, to runs/paper/table.md and runs/paper/table.json; the README quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODELS = {  # name -> (preset, exit-loss weight). Only 2x4 runs with SPEED, so only it trains an exit head.
    "2x1": ("paper-2x1", 0.0),
    "2x4": ("paper-2x4", 0.5),
    "8x1": ("paper-8x1", 0.0),
}


def train_all(runs: Path, steps: int, batch_size: int, seq_len: int, threads: int) -> None:
    from speedc.models.train import STATE_FILE, TrainOptions, train

    for name, (preset, exit_weight) in MODELS.items():
        out = runs / name
        state_file = out / STATE_FILE
        done = json.loads(state_file.read_text())["step"] if state_file.exists() else 0
        if done >= steps:
            print(f"{name}: already trained ({done} steps)", flush=True)
            continue
        opts = TrainOptions(preset=preset, steps=steps, batch_size=batch_size, seq_len=seq_len,
                            exit_weight=exit_weight, eval_every=500, save_every=250, threads=threads)
        started = time.time()

        def report(step: int, total: int, metrics: dict, name=name) -> None:
            if step % 100 == 0 or step == total:
                print(f"{name}: step {step}/{total} {time.time() - started:.0f} s "
                      + " ".join(f"{k}={v}" for k, v in metrics.items()), flush=True)

        state = train(out, opts, resume=state_file.exists(), progress=report)
        print(f"{name}: trained, {state['wall_seconds']:.0f} s, {state['history'][-1]}", flush=True)


PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n", "KING HENRY:\n",
           "To be, or not to be, that is the question:\n", "JULIET:\nO Romeo, Romeo!"]


def measure_all(runs: Path, new_tokens: int, repeats: int, threads: int | None) -> dict:
    from speedc.build import build
    from speedc.models.train import STATE_FILE
    from speedc.runtimes.engine import Engine

    engines, training = {}, {}
    for name in MODELS:
        state = json.loads((runs / name / STATE_FILE).read_text())
        training[name] = {"steps": state["step"], "tokens_seen": state["tokens_seen"],
                          "wall_seconds": state["wall_seconds"], **state["history"][-1]}
        artifact = build(runs / name, runs / f"{name}.artifact", force=True).out
        engines[name] = Engine.load(artifact, threads=threads)
    systems = [("2x1", "autoregressive"), ("2x4", "autoregressive"), ("2x4", "speed"), ("8x1", "autoregressive")]
    samples: dict[tuple[str, str], list[float]] = {system: [] for system in systems}
    for name, mode in systems:  # warm-up
        engines[name].generate(PROMPTS[0], max_new_tokens=8, stop_at_eos=False, mode=mode)
    for _ in range(repeats):
        for prompt in PROMPTS:
            outputs = {}
            for name, mode in systems:
                start = time.perf_counter()
                result = engines[name].generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, mode=mode)
                samples[(name, mode)].append(1000 * (time.perf_counter() - start) / new_tokens)
                outputs[(name, mode)] = result.ids
            if outputs[("2x4", "speed")] != outputs[("2x4", "autoregressive")]:
                raise SystemExit("2x4: SPEED and plain decoding produced different ids; refusing to report latency")
    latency = {f"{name} {mode}": round(statistics.median(values), 3) for (name, mode), values in samples.items()}
    plain_2x1 = latency["2x1 autoregressive"]
    speed_2x4 = latency["2x4 speed"]
    return {
        "training": training, "ms_per_token_p50": latency, "new_tokens": new_tokens,
        "runs_per_system": repeats * len(PROMPTS), "threads": threads,
        "claims": {
            "2x4 beats 2x1 on val loss": training["2x4"]["val_loss_final"] < training["2x1"]["val_loss_final"],
            "2x4 SPEED / 2x1 plain latency": round(speed_2x4 / plain_2x1, 3),
            "2x4 SPEED within 1.3x of 2x1 plain": speed_2x4 <= 1.3 * plain_2x1,
        },
    }


def markdown(report: dict) -> str:
    t, ms = report["training"], report["ms_per_token_p50"]
    lines = ["| model (blocks x passes) | val loss (final) | val loss (exit) | exit/final top-1 | plain ms/token | SPEED ms/token |",
             "|---|---|---|---|---|---|"]
    for name in MODELS:
        speed = ms.get(f"{name} speed")
        exit_cells = (f"{t[name]['val_loss_exit']:.3f}", f"{t[name]['agree_top1']:.3f}") if name == "2x4" else ("-", "-")
        lines.append(f"| {name} | {t[name]['val_loss_final']:.3f} | {exit_cells[0]} | {exit_cells[1]} | "
                     f"{ms[f'{name} autoregressive']:.3f} | {'-' if speed is None else f'{speed:.3f}'} |")
    claims = report["claims"]
    first = next(iter(t.values()))
    lines += ["", f"Budget: {first['steps']} steps, {first['tokens_seen']:,} training tokens each; "
                  f"latency = end-to-end ms per new token (p50 of {report['runs_per_system']} runs x "
                  f"{report['new_tokens']} tokens, ONNX Runtime CPU, interleaved).",
              f"2x4 beats 2x1 on loss: {'yes' if claims['2x4 beats 2x1 on val loss'] else 'no'}; "
              f"2x4 SPEED / 2x1 plain = {claims['2x4 SPEED / 2x1 plain latency']:.2f}x "
              f"({'within' if claims['2x4 SPEED within 1.3x of 2x1 plain'] else 'not within'} 1.3x)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["train", "measure", "all"])
    parser.add_argument("--runs", type=Path, default=Path("runs/paper"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--train-threads", type=int, default=0, help="torch threads for training (0: default)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all)")
    args = parser.parse_args()
    if args.phase in ("train", "all"):
        train_all(args.runs, args.steps, args.batch_size, args.seq_len, args.train_threads)
    if args.phase in ("measure", "all"):
        report = measure_all(args.runs, args.new_tokens, args.repeats, args.threads)
        table = markdown(report)
        (args.runs / "table.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.runs / "table.md").write_text(table + "\n")
        print(table)


if __name__ == "__main__":
    sys.exit(main())
