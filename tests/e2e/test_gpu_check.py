"""The GPU check script's logic (TorchBackend under the batch scheduler, one sequence), run on the CPU
device here (CI has no GPU), and the GPU paths themselves, skipped with a reason where no CUDA device
or provider exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speedc import Engine
from speedc.errors import SpeedcError
from speedc.bench.synthetic import random_model
from speedc.runtimes.backends.torch_backend import TorchBackend

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_smoke(tmp_path):
    """scripts/gpu_check.sh end to end, on the CPU device with a small model (what a GPU run does, smaller)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--hidden", "64", "--blocks", "2",
                          "--passes", "4", "--new-tokens", "12", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    torch_row = report["backends"]["torch"]
    assert torch_row["lossless"] is True and torch_row["prompts"] == torch_row["identical_prompts"] == 4
    assert torch_row["compared_with"] == "autoregressive and the PyTorch reference"  # speed == plain == reference
    assert 0 < torch_row["acceptance"] <= 1 and torch_row["step_cost"] > 0
    assert set(torch_row["ms_per_token_p50"]) == {"speed", "autoregressive"}
    assert report["model"]["blocks"] == 2 and report["device"] == "cpu" and report["model"]["weight_dtype"] == "float32"


@pytest.mark.parametrize("exact", [False, True])
def test_gpu_check_bf16_compares_speed_with_plain_decoding(exact):
    """bf16 weights, cache and products (no fp32 reference then), batch-invariant or not: SPEED ids ==
    plain ids on every prompt."""
    from speedc.gpu_check import run_check

    report = run_check(device="cpu", hidden=64, blocks=2, passes=2, residual_scale=0.1, new_tokens=10, repeats=1,
                       dtype="bf16", exact=exact, progress=lambda m: None)
    assert report["exact"] is exact
    torch_row = report["backends"]["torch"]
    assert torch_row["lossless"] is True and torch_row["identical_prompts"] == 4
    assert torch_row["compared_with"] == "autoregressive" and report["model"]["weight_dtype"] == "bfloat16"


def test_from_model_needs_stages_with_one_block_sequence():
    model = random_model(64, 2, 4, 0.1)  # 8 layers over 2 blocks
    assert TorchBackend.from_model(model, 4).stage_layers == 2
    with pytest.raises(SpeedcError, match="3 slots do not fit"):
        TorchBackend.from_model(model, 3)


@pytest.mark.skipif(not CUDA, reason="no CUDA device: the PyTorch CUDA path runs in scripts/gpu_check.sh on a GPU")
@pytest.mark.parametrize("dtype, exact", [("fp32", False), ("bf16", True)])
def test_gpu_check_cuda(dtype, exact):
    from speedc.gpu_check import run_check

    report = run_check(device="cuda", hidden=256, blocks=2, passes=4, residual_scale=0.1, new_tokens=16, repeats=1,
                       dtype=dtype, exact=exact, progress=lambda m: None)
    assert report["backends"]["torch"]["lossless"] is True
    assert report["backends"]["torch+cuda-graphs"]["lossless"] is True, report["backends"]["torch+cuda-graphs"]


def _has_ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@pytest.mark.skipif(not (CUDA and _has_ort_cuda()), reason="needs onnxruntime-gpu and an NVIDIA GPU")
def test_onnxruntime_cuda_matches_cpu(zoo_artifacts):
    art = zoo_artifacts["tiny"]
    cpu, gpu = Engine.load(art), Engine.load(art, device="cuda")
    for mode in ("speed", "autoregressive"):
        assert (cpu.generate("ROMEO:", max_new_tokens=48, stop_at_eos=False, mode=mode).ids
                == gpu.generate("ROMEO:", max_new_tokens=48, stop_at_eos=False, mode=mode).ids)
