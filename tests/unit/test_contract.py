"""The compiler/runtime contract (speedc/format/contract.py): built graphs match it, and a runtime refuses an
artifact that does not, in one line naming the graph and the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from conftest import assert_one_line_error, run_cli
from speedc.format import contract
from speedc.format.artifact import FORMAT_VERSION, read_manifest, sha256_file
from speedc.errors import ArtifactError
from speedc.runtimes.engine import Engine


def _copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "art"))


def _edit_manifest(directory: Path, change) -> None:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_every_built_graph_matches_the_contract(tiny_artifact):
    manifest = read_manifest(tiny_artifact)
    dims = contract.Dims.from_manifest(manifest)
    assert set(manifest.graphs) == set(contract.GRAPHS)  # tiny: P=4, head_dim 32: every graph
    for name, spec in manifest.graphs.items():
        contract.check_graph_io(name, spec, dims)
        inputs, outputs = contract.expected_io(name, dims)
        assert {t["name"] for t in spec["inputs"]} == {n for n, _, _ in inputs}
        assert {t["name"] for t in spec["outputs"]} == {n for n, _, _ in outputs}


def _tensor(manifest: dict, graph: str, side: str, name: str) -> dict:
    return next(t for t in manifest["graphs"][graph][side] if t["name"] == name)


@pytest.mark.parametrize("graph, side, name", [
    ("engine", "outputs", "exit_tokens"),  # the batch step's
    ("engine.gqa", "inputs", "cache.value.0"),  # the prefill's
    ("engine", "inputs", "check_candidates"),
    ("engine.gqa", "inputs", "pool.key.1"),  # the fused batch step's
    ("engine", "inputs", "run_step"),  # the branch selector
])
def test_manifest_that_breaks_the_contract_is_refused(tiny_artifact, tmp_path, graph, side, name):
    art = _copy(tiny_artifact, tmp_path)
    fragment = f"graph {graph}: {side[:-1]} {name} is missing"
    _edit_manifest(art, lambda m: _tensor(m, graph, side, name).update(name="renamed"))
    with pytest.raises(ArtifactError, match=fragment) as refused:
        read_manifest(art)
    assert "rebuild" in str(refused.value) and "\n" not in str(refused.value)
    result = run_cli("generate", art, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert_one_line_error(result, fragment)


def test_wrong_shape_and_dtype_are_named(tiny_artifact, tmp_path):
    art = _copy(tiny_artifact, tmp_path)
    _edit_manifest(art, lambda m: _tensor(m, "engine", "inputs", "hidden_in").update(shape=["rows_behind", 1, 3]))
    with pytest.raises(ArtifactError, match=r"graph engine: input hidden_in has shape \['rows_behind', 1, 3\], "
                                            r"expected \['\*', 1, \d+\]"):
        read_manifest(art)
    art2 = Path(shutil.copytree(tiny_artifact, tmp_path / "art2"))
    _edit_manifest(art2, lambda m: _tensor(m, "engine.gqa", "outputs", "next_token").update(dtype="int32"))
    with pytest.raises(ArtifactError, match="graph engine.gqa: output next_token is int32, expected int64"):
        read_manifest(art2)


def test_graph_file_that_differs_from_its_manifest_is_refused(tiny_artifact, tmp_path):
    """A file edited behind the manifest (hash updated to pass the integrity check) still cannot be
    run: ONNX Runtime's view of its I/O is checked against the manifest at load."""
    art = _copy(tiny_artifact, tmp_path)
    path = art / "engine.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for value in model.graph.output:
        if value.name == "exit_tokens":
            value.name = "exit_guess"
    for node in model.graph.node:
        node.output[:] = ["exit_guess" if o == "exit_tokens" else o for o in node.output]
    onnx.save(model, str(path))
    _edit_manifest(art, lambda m: (m["files"].update({"engine.onnx": sha256_file(path)}),
                                   m["file_bytes"].update({"engine.onnx": path.stat().st_size})))
    with pytest.raises(ArtifactError, match="graph engine has no output exit_tokens"):
        Engine.load(art, backend="onnx-numpy")


def test_previous_format_versions(tiny_artifact, tmp_path):
    """An artifact from an older format (1: with the single-sequence step graphs; 2: a graph file per
    program; 3: the depth plan's repeat_norm) is refused with a message that says to rebuild; one of this format written before optional
    fields existed (no measured step cost) loads and runs."""
    for version in (0, 1, 2, 3):
        art = _copy(tiny_artifact, tmp_path / f"v{version}")
        _edit_manifest(art, lambda m: m.update(format_version=version))
        result = run_cli("generate", art, "--prompt-ids", "1,2", "--max-new-tokens", "2")
        assert_one_line_error(result, f"format version {version} but this speedc reads version {FORMAT_VERSION}", "rebuild")
        with pytest.raises(ArtifactError, match=f"format version {version} but this speedc reads version {FORMAT_VERSION}"):
            Engine.load(art)
    art2 = Path(shutil.copytree(tiny_artifact, tmp_path / "art2"))
    _edit_manifest(art2, lambda m: m["build"].pop("step_cost_measured", None))
    assert Engine.load(art2).generate([1, 2, 3], max_new_tokens=4).stats.new_tokens == 4
