"""GPU check: the PyTorch backend (runtimes/backends/torch_backend.py) on the device, decoding through the
continuous-batching scheduler (runtimes/batch.py) with one sequence: the lossless check and the `speed`
vs `autoregressive` benchmark on a memory-bound configuration, written to one JSON report.

    python -m speedc.gpu_check --out gpu_check.json            # scripts/gpu_check.sh wraps this

Backends:
- torch (PyTorch CUDA): TorchBackend over an in-memory model (no ONNX needed, so it runs where only
  torch is installed), fp32 (default) or bf16 (--dtype bf16); --exact for batch-invariant decoding (a
  1-row and a P-row product may round differently; see TorchBackend.plain_step). On CUDA also
  torch+cuda-graphs: each step's layers replayed from a captured CUDA graph (one launch a step instead
  of hundreds; a failed capture is that row's error).
- onnxruntime-cuda: reported as not available (the batch backend runs ONNX Runtime on the CPU only).
- tensorrt: reported as not available (engine building is not part of this speedc build).

The model: random weights at hidden 2048, 6 unique blocks x 4 passes (1.2 GB of fp32 unique weights,
far past any cache), with the blocks' residual updates scaled down so that the early exit agrees with
the final head often (measured acceptance is reported): an end-to-end ratio on a memory-bound model
that the zoo cannot provide. Lossless: on each prompt, speed ids == autoregressive ids (both steps of
the scheduler on the same backend), and in fp32 == the PyTorch reference decoder's ids, greedy (the
reference decoder runs in fp32 only). Small settings (--hidden 64) make a CPU smoke run for CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = [[1, 17, 42, 7], [300, 5, 5, 9, 81, 2], [4000, 12], [77, 1200, 3, 3, 950, 14, 600]]
DTYPES = ("fp32", "bf16")


def _generate(backend, prompt: list[int], new_tokens: int, mode: str):
    """One greedy sequence through a BatchScheduler on BACKEND: speed steps (early flush on) or plain
    ones (row budget 0). -> (ids, stats, seconds of the whole run, prefill included)."""
    from speedc.models.sampling import SamplingParams, TokenPicker
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import RowPolicy
    from speedc.runtimes.decode import Request

    scheduler = BatchScheduler(backend, policy=RowPolicy(row_budget=None if mode == "speed" else 0))
    request = Request(prompt, new_tokens, TokenPicker(SamplingParams()), stop=lambda ids: None)
    sequence = scheduler.submit(request, early_flush=True)
    start = time.perf_counter()
    scheduler.run()
    return sequence.out, sequence.stats, time.perf_counter() - start


def measure_step_cost(backend, context: int, repeats: int = 50) -> float:
    """c(P) = (one speed step of P filled slots) / (one plain token / P), one sequence, the newest
    position in the middle of a CONTEXT-row cache, interleaved medians."""
    import numpy as np

    from speedc.step_timer import interleaved_medians
    from speedc.runtimes.backends.protocol import HeadRows

    slots = backend.slots
    if slots == 1:
        return 1.0
    context = max(context, 2 * slots)  # the oldest slot's position is >= 0
    backend.reserve(context, 1)
    newest = context // 2
    positions = np.arange(newest, newest - slots, -1).reshape(slots, 1)  # [P, 1], slot 0 newest
    valid = np.ones((slots, 1), bool)
    checks = list(range(1, slots - 1))  # a real step's heads: final, draft, an early-flush check per middle slot
    heads = HeadRows(final=[slots - 1], exit=[0], check=checks)  # the checks score the top K the backend holds
    token, at, one = np.ones(1, np.int64), np.full(1, newest, np.int64), np.ones(1, bool)
    step, plain = interleaved_medians(lambda: backend.speed_step(token, positions, valid, heads, False),
                                      lambda: backend.plain_step(token, at, one, False), repeats=repeats, warmup=5)
    return step / (plain / slots)


def check_backend(backend, reference_ids: list[list[int]] | None, prompts: list[list[int]], new_tokens: int,
                  repeats: int) -> dict:
    """Lossless on every prompt (speed == autoregressive, == REFERENCE_IDS where given), then interleaved
    timing of both modes; c(P) at the timed context."""
    from speedc.runtimes.decode import pooled_acceptance

    identical = 0
    for number, prompt in enumerate(prompts):
        speed_ids = _generate(backend, prompt, new_tokens, "speed")[0]
        plain_ids = _generate(backend, prompt, new_tokens, "autoregressive")[0]
        identical += speed_ids == plain_ids and (reference_ids is None or speed_ids == reference_ids[number])
    times = {"speed": [], "autoregressive": []}
    speed_runs = []
    for _ in range(repeats):
        for prompt in prompts:
            for mode in times:
                _, stats, seconds = _generate(backend, prompt, new_tokens, mode)
                times[mode].append(1000 * seconds / new_tokens)
                if mode == "speed":
                    speed_runs.append(stats)
    ms = {mode: round(statistics.median(values), 4) for mode, values in times.items()}
    context = max(len(p) for p in prompts) + new_tokens
    return {"lossless": identical == len(prompts), "identical_prompts": identical, "prompts": len(prompts),
            "compared_with": "autoregressive" + (" and the PyTorch reference" if reference_ids is not None else ""),
            "new_tokens": new_tokens, "ms_per_token_p50": ms,
            "speed_over_autoregressive": round(ms["autoregressive"] / ms["speed"], 3),
            "acceptance": round(pooled_acceptance(speed_runs), 4),
            "step_cost": round(measure_step_cost(backend, context), 3)}


def _graphed_row(model, passes: int, device: str, exact: bool, reference_ids, prompts, new_tokens: int,
                 repeats: int) -> dict:
    """check_backend on TorchBackend with each step's layers replayed from a captured CUDA graph; a
    capture or replay failure is the row's error (reported beside the eager row), not the check's end."""
    from speedc.runtimes.backends.torch_backend import TorchBackend

    try:
        backend = TorchBackend.from_model(model, passes, device=device, cuda_graphs=True, exact=exact)
        return check_backend(backend, reference_ids, prompts, new_tokens, repeats)
    except Exception as error:  # noqa: BLE001 -- torch raises many types from a failed capture
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {"lossless": False, "error": f"{type(error).__name__}: {message}"[:300]}


def run_check(*, device: str, hidden: int, blocks: int, passes: int, residual_scale: float, new_tokens: int,
              repeats: int, dtype: str = "fp32", exact: bool = False, progress=print) -> dict:
    import torch

    from speedc.bench.synthetic import random_model
    from speedc.models.generate import generate
    from speedc.runtimes.backends.torch_backend import TorchBackend

    if dtype not in DTYPES:
        raise SystemExit(f"gpu_check: --dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    started = time.perf_counter()
    report: dict = {"device": device, "torch": torch.__version__, "dtype": dtype, "exact": exact, "backends": {}}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no CUDA device")
        report["gpu"] = torch.cuda.get_device_name(device)
        report["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        # Full-precision products and reductions: the lossless check compares argmaxes.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    model = random_model(hidden, blocks, passes, residual_scale).to(device)
    prompts = [[t % model.cfg.vocab_size for t in p] for p in DEFAULT_PROMPTS]
    reference_ids = None
    if dtype == "fp32":  # the reference decoder computes in fp32 only
        progress(f"model on {device}; reference decoding")
        with torch.no_grad():
            reference_ids = [generate(model, prompt, new_tokens) for prompt in prompts]
    else:
        model = model.to(torch.bfloat16)
    unique_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report["model"] = {"hidden": hidden, "blocks": blocks, "passes": passes, "unique_weight_gb": round(unique_bytes / 1e9, 3),
                       "weight_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                       "residual_scale": residual_scale, "weights": "random (see module doc)"}
    progress(f"torch backend: {unique_bytes / 1e9:.2f} GB unique {dtype} weights; lossless + timing")
    report["backends"]["torch"] = check_backend(TorchBackend.from_model(model, passes, device=device, exact=exact),
                                                reference_ids, prompts, new_tokens, repeats)
    if device.startswith("cuda"):
        progress("torch backend with CUDA graphs: lossless + timing")
        report["backends"]["torch+cuda-graphs"] = _graphed_row(model, passes, device, exact, reference_ids, prompts,
                                                               new_tokens, repeats)
        report["backends"]["onnxruntime-cuda"] = {"skipped": "the batch backend (runtimes/backends/onnx.py) runs ONNX "
                                                             "Runtime on the CPU only in this version"}
        try:
            import tensorrt  # noqa: F401
            reason = "TensorRT engine building and the TensorRT backend are not part of this speedc build"
        except ImportError:
            reason = "tensorrt is not installed"
        report["backends"]["tensorrt"] = {"skipped": reason}
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="speedc GPU check: lossless + speed per installed GPU backend")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--residual-scale", type=float, default=0.1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weights, cache and products (bf16: no reference)")
    parser.add_argument("--exact", action="store_true",
                        help="batch-invariant decoding: SPEED's logits bitwise plain decoding's (plain steps run P-row products)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run_check(device=args.device, hidden=args.hidden, blocks=args.blocks, passes=args.passes,
                       residual_scale=args.residual_scale, new_tokens=args.new_tokens, repeats=args.repeats,
                       dtype=args.dtype, exact=args.exact,
                       progress=lambda m: print(f"gpu_check: {m}", file=sys.stderr, flush=True))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if all(b.get("lossless", True) for b in report["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
