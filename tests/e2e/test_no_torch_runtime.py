"""Deployment footprint: an artifact runs in a fresh virtual environment that has only numpy,
onnxruntime and tokenizers (then click and rich for the CLI): no torch, no compiler imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]

API_CHECK = """
import json, sys
from speedc import Engine
engine = Engine.load(sys.argv[1])
result = engine.generate("ROMEO:", max_new_tokens=16, stop_at_eos=False)
# speedc.models itself may load: the runtime shares its numpy-only sampling rule (models/sampling.py).
heavy = sorted(m for m in ("torch", "onnx", "onnx_graphsurgeon", "safetensors", "speedc.passes", "speedc.models.llama",
                           "speedc.models.checkpoint", "speedc.build", "click", "rich") if m in sys.modules)
print(json.dumps({"ids": result.ids, "heavy": heavy}))
"""


@pytest.mark.slow
def test_artifact_runs_without_torch(tmp_path, tiny_artifact):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")

    def pip(*args):
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True,
                       capture_output=True, text=True, timeout=600)

    pip("numpy", "onnxruntime", "tokenizers")
    pip("--no-deps", str(ROOT))  # the speedc package itself, without its declared extras
    # cwd outside the repository, so the installed package (not the source folder) is imported.
    run = subprocess.run([python, "-c", API_CHECK, str(tiny_artifact)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["heavy"] == [] and len(report["ids"]) == 16
    check_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, cwd=tmp_path)
    assert check_torch.returncode != 0  # really no torch in this environment

    from speedc import Engine

    assert report["ids"] == Engine.load(tiny_artifact).generate("ROMEO:", max_new_tokens=16, stop_at_eos=False).ids

    pip("click", "rich")
    speedc = str(venv / "bin" / "speedc")
    cli = subprocess.run([speedc, "generate", str(tiny_artifact), "--prompt", "ROMEO:", "--max-new-tokens", "16",
                          "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["ids"] == report["ids"]
    missing = subprocess.run([speedc, "generate", str(tiny_artifact), "--prompt", "hi", "--backend", "torch"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert_one_line_error(missing, "PyTorch backend needs the compiler extra", "speedc[compiler]")


def test_pass_infrastructure_and_cost_model_import_no_torch():
    """The pass runner, the schedule / cost model and inspect's artifact view load without torch
    (only the passes that trace a checkpoint need it), so bench and inspect can share the cost model."""
    code = ("import sys, speedc.passes.base, speedc.cost_model, speedc.format.contract, speedc.format.artifact, speedc.inspect; "
            "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
