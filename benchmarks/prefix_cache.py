"""Time to first token of a conversation's second turn with and without the prefix cache, on the
server's scheduler (continuous batching, 128-token prefill chunks), in one run:

    speedc build zoo:small -o out/small
    python benchmarks/prefix_cache.py --artifact out/small            # a ~1,000-token conversation

Turn 1: a long user message (Shakespeare text, --history tokens; random ids, seeded, where the artifact has
no tokenizer, e.g. a random-weight checkpoint of a real shape) and a reply of --reply tokens. Turn 2:
turn 1's prompt + its reply + a short message, asked once from a scheduler with a prefix cache (which
ran turn 1: its cache holds turn 1's prompt, a new one each round) and once from one without (the
prefill recomputes every token). Reported: the median first-token seconds of each over --rounds
alternating rounds, their ratio, the tokens the cache supplied; the turn-2 outputs must all be
identical (ids and log-probabilities) or it exits 1.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
from pathlib import Path

from speedc import Engine

CORPUS = Path(__file__).resolve().parent.parent / "models" / "data" / "shakespeare.txt.gz"


def first_token(engine: Engine, scheduler, prompt: list[int], new_tokens: int):
    request = engine.request_from(prompt, dict(max_new_tokens=new_tokens, stop_at_eos=False, logprobs=0))
    sequence = scheduler.submit(request)
    scheduler.run()
    return sequence, [p.logprob for p in request.picker.logprobs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--history", type=int, default=900, help="turn 1's prompt tokens")
    parser.add_argument("--reply", type=int, default=40, help="turn 1's reply tokens (greedy)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens turn 2 generates")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engine = Engine.load(args.artifact, threads=args.threads)
    if engine.tokenizer is not None:
        text = gzip.open(CORPUS, "rt").read()
        history = engine.encode(text[:20 * args.history])[:args.history]
        message = engine.encode("\n\nFIRST CITIZEN:\nAnd what says the duke to that?\n")
    else:  # ids of a random-weight checkpoint: what they say does not matter, only how many there are
        ids = random.Random(0)
        vocab = engine.manifest.model["vocab_size"]
        history, message = ([ids.randrange(vocab) for _ in range(n)] for n in (args.history, 15))
    cold = engine.batch_scheduler(max_batch=8)
    reply, _ = first_token(engine, cold, history, args.reply)
    turn = history + reply.out + message
    if len(turn) + args.new_tokens > engine.manifest.model["max_context"]:
        sys.exit(f"turn 2 ({len(turn)} tokens + {args.new_tokens}) exceeds the context; lower --history")
    hit_seconds, cold_seconds, outputs, saved = [], [], set(), 0
    for _ in range(args.rounds):
        cached = engine.batch_scheduler(max_batch=8, prefix_cache_mb=256)
        first_token(engine, cached, history, args.reply)  # turn 1 (leaves its prompt's rows)
        hit, hit_logprobs = first_token(engine, cached, turn, args.new_tokens)
        miss, miss_logprobs = first_token(engine, cold, turn, args.new_tokens)
        hit_seconds.append(hit.first_token_seconds)
        cold_seconds.append(miss.first_token_seconds)
        saved = hit.stats.cached_tokens
        outputs.add((tuple(hit.out), tuple(hit_logprobs)))
        outputs.add((tuple(miss.out), tuple(miss_logprobs)))
    result = {"turn2_prompt_tokens": len(turn), "cached_tokens": saved,
              "ttft_cold_s": round(statistics.median(cold_seconds), 4),
              "ttft_cached_s": round(statistics.median(hit_seconds), 4),
              "speedup": round(statistics.median(cold_seconds) / statistics.median(hit_seconds), 2),
              "outputs_identical": len(outputs) == 1}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"turn 2: {len(turn)} prompt tokens, {saved} from the prefix cache")
        print(f"first token: {result['ttft_cold_s']:.4f} s without the cache, {result['ttft_cached_s']:.4f} s with it "
              f"({result['speedup']:.1f}x sooner); outputs identical: {result['outputs_identical']}")
    return 0 if len(outputs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
