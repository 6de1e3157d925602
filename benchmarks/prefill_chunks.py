"""What a prefill chunk costs the requests decoding beside it, per chunk size, on the server's scheduler:

    speedc build zoo:small -o out/small
    python benchmarks/prefill_chunks.py --artifact out/small --threads 2

--running requests decode (greedy, ids never checked: the lossless tests own that) while a --prompt-token
prompt is prefilled in chunks of each --chunks size, one chunk an iteration, each iteration also a decode
step for the running ones (BatchScheduler.step). Then a --echo-token prompt whose log-probabilities are
asked, which prefills a token a run. Reported, medians: an iteration that only decodes, one with a chunk
(the delay each running stream's next token takes), the iterations and seconds the long prompt took,
and an echo iteration.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from speedc import Engine

PROMPTS = ["ROMEO:", "JULIET:", "HAMLET:", "O, ", "KING HENRY:", "Enter", "What say you", "First Citizen:"]


def timed_steps(scheduler, until) -> list[float]:
    """Seconds of each scheduler iteration while UNTIL() is false."""
    seconds = []
    while not until():
        start = time.perf_counter()
        scheduler.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def one_chunk_size(engine: Engine, chunk: int, args) -> str:
    scheduler = engine.batch_scheduler(max_batch=args.running + 1, prefill_chunk=chunk)
    for prompt in PROMPTS[:args.running]:
        scheduler.submit(engine.request_from(prompt, dict(max_new_tokens=engine.manifest.dims.max_context // 2,
                                                          stop_at_eos=False)))
    for _ in range(40):  # prefilled and warm
        scheduler.step()
    decode = []
    for _ in range(30):
        start = time.perf_counter()
        scheduler.step()
        decode.append(time.perf_counter() - start)
    ids = [5 + i % 200 for i in range(args.prompt_tokens)]
    long = scheduler.submit(engine.request_from(ids, dict(max_new_tokens=2, stop_at_eos=False)))
    chunks = timed_steps(scheduler, lambda: long.state not in ("waiting", "prefill"))
    echo = scheduler.submit(engine.request_from(ids[:args.echo_tokens], dict(max_new_tokens=1, stop_at_eos=False,
                                                                             prompt_logprobs=1)))
    scored = timed_steps(scheduler, lambda: echo.state not in ("waiting", "prefill"))
    return (f"| {chunk} | {statistics.median(decode) * 1e3:.1f} ms | {statistics.median(chunks[:-1]) * 1e3:.1f} ms | "
            f"{len(chunks)} iterations, {sum(chunks):.2f} s | {statistics.median(scored) * 1e3:.1f} ms |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--running", type=int, default=4, choices=range(1, len(PROMPTS) + 1), metavar="1..8")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--echo-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    engine = Engine.load(args.artifact, threads=args.threads)
    if args.prompt_tokens + 2 > engine.manifest.dims.max_context:
        parser.error(f"--prompt-tokens: the model's context is {engine.manifest.dims.max_context}")
    print(f"{args.running} requests decoding; a {args.prompt_tokens}-token prompt; an echo of {args.echo_tokens} tokens")
    print("| prefill chunk | decode-only iteration | iteration with a chunk | the long prompt | echo iteration |")
    print("|---|---|---|---|---|")
    for chunk in args.chunks:
        print(one_chunk_size(engine, chunk, args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
