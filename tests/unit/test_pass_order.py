"""A reordered or removed pass is a one-line BuildError naming what is missing, or builds the very
same artifact: never a raw exception from inside a pass."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import onnx
import pytest

from conftest import random_config, randomize
from speedc.build import PASS_ORDER, PIPELINE, build
from speedc.errors import BuildError
from speedc.models.checkpoint.torch_io import save_checkpoint
from speedc.models.llama import SharedLlama
from speedc.passes.base import FACTS, PASSES, register_pass

LOWERING = next(names for phase, names in PIPELINE if phase == "lowering")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # head_dim 16 so gqa_attention runs (ONNX Runtime's kernel needs a multiple of 16)
    model = randomize(SharedLlama(random_config(hidden=64, heads=4, kv_heads=2, blocks=2, layers=4)), seed=5)
    return save_checkpoint(model, tmp_path_factory.mktemp("order") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory) -> Path:
    return build(checkpoint, tmp_path_factory.mktemp("ref") / "art").out


def fingerprint(artifact: Path) -> dict:
    """What must not change: the weights' bytes, each graph's I/O and its ops."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    ops = {}
    for name, spec in manifest["graphs"].items():
        model = onnx.load(str(artifact / spec["file"]), load_external_data=False)
        ops[name] = sorted(collections.Counter(n.op_type for n in model.graph.node).items())
    return {"weights": (artifact / "weights.bin").read_bytes(), "graphs": manifest["graphs"], "ops": ops,
            "index": manifest["weights"]["index"]}


def swapped(order: list[str], first: str) -> list[str]:
    i = order.index(first)
    return order[:i] + [order[i + 1], order[i]] + order[i + 2:]


@pytest.mark.parametrize("first", LOWERING[:-1])
def test_adjacent_swaps_in_lowering_error_cleanly_or_build_the_same(first, checkpoint, reference, tmp_path):
    order = swapped(PASS_ORDER, first)
    try:
        result = build(checkpoint, tmp_path / "art", passes=order)
    except BuildError as refused:
        message = str(refused)
        assert "\n" not in message and "needs" in message, message
        assert not (tmp_path / "art").exists()  # nothing half-written
        return
    assert fingerprint(result.out) == fingerprint(reference), f"{order} built a different artifact"


def test_which_swaps_are_refused(checkpoint, tmp_path):
    """The two orders that once failed deep inside a pass are now named up front."""
    with pytest.raises(BuildError, match=r"pass exit_heads needs per-layer present.*kv_cache ran before it"):
        build(checkpoint, tmp_path / "a", passes=swapped(PASS_ORDER, "exit_heads"))
    with pytest.raises(BuildError, match=r"pass gqa_attention needs one Gemm per q/k/v.*fuse_projections ran before"):
        build(checkpoint, tmp_path / "b", passes=swapped(PASS_ORDER, "gqa_attention"))


@pytest.mark.parametrize("removed, fragment", [
    ("exit_heads", "pass gqa_attention needs the final and early-exit heads"),
    ("kv_cache", "pass gqa_attention needs cache inputs"),
    ("batch_step_graph", "pass exit_heads needs the prefill graph and"),
    ("cleanup", "pass fuse_skip_norm needs folded"),
    ("trace", "pass share needs the traced N-layer decode program"),
])
def test_removed_pass_is_named(removed, fragment, checkpoint, tmp_path):
    with pytest.raises(BuildError, match=fragment) as refused:
        build(checkpoint, tmp_path / "art", passes=[p for p in PASS_ORDER if p != removed])
    assert removed in str(refused.value) or "missing" in str(refused.value)
    assert not (tmp_path / "art").exists()


def test_optional_passes_can_be_left_out(checkpoint, tmp_path):
    """gqa_attention and fuse_projections are optimisations: without them the artifact still builds."""
    result = build(checkpoint, tmp_path / "art", passes=[p for p in PASS_ORDER if p not in ("gqa_attention", "fuse_projections")])
    assert set(result.manifest.graphs) == {"engine"}  # the standard programs' engine graph alone


def test_unknown_pass_and_fact_are_refused(checkpoint, tmp_path):
    with pytest.raises(BuildError, match="no such pass 'nope'"):
        build(checkpoint, tmp_path / "art", passes=["trace", "nope"])
    with pytest.raises(ValueError, match="unknown facts"):
        register_pass("bad", phase="lowering", requires=("no_such_fact",))
    assert "bad" not in PASSES and all(set(p.requires + p.provides + p.consumes) <= set(FACTS) for p in PASSES.values())


def test_a_graph_that_fails_while_measuring_is_one_error_and_no_artifact(checkpoint, tmp_path, monkeypatch):
    """ONNX Runtime raising its own exception types during the build's c(P) measurement (a scripted stand-in
    here) is a BuildError naming it, and OUT never appears (CLI: one line, exit 1)."""
    import speedc.step_timer

    def failing(directory, **_):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : invalid dimensions for output hidden_out\nmore detail")

    monkeypatch.setattr(speedc.step_timer, "measure_artifact", failing)
    with pytest.raises(BuildError, match=r"failed to run while measuring c\(P\) \(\[ONNXRuntimeError\] : 1 : FAIL : invalid"):
        build(checkpoint, tmp_path / "art", measure_step_cost=True)
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.partial-*"))
