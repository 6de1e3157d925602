"""SPEED's acceptance and speed under a JSON schema, with the draft masked by the grammar (the default),
without (the exit head drafts unconstrained; the final head is masked either way), against plain
decoding under the same grammar, and with no grammar, in one run (the greedy outputs of the first three
are identical, checked):

    speedc build zoo:small -o out/small
    python benchmarks/structured_output.py --artifact out/small

Each of --requests prompts is answered under one of a few schemas (an object of a name, a number, an
enum, a list); reported per setting: acceptance (confirmed / checked speculations), tokens per step,
tokens/s of decoding, and how many outputs validated as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from speedc import Engine
from speedc.runtimes.decode import pooled_acceptance

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"speaker": {"type": "string", "maxLength": 20},
                                      "mood": {"enum": ["angry", "merry", "sad"]}, "lines": {"type": "integer", "minimum": 1, "maximum": 99}},
     "required": ["speaker", "mood", "lines"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4},
]
PROMPTS = ["ROMEO:", "KING HENRY:\n", "First Citizen:\n", "JULIET:", "HAMLET:\n", "Enter", "O, ", "What say you"]


def run(engine: Engine, grammar_of, mask_draft: bool | None, requests: int, new_tokens: int, mode: str = "speed"):
    stats, texts, start = [], [], time.perf_counter()
    for i in range(requests):
        grammar = grammar_of(i)
        scheduler = engine._single_scheduler(mode)
        request = engine.request_from(PROMPTS[i % len(PROMPTS)], dict(max_new_tokens=new_tokens, grammar=grammar))
        if request.picker.constraint is not None:
            request.picker.constraint.mask_draft = mask_draft
        sequence = scheduler.submit(request)
        scheduler.run()
        stats.append(sequence.stats)
        texts.append(engine.decode_text(sequence.out))
    seconds = time.perf_counter() - start
    tokens = sum(s.new_tokens for s in stats)
    steps = sum(s.steps for s in stats)
    return {"acceptance": round(pooled_acceptance(stats), 3), "tokens_per_step": round((tokens - len(stats)) / steps, 3),
            "tokens_per_second": round(tokens / seconds, 1), "valid_json": sum(_valid(t) for t in texts),
            "texts": texts}


def _valid(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main(argv=None) -> int:
    from llguidance import LLMatcher

    from speedc.serve.protocol import JSON_OPTIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    engine = Engine.load(args.artifact, threads=args.threads)
    grammars = [LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS) for schema in SCHEMAS]
    results = {}
    constrained = lambda i: grammars[i % len(grammars)]  # noqa: E731
    for name, grammar_of, mask, mode in (("masked draft", constrained, True, "speed"),
                                         ("unmasked draft", constrained, False, "speed"),
                                         ("plain decoding", constrained, None, "autoregressive"),
                                         ("no grammar", lambda i: None, None, "speed")):
        results[name] = run(engine, grammar_of, mask, args.requests, args.new_tokens, mode)
    same = results["masked draft"]["texts"] == results["unmasked draft"]["texts"] == results["plain decoding"]["texts"]
    for result in results.values():
        del result["texts"]
    if args.json:
        print(json.dumps({"results": results, "identical_outputs": same}))
    else:
        print(f"{'setting':<16} {'acceptance':>10} {'tokens/step':>11} {'tokens/s':>9} {'valid JSON':>10}")
        for name, r in results.items():
            print(f"{name:<16} {r['acceptance']:>10.3f} {r['tokens_per_step']:>11.3f} {r['tokens_per_second']:>9.1f} "
                  f"{r['valid_json']:>6}/{args.requests}")
        print(f"masked and unmasked drafts and plain decoding give identical outputs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
