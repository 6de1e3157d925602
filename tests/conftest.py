"""Shared fixtures: random shared-weight models of varied shapes, and the bundled zoo models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from speedc.errors import GenerationError
from speedc.models.config import ModelConfig
from speedc.models.families import read_config

# Small models run fastest single-threaded, and a second training or test process on a 2-core
# machine would otherwise make OpenMP threads spin against each other.
torch.set_num_threads(int(os.environ.get("SPEEDC_TEST_THREADS", "1")))
os.environ.setdefault("SPEEDC_THREADS", os.environ.get("SPEEDC_TEST_THREADS", "1"))

ZOO = Path(__file__).resolve().parent.parent / "models" / "zoo"
ZOO_MODELS = [name for name in ("tiny", "small") if (ZOO / name / "model.safetensors").exists()]


def random_config(*, vocab=97, hidden=32, heads=4, kv_heads=2, layers=6, layer_map=None, blocks=2, exit_layer=None,
                  exit_norm="own", tie=True, theta=10000.0, intermediate=48, context=128) -> ModelConfig:
    spec = layer_map if layer_map is not None else {"pattern": "cycle", "num_blocks": blocks}
    return read_config({
        "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rope_theta": theta, "max_position_embeddings": context, "tie_word_embeddings": tie,
        "speedc": {"layer_map": spec, "exit": {"layer": exit_layer or blocks, "norm": exit_norm}},
    })


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.15) -> torch.nn.Module:
    """Random weights large enough that logits are far from uniform (norm weights jittered too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    return model.eval()


@pytest.fixture
def sampled_logits(monkeypatch):
    """(seen, decoding_as): every logits row the sampler is handed, recorded as seen[mode][position]
    while decoding_as(mode) is in effect (a spy: the real TokenPicker.pick still runs)."""
    import numpy as np

    from speedc.models.sampling import TokenPicker

    seen: dict[str, dict[int, "np.ndarray"]] = {}
    original = TokenPicker.pick

    def recording_pick(self, logits, argmax_token, history):
        if logits is not None:
            seen.setdefault(self.mode_label, {})[len(history)] = np.array(logits)
        return original(self, logits, argmax_token, history)

    monkeypatch.setattr(TokenPicker, "pick", recording_pick)
    return seen, lambda mode: monkeypatch.setattr(TokenPicker, "mode_label", mode, raising=False)


@pytest.fixture(params=ZOO_MODELS)
def zoo_model_dir(request) -> Path:
    return ZOO / request.param


def pytest_report_header(config):
    return f"zoo models: {', '.join(ZOO_MODELS) or 'none'}; torch threads {torch.get_num_threads()}; " \
           f"SPEEDC_LONG_TESTS={os.environ.get('SPEEDC_LONG_TESTS', '0')}"


def build_artifact(model_or_dir, out: Path, **options) -> Path:
    """Save a model (if given one) as a checkpoint beside `out` and compile it."""
    from speedc.build import build
    from speedc.models.checkpoint.torch_io import save_checkpoint
    from speedc.passes.base import BuildOptions

    if isinstance(model_or_dir, (str, Path)):
        checkpoint = Path(model_or_dir)
    else:
        checkpoint = save_checkpoint(model_or_dir, out.parent / f"{out.name}.ckpt")
    build(checkpoint, out, BuildOptions(**options), force=True)
    return out


@pytest.fixture
def memory_for_256_positions(monkeypatch):
    """A stand-in memory limit: the OS refuses any KV-cache pool longer than 256 positions."""
    import numpy as np

    from speedc.runtimes.backends import onnx as batch_backend

    real_zeros = np.zeros

    def zeros(shape, *args, **kwargs):
        if isinstance(shape, tuple) and len(shape) == 6 and shape[4] > 257:  # [S, P, W, kvh, T + 1, hd]
            raise MemoryError
        return real_zeros(shape, *args, **kwargs)

    monkeypatch.setattr(batch_backend.np, "zeros", zeros)


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory) -> Path:
    return build_artifact(ZOO / "tiny", tmp_path_factory.mktemp("tiny") / "art")


@pytest.fixture(scope="session")
def zoo_artifacts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {name: build_artifact(ZOO / name, root / name) for name in ZOO_MODELS}


class FailsAtPick:
    """A stand-in for a request's own failure (its grammar, its sampling): the real TokenPicker, except that
    its K-th pick raises."""

    def __init__(self, picker, k: int) -> None:
        self.picker, self.k, self.picks = picker, k, 0

    def __getattr__(self, name):
        return getattr(self.picker, name)

    def pick(self, *args):
        self.picks += 1
        if self.picks == self.k:
            raise GenerationError(f"scripted failure at pick {self.k}")
        return self.picker.pick(*args)


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, stdin: str | None = None, cwd=None):
    """Run the installed `speedc` console script (STDIN: text fed to it; CWD: where); returns CompletedProcess."""
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("speedc")
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, input=stdin, cwd=cwd)


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def onnx_graphs(graph):
    """An ONNX GraphProto and every subgraph in it (an engine graph's If branches), outermost first."""
    found, stack = [], [graph]
    while stack:
        part = stack.pop(0)
        found.append(part)
        for node in part.node:
            for attribute in node.attribute:
                stack += ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)
    return found


def onnx_nodes(graph) -> list:
    """Every node of an ONNX GraphProto, its subgraphs' included."""
    return [node for part in onnx_graphs(graph) for node in part.node]


def run_engine_program(session, program: str, feeds: dict) -> dict:
    """Run one program (contract.PREFILL / BATCH_STEP) of an engine graph's ONNX Runtime SESSION on FEEDS:
    the branch selector set, every input of the other program fed a small placeholder. -> outputs by name."""
    import numpy as np

    from speedc.format import contract

    filled = dict(feeds)
    for tensor in session.get_inputs():
        if tensor.name == contract.RUN_STEP:
            filled[tensor.name] = np.array(program == contract.BATCH_STEP)
        elif tensor.name not in filled:
            dtype = np.int64 if tensor.type == "tensor(int64)" else np.float32
            filled[tensor.name] = np.zeros([d if isinstance(d, int) else 1 for d in tensor.shape], dtype)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, filled)))
