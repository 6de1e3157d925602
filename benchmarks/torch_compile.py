"""The PyTorch backend's step eager and through torch.compile (`--backend torch --compile`), in one run:

    speedc build zoo:small -o out/small
    python benchmarks/torch_compile.py --artifact out/small --threads 2

For each: the seconds of the first calls (a compiled engine compiles its step shapes then), then ms per
token of SPEED (speed-always) and of plain decoding, the best of --repeats generations of --tokens tokens
from one prompt; the ids of all four must be the same, or it exits 1.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from speedc import Engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="ROMEO:")
    args = parser.parse_args(argv)
    ids = set()
    for compile_step in (False, True):
        engine = Engine.load(args.artifact, backend="torch", compile_step=compile_step, threads=args.threads)
        start = time.perf_counter()
        for mode in ("speed-always", "autoregressive"):  # every cache bucket the timed runs reach, compiled here
            engine.generate(args.prompt, max_new_tokens=args.tokens, mode=mode, stop_at_eos=False)
        first = time.perf_counter() - start
        per_token = {}
        for mode in ("speed-always", "autoregressive"):
            runs = [engine.generate(args.prompt, max_new_tokens=args.tokens, mode=mode, stop_at_eos=False)
                    for _ in range(args.repeats)]
            per_token[mode] = min(r.stats.decode_seconds for r in runs) / args.tokens * 1e3
            ids.add(tuple(runs[0].ids))
        print(f"{'compiled' if compile_step else 'eager':>8}: first calls {first:.1f} s; ms/token SPEED "
              f"{per_token['speed-always']:.2f}, plain {per_token['autoregressive']:.2f} "
              f"({per_token['autoregressive'] / per_token['speed-always']:.2f}x)", flush=True)
    print("ids identical:", len(ids) == 1)
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
