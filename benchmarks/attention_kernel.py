"""speedc's attention kernel alone (runtimes/kernels/attention.h) at a model's attention shape: what one SPEED
step's attention costs (CALLS calls of ROWS rows, each row a token at POSITIONS cached positions over its own
cache rows) for each pool type and each attention path this CPU runs, interleaved, with the bytes of cache it
reads per second.

    python benchmarks/attention_kernel.py                          # Ouro-1.4B: 16 heads of 128, 24 layers x 4 rows
    python benchmarks/attention_kernel.py --positions 256,1024 --threads 2

The caches are filled with values (pages of zeros left untouched would all read one shared page and time the
caches of the CPU, not its memory). Paths: the product path a session names selects the attention's
(avx512-vnni and amx: AVX-512; avx2: AVX2); every path gives the same bits (tests/numeric/test_attention_kernel.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from speedc.format import contract
from speedc.runtimes.kernels import native


def filled_cache(cache: str, shape: tuple, head_dim: int, rng) -> np.ndarray:
    """A pool [rows, kv_heads, T, width] of CACHE holding N(0, 1) values (int8: codes with scale 0.02)."""
    if cache != "int8":
        return rng.standard_normal((*shape, head_dim), dtype=np.float32).astype(cache)
    rows = rng.integers(0, 256, (*shape, native.kv_row_width("int8", head_dim)), dtype=np.uint8)
    scales = head_dim // native.KV_BLOCK
    rows[..., :4 * scales] = np.full((*shape, scales), 0.02, np.float32).view(np.uint8)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=24, help="calls a step (the model's layers)")
    parser.add_argument("--rows", type=int, default=4, help="rows a call (the step's slots)")
    parser.add_argument("--positions", default="256,1024", help="cached positions each token attends over")
    parser.add_argument("--caches", default="float16,int8,float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    kernel = native.load()
    if kernel is None:
        raise SystemExit(f"speedc's kernel is unavailable here: {native.unavailable_reason()}")
    paths = [p for p in ("avx2", "avx512-vnni") if p in kernel.paths] or ["portable"]
    rng = np.random.default_rng(0)
    inv_freq = contract.rotary_inv_freq(args.head_dim, 10000.0)
    qkv = rng.standard_normal((args.rows, 1, (args.heads + 2 * args.kv_heads) * args.head_dim), dtype=np.float32)
    print(f"{args.calls} calls x {args.rows} rows, {args.heads} heads ({args.kv_heads} kv) of {args.head_dim}, "
          f"{args.threads} threads; ms per step (GB/s of cache read)")
    print("| positions | pool | " + " | ".join(paths) + " |")
    print("|---|---|" + "---|" * len(paths))
    for positions in (int(p) for p in args.positions.split(",")):
        length = positions + 64
        for cache in args.caches.split(","):
            shape = (args.calls * args.rows, args.kv_heads, length)
            key, value = filled_cache(cache, shape, args.head_dim, rng), filled_cache(cache, shape, args.head_dim, rng)
            runs = {path: kernel.attention_bound(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                                 inv_freq=inv_freq, positions=length, threads=args.threads, path=path)
                    for path in paths}
            at = np.full(args.rows, positions, np.int64)
            one = np.ones(args.rows, np.int64)
            times = {path: [] for path in paths}
            for repeat in range(args.repeats + 1):  # the first round untimed
                for path, attention in runs.items():
                    start = time.perf_counter()
                    for call in range(args.calls):
                        rows = np.arange(args.rows, dtype=np.int64) + call * args.rows
                        attention(qkv, rows, at, one, key, value)
                    if repeat:
                        times[path].append(time.perf_counter() - start)
            read = 2 * key.nbytes * (positions + 1) / length  # each token's keys and values, positions 0..p
            cells = [f"{1000 * statistics.median(times[p]):.1f} ({read / statistics.median(times[p]) / 1e9:.1f})" for p in paths]
            print(f"| {positions} | {cache} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
