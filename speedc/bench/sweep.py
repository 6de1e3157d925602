"""`speedc bench artifact OUT --sweep slots|length`: how SPEED's gain moves with pipeline depth and context.

slots:  the artifact's weights are recompiled at every valid pipeline depth P in (1, 2, 4, 8) (the
        schedule pass says which the layer map allows); each depth gets the full interleaved
        speed / autoregressive measurement: speedup, acceptance, c(P) and the analytic bound.
length: the artifact as built, with prompts cut to fill the context up to 128, 256, ... 2048 tokens
        (up to the model's limit): ms/token of both modes, speedup (and speculating at every step's), the
        default mode's speed / plain steps and c(P) at that context.

Recompiling needs the compiler (torch, onnx): the `compiler` extra.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from speedc.format.artifact import TOKENIZER
from speedc.bench.run import DEFAULT_PROMPTS, run_bench
from speedc.errors import SpeedcError
from speedc.runtimes.engine import Engine

SWEEP_SLOTS = (1, 2, 4, 8)
SWEEP_CONTEXTS = (128, 256, 512, 1024, 2048)


def _row(report, **extra) -> dict:
    """ms/token and speedups here are decode only (prefill excluded), as BenchReport.speedup_p50; beside the default
    mode's, speculating at every step and the default mode's speed / plain steps (where it fell back)."""
    return {**extra, "ms_per_token_speed": report.ms_per_token["speed"]["p50"],
            "ms_per_token_autoregressive": report.ms_per_token["autoregressive"]["p50"],
            "speedup": report.speedup_p50, "speedup_always": report.speedup_always_p50,
            "speed_steps": report.policy["speed_steps"], "plain_steps": report.policy["plain_steps"],
            "acceptance": report.acceptance_rate,
            "tokens_per_step": report.tokens_per_step, "step_cost": report.step_cost, "bound": report.bound}


def sweep_slots(engine: Engine, *, prompts: list[str] | None, new_tokens: int, repeats: int,
                threads: int | None, backend: str = "onnx", device: str = "cpu",
                progress=lambda message: None) -> dict:
    """One row per pipeline depth the layer map allows; the rest are listed as skipped, with why."""
    try:
        from speedc.build import build
        from speedc.models.checkpoint.torch_io import save_checkpoint
        from speedc.passes.base import BuildOptions
        from speedc.runtimes.backends.torch_backend import load_model_from_artifact
    except ImportError:
        raise SpeedcError("--sweep slots recompiles the model: pip install 'speedc[compiler]'") from None
    manifest = engine.manifest
    valid = set(manifest.valid_slots)
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model_from_artifact(engine.directory, manifest)
        tokenizer = engine.directory / TOKENIZER
        checkpoint = save_checkpoint(model, Path(tmp) / "checkpoint",
                                     tokenizer_json=tokenizer.read_text() if tokenizer.exists() else None)
        for slots in SWEEP_SLOTS:
            if slots not in valid:
                skipped[str(slots)] = (f"the layer map {manifest.layer_map} with exit after layer {manifest.exit_layer} "
                                       f"allows P in {sorted(valid)}")
                continue
            progress(f"P={slots}: compiling and measuring")
            options = BuildOptions(slots=slots, dtype=manifest.dtype, exit_layer=manifest.exit_layer,
                                   block_size=manifest.store.block_size or 32)
            artifact = build(checkpoint, Path(tmp) / f"p{slots}", options, force=True).out
            depth_engine = Engine.load(artifact, backend=backend, device=device, threads=threads, verify=False)
            report = run_bench(depth_engine, prompts=prompts, new_tokens=new_tokens, repeats=repeats)
            rows.append(_row(report, slots=slots))
    return {"rows": rows, "skipped": skipped}


def _prompt_filling(engine: Engine, prompts: list[str], length: int) -> list[int]:
    """Token ids of the prompt texts repeated until LENGTH tokens, cut there."""
    ids: list[int] = []
    while len(ids) < length:
        for prompt in prompts:
            ids += engine.encode(prompt)
    return ids[:length]


def sweep_length(engine: Engine, *, prompts: list[str] | None, new_tokens: int, repeats: int,
                 progress=lambda message: None) -> dict:
    """One row per context size up to the model's limit: prompt of (context - new tokens) tokens."""
    prompts = prompts or DEFAULT_PROMPTS
    limit = engine.manifest.dims.max_context
    rows, skipped = [], {}
    for context in SWEEP_CONTEXTS:
        if context > limit:
            skipped[str(context)] = f"beyond the model's context of {limit} tokens"
            continue
        generated = min(new_tokens, context // 2)
        progress(f"context {context}: measuring")
        prompt_ids = [_prompt_filling(engine, prompts[i:] + prompts[:i], context - generated) for i in range(2)]
        report = run_bench(engine, prompts=prompt_ids, new_tokens=generated, repeats=repeats)
        rows.append(_row(report, context=context, new_tokens=generated))
    return {"rows": rows, "skipped": skipped}
