"""GPU check: for every GPU backend whose package is installed, the lossless check and the `speed` vs
`autoregressive` benchmark on a memory-bound configuration, written to one JSON report.

    python -m speedc.gpu_check --out gpu_check.json            # scripts/gpu_check.sh wraps this

Backends:
- torch (PyTorch CUDA): drives the same decode loop over an in-memory model (no ONNX needed, so it
  runs where only torch is installed).
- onnxruntime-cuda (onnxruntime-gpu): builds the artifact and runs it with IO binding on the device.
- tensorrt: reported as not available (engine building is not part of this speedc build).

The model: random weights at hidden 2048, 6 unique blocks x 4 passes (1.2 GB of fp32 unique weights,
far past any cache), with the blocks' residual updates scaled down so that the early exit agrees with
the final head often (measured acceptance is reported): an end-to-end ratio on a memory-bound model
that the zoo cannot provide. Lossless: on each prompt, speed ids == autoregressive ids == the PyTorch
reference decoder's ids, greedy. Small settings (--hidden 64) make a CPU smoke run for CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = [[1, 17, 42, 7], [300, 5, 5, 9, 81, 2], [4000, 12], [77, 1200, 3, 3, 950, 14, 600]]


def _generate(backend, prompt: list[int], new_tokens: int, mode: str):
    from speedc.runtimes.decode import Request, decode_autoregressive, decode_speed, run_to_end
    from speedc.models.sampling import SamplingParams, TokenPicker

    request = Request(prompt, new_tokens, TokenPicker(SamplingParams()), stop=lambda ids: None)
    decoding = decode_speed(backend, request, early_flush=True) if mode == "speed" else decode_autoregressive(backend, request)
    start = time.perf_counter()
    ids, stats = run_to_end(decoding)
    return ids, stats, time.perf_counter() - start


def check_backend(backend, reference_ids: list[list[int]], prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Lossless on every prompt, then interleaved timing of both modes; c(P) at the timed context."""
    from speedc.bench.run import measure_step_cost
    from speedc.runtimes.decode import pooled_acceptance

    lossless = True
    for prompt, expected in zip(prompts, reference_ids):
        speed_ids = _generate(backend, prompt, new_tokens, "speed")[0]
        plain_ids = _generate(backend, prompt, new_tokens, "autoregressive")[0]
        lossless &= speed_ids == plain_ids == expected
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
    return {"lossless": lossless, "prompts": len(prompts), "new_tokens": new_tokens, "ms_per_token_p50": ms,
            "speed_over_autoregressive": round(ms["autoregressive"] / ms["speed"], 3),
            "acceptance": round(pooled_acceptance(speed_runs), 4),
            "step_cost": round(measure_step_cost(backend, context, repeats=50), 3)}


def _onnxruntime_cuda(model, slots: int, device: str, reference_ids, prompts, new_tokens, repeats, workdir: Path) -> dict:
    try:
        import onnxruntime

        from speedc.build import build
        from speedc.models.checkpoint import save_checkpoint
        from speedc.passes.base import BuildOptions
    except ImportError as missing:
        return {"skipped": f"{missing.name} is not installed (the compiler extra and onnxruntime-gpu are needed)"}
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return {"skipped": "onnxruntime has no CUDA provider (install onnxruntime-gpu)"}
    from speedc.runtimes.onnx_bound import OnnxBoundBackend

    artifact = build(save_checkpoint(model.cpu(), workdir / "checkpoint"), workdir / "artifact",
                     BuildOptions(slots=slots), force=True)
    return check_backend(OnnxBoundBackend(artifact.out, artifact.manifest, device=device), reference_ids, prompts,
                         new_tokens, repeats)


def run_check(*, device: str, hidden: int, blocks: int, passes: int, residual_scale: float, new_tokens: int,
              repeats: int, workdir: Path, progress=print) -> dict:
    import torch

    from speedc.bench.synthetic import random_model
    from speedc.models.generate import generate
    from speedc.runtimes.torch_backend import TorchBackend

    started = time.perf_counter()
    report: dict = {"device": device, "torch": torch.__version__, "backends": {}}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: torch sees no CUDA device")
        report["gpu"] = torch.cuda.get_device_name(device)
        report["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 everywhere: the lossless check compares argmaxes
    model = random_model(hidden, blocks, passes, residual_scale)
    unique_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report["model"] = {"hidden": hidden, "blocks": blocks, "passes": passes, "unique_weight_gb": round(unique_bytes / 1e9, 3),
                       "residual_scale": residual_scale, "weights": "random (see module doc)"}
    prompts = [[t % model.cfg.vocab_size for t in p] for p in DEFAULT_PROMPTS]
    progress(f"model: {unique_bytes / 1e9:.2f} GB unique weights on {device}; reference decoding")
    model = model.to(device)
    with torch.no_grad():
        reference_ids = [generate(model, prompt, new_tokens) for prompt in prompts]
    progress("torch backend: lossless + timing")
    report["backends"]["torch"] = check_backend(TorchBackend.from_model(model, passes, device=device), reference_ids,
                                                prompts, new_tokens, repeats)
    if device.startswith("cuda"):
        progress("onnxruntime-cuda backend")
        report["backends"]["onnxruntime-cuda"] = _onnxruntime_cuda(model, passes, device, reference_ids, prompts,
                                                                   new_tokens, repeats, workdir)
        try:
            import tensorrt  # noqa: F401
            reason = "TensorRT engine building and the TensorRT backend are not part of this speedc build"
        except ImportError:
            reason = "tensorrt is not installed"
        report["backends"]["tensorrt"] = {"skipped": reason}
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description="speedc GPU check: lossless + speed per installed GPU backend")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--residual-scale", type=float, default=0.1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        report = run_check(device=args.device, hidden=args.hidden, blocks=args.blocks, passes=args.passes,
                           residual_scale=args.residual_scale, new_tokens=args.new_tokens, repeats=args.repeats,
                           workdir=Path(tmp), progress=lambda m: print(f"gpu_check: {m}", file=sys.stderr, flush=True))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if all(b.get("lossless", True) for b in report["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
