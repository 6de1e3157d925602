"""ms/token of SPEED and plain decoding per weight precision, interleaved, on one zoo model.

    python benchmarks/quantized_weights.py                    # zoo:small: fp32, int8, int4, int4 + int8 head
    python benchmarks/quantized_weights.py --model tiny --threads 1 --rounds 5

Builds each precision of the model (speedc build --weights ...), then runs rounds; each round decodes
every prompt with every artifact in SPEED and in plain (autoregressive) mode, greedily, one after the
other, so a slow stretch of a shared machine hits every configuration alike. Before any number is
printed, SPEED's ids are checked equal to plain decoding's of the same artifact. Decode time only
(prefill excluded), medians over rounds x prompts. Quality per precision: `speedc quality`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PRECISIONS = {"fp32": {"dtype": "fp32"}, "int8": {"dtype": "int8"}, "int4": {"dtype": "int4"},
              "int4+int8 head": {"dtype": "int4", "head_dtype": "int8"}}
PROMPTS = ["ROMEO:", "First Citizen:\nWe are", "KING HENRY:\nNow", "To be, or not", "JULIET:\nO"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="zoo model name")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from speedc import Engine
    from speedc.build import build
    from speedc.models import zoo
    from speedc.passes.base import BuildOptions

    with tempfile.TemporaryDirectory() as tmp:
        engines, sizes = {}, {}
        for name, options in PRECISIONS.items():
            out = build(zoo.resolve(f"zoo:{args.model}"), Path(tmp) / name.replace(" ", "_").replace("+", ""),
                        BuildOptions(**options), force=True).out
            engines[name] = Engine.load(out, threads=args.threads)
            sizes[name] = engines[name].manifest.weights["stored_bytes"]
        times = {(name, mode): [] for name in engines for mode in ("speed", "autoregressive")}
        acceptance = {name: [] for name in engines}
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                for name, engine in engines.items():
                    ids = {}
                    for mode in ("speed", "autoregressive"):
                        result = engine.generate(prompt, max_new_tokens=args.new_tokens, stop_at_eos=False, mode=mode)
                        ids[mode] = result.ids
                        times[(name, mode)].append(1000 * result.stats.decode_seconds / (args.new_tokens - 1))
                        if mode == "speed":
                            acceptance[name].append(result.stats.acceptance_rate)
                    if ids["speed"] != ids["autoregressive"]:
                        raise SystemExit(f"{name}: SPEED's ids differ from plain decoding's on {prompt!r}")
    rows = [{"weights": name, "MB": round(sizes[name] / 1e6, 2),
             "speed_ms_per_token": round(statistics.median(times[(name, "speed")]), 3),
             "autoregressive_ms_per_token": round(statistics.median(times[(name, "autoregressive")]), 3),
             "acceptance": round(statistics.mean(acceptance[name]), 3)} for name in engines]
    for row in rows:
        row["speedup"] = round(row["autoregressive_ms_per_token"] / row["speed_ms_per_token"], 3)
    if args.json:
        print(json.dumps({"model": args.model, "threads": args.threads, "rounds": args.rounds, "rows": rows,
                          "measured_at": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
        return
    print(f"zoo:{args.model}, {args.rounds} rounds x {len(PROMPTS)} prompts x {args.new_tokens} tokens, greedy, "
          f"threads {args.threads or 'all'}, decode only, medians; ids identical (checked)")
    print("| weights | MB | SPEED ms/token | plain ms/token | SPEED speedup | acceptance |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['MB']} | {r['speed_ms_per_token']} | {r['autoregressive_ms_per_token']} | "
              f"{r['speedup']}x | {r['acceptance']} |")


if __name__ == "__main__":
    main()
