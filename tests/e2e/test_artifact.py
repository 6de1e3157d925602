"""`speedc build` artifacts: layout, sizes, sharing recognised from HF layout, atomicity, bad input."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import (ZOO, assert_one_line_error, build_artifact, onnx_graphs, onnx_nodes, random_config, randomize,
                      run_cli)
from speedc.format.artifact import FORMAT_VERSION, read_manifest, read_weight
from speedc.errors import ArtifactError
from speedc.models.checkpoint.torch_io import load_model, save_unrolled_hf
from speedc.models.llama import SharedLlama
from speedc.serve.chat_template import load_chat_template


def test_artifact_layout_and_weight_bytes(tiny_artifact):
    m = read_manifest(tiny_artifact)
    assert {"manifest.json", "engine.onnx", "engine.gqa.onnx", "weights.bin", "tokenizer.json",
            "tokenizer_config.json", "config.json"} == {p.name for p in tiny_artifact.iterdir()}  # (its chat template)
    for graph in ("engine.onnx", "engine.gqa.onnx"):
        onnx.checker.check_model(str(tiny_artifact / graph), full_check=True)
    # One engine graph per variant (standard, fused GroupQueryAttention), each holding the prefill and the
    # batch step as If branches, nothing else: every decode, single-sequence or batched, runs them.
    assert set(m.graphs) == {"engine", "engine.gqa"}
    # Each unique weight stored once, shared by both graphs.
    assert m.weights["stored_bytes"] <= 1.02 * m.weights["unique_bytes_fp32"]
    assert (tiny_artifact / "weights.bin").stat().st_size <= 1.02 * m.weights["unique_bytes_fp32"]
    for graph in ("engine.onnx", "engine.gqa.onnx"):
        model = onnx.load(str(tiny_artifact / graph), load_external_data=False)
        assert all(init.data_location == onnx.TensorProto.EXTERNAL for part in onnx_graphs(model.graph)
                   for init in part.initializer if init.name in m.weights["index"])
    assert m.layer_map == [0, 1] * 4 and m.slots == 4 and m.stage_layers == 2
    # Stacked projections (fuse_projections): checkpoint tensors are byte ranges of the stacked weight.
    index = m.weights["index"]
    stacked = [name for name, entry in index.items() if "parts" in entry]
    assert len(stacked) == 4  # q+k+v and gate+up, for each of the 2 blocks
    for name in stacked:
        rows = [read_weight(tiny_artifact, m, part) for part in index[name]["parts"]]
        assert all(index[part]["within"] == name for part in index[name]["parts"])
        np.testing.assert_array_equal(np.concatenate(rows), read_weight(tiny_artifact, m, name))
    assert m.source_checkpoint_sha256 and m.onnx_opset == 17 and m.format_version == FORMAT_VERSION
    assert [p["name"] for p in m.build["passes"]] == ["trace", "share", "schedule", "batch_step_graph", "exit_heads",
                                                      "kv_cache", "gqa_attention", "fuse_projections", "cleanup",
                                                      "fuse_skip_norm", "quantize_weights", "untie_head", "trt_lint",
                                                      "merge_programs", "native_products", "native_attention"]


def test_hf_layout_builds_to_the_same_weights(tmp_path, tiny_artifact):
    hf = save_unrolled_hf(load_model(ZOO / "tiny"), tmp_path / "hf", tokenizer_json=(ZOO / "tiny" / "tokenizer.json").read_text())
    assert len(list(json.loads((hf / "config.json").read_text()))) and "speedc" not in json.loads((hf / "config.json").read_text())
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    art = build_artifact(hf, tmp_path / "hf-art")
    # The chat template travels into the artifact, for `speedc serve`.
    assert load_chat_template(art).render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == \
        "[user] hi<|endoftext|>"
    native, unrolled = read_manifest(tiny_artifact), read_manifest(art)
    assert unrolled.layer_map == native.layer_map and unrolled.slots == native.slots
    shared = set(native.weights["index"]) - {"model.exit_norm.weight"}  # HF layout has no exit norm
    assert set(unrolled.weights["index"]) == shared
    for name in shared:
        np.testing.assert_array_equal(read_weight(art, unrolled, name), read_weight(tiny_artifact, native, name))
    # What an unrolled export stores is what the Hugging Face checkpoint holds; the artifact stores 1/P of the blocks.
    from safetensors.torch import load_file

    hf_bytes = sum(t.numel() * 4 for t in load_file(str(hf / "model.safetensors")).values())
    assert unrolled.weights["unrolled_bytes_fp32"] == hf_bytes
    assert unrolled.weights["stored_bytes"] < 0.4 * hf_bytes


def test_fp16_storage_halves_the_weights(tmp_path, tiny_artifact):
    art = build_artifact(ZOO / "tiny", tmp_path / "fp16", dtype="fp16")
    m = read_manifest(art)
    assert m.dtype == "fp16"
    assert abs(m.weights["stored_bytes"] / read_manifest(tiny_artifact).weights["stored_bytes"] - 0.5) < 0.01
    # Row lookups (the embedding, the batch step's candidate checks) read the 16-bit table and cast only the
    # rows they gather: ONNX Runtime folds a Cast of a whole weight into a float32 copy in every session.
    from speedc.runtimes.engine import Engine

    lookups = 0
    for spec in m.graphs.values():
        graph = onnx.load(str(art / spec["file"]), load_external_data=False).graph
        stored = {t.name: t.data_type for part in onnx_graphs(graph) for t in part.initializer}
        nodes = onnx_nodes(graph)
        readers = {name: [n for n in nodes if name in n.input] for n in nodes for name in n.output}
        for node in (n for n in nodes if n.op_type == "Gather" and n.input[0].startswith("model.")):
            assert stored.get(node.input[0]) == onnx.TensorProto.FLOAT16, (spec["file"], node.input[0])
            assert [r.op_type for r in readers[node.output[0]]] == ["Cast"], spec["file"]
            lookups += 1
    assert lookups >= 5 and not any(name.startswith("tied_head.") for name in m.weights["index"])  # no head view needed
    engine = Engine.load(art)
    speed, plain = (engine.generate("ROMEO:", max_new_tokens=24, mode=mode, stop_at_eos=False).ids
                    for mode in ("speed", "autoregressive"))
    assert speed == plain


def test_cli_build_verbose_dump_and_inspect(tmp_path):
    out = tmp_path / "art"
    result = run_cli("build", ZOO / "tiny", "-o", out, "-v", "--dump-after", "batch_step_graph", "--slots", "2")
    assert result.returncode == 0, result.stderr
    for name in ("trace", "share", "schedule", "batch_step_graph", "exit_heads", "kv_cache", "cleanup", "trt_lint"):
        assert name in result.stderr
    assert (tmp_path / "art.dumps" / "after-batch_step_graph-batch_step.onnx").exists()
    manifest = read_manifest(out)
    assert manifest.slots == 2
    # The CLI measured c(P) on this machine and stored it; inspect predicts from it and says so.
    measured = manifest.build["step_cost_measured"]
    assert measured["slots"] == 2 and measured["step_cost"] > 0 and "step cost c(P=2)" in result.stdout
    info = json.loads(run_cli("inspect", out, "--json").stdout)
    assert info["schedule"]["slots"] == 2 and info["layer_map"] == [0, 1] * 4
    assert info["prediction"]["step_cost"] == measured["step_cost"] and info["prediction"]["measured"]
    assert "measured at build" in info["prediction"]["step_cost_source"]
    slots, alpha, cost = 2, info["prediction"]["alpha"], measured["step_cost"]
    assert info["prediction"]["speedup_bound"] == round(slots / (cost * (1 + (1 - alpha) * (slots - 1))), 3)
    text = run_cli("inspect", out).stdout
    assert "measured at build" in text and "sizes" in text and "{" not in text  # a table, not a JSON dump
    # A checkpoint has nothing measured: the figure is labelled an assumption.
    text = run_cli("inspect", ZOO / "tiny").stdout
    assert "slot 3" in text and "predicted speedup" in text and "an assumption" in text
    assert_one_line_error(run_cli("inspect", ZOO / "tiny", "--measure"), "build the checkpoint first")
    now = json.loads(run_cli("inspect", out, "--json", "--measure").stdout)
    assert now["prediction"]["measured"] and "now (inspect --measure)" in now["prediction"]["step_cost_source"]
    # Beside the step timer, what the runtime measured timing its own steps while decoding (the policy's costs).
    runtime = now["step_cost_measured_now"]["runtime"]
    assert runtime["sequences"] == 1 and runtime["plain_ms"] > 0 and runtime["speed_ms"] > 0
    shown = run_cli("inspect", out, "--measure").stdout
    assert "depths held: P = 2" in shown and "the runtime timing its own steps" in shown


def test_inspect_checks_the_files_and_verify_their_hashes(tmp_path, tiny_artifact):
    """A missing or damaged file is one line; every load (inspect too) checks each file's size and the small
    files' sha256, --verify every sha256 (weights.bin too: a full read, gigabytes at real size)."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    assert "every one present and its sha256" in run_cli("inspect", art, "--verify").stdout
    assert json.loads(run_cli("inspect", art, "--json").stdout)["files_verified"] is False
    graph = art / "engine.onnx"
    graph.write_bytes(graph.read_bytes()[:-1] + bytes([graph.read_bytes()[-1] ^ 1]))  # one bit of a small file
    assert_one_line_error(run_cli("inspect", art), "engine.onnx", "sha256 does not match")
    shutil.copy(tiny_artifact / "engine.onnx", graph)
    weights = art / "weights.bin"
    blob = bytearray(weights.read_bytes())
    blob[7] ^= 1  # one bit of weights.bin: not hashed at load, by --verify
    weights.write_bytes(bytes(blob))
    assert run_cli("inspect", art).returncode == 0
    assert_one_line_error(run_cli("inspect", art, "--verify"), "weights.bin", "sha256 does not match")
    shutil.copy(tiny_artifact / "weights.bin", weights)
    (art / "tokenizer.json").unlink()
    (art / "tokenizer.json").mkdir()  # an IsADirectoryError traceback from inspect --verify and generate before
    assert_one_line_error(run_cli("inspect", art), "tokenizer.json", "listed in the manifest but not a file")
    assert_one_line_error(run_cli("generate", art, "--prompt", "hi"), "tokenizer.json", "not a file")
    (art / "tokenizer.json").rmdir()
    shutil.copy(tiny_artifact / "tokenizer.json", art / "tokenizer.json")
    (art / "weights.bin").unlink()
    assert_one_line_error(run_cli("inspect", art), "weights.bin", "listed in the manifest but missing")
    assert_one_line_error(run_cli("inspect", ZOO / "tiny", "--verify"), "a checkpoint has none")


def test_existing_output_refused_without_force(tmp_path, tiny_artifact):
    out = tmp_path / "exists"
    out.mkdir()
    assert_one_line_error(run_cli("build", ZOO / "tiny", "-o", out), "exists", "--force")
    assert run_cli("build", ZOO / "tiny", "-o", out, "--force", "--no-measure").returncode == 0
    read_manifest(out)


@pytest.mark.parametrize("args, fragments", [
    (["--slots", "3"], ["--slots 3 does not divide the schedule", "[1, 2, 4]"]),
    (["--exit-layer", "9"], ["--exit-layer must be in 1..8"]),
    (["--target", "trt"], ["TensorRT engine building is not available"]),
    (["--dump-after", "nonsense"], ["no such pass"]),
])
def test_bad_build_options(tmp_path, args, fragments):
    out = tmp_path / "out"
    assert_one_line_error(run_cli("build", ZOO / "tiny", "-o", out, *args), *fragments)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_disk_full_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    limit = 200_000  # bytes per file: the weights file cannot be written

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    exe = Path(sys.executable).with_name("speedc")
    result = subprocess.run([str(exe), "build", str(ZOO / "tiny"), "-o", str(out)], capture_output=True, text=True,
                            preexec_fn=cap, timeout=300)
    assert_one_line_error(result, "cannot write the artifact")
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_killed_build_never_leaves_a_loadable_half(tmp_path):
    """Kill the build at several moments: OUT is either absent or a complete, verifiable artifact."""
    exe = Path(sys.executable).with_name("speedc")
    for delay in (1.0, 2.5, 3.5, 5.0):
        out = tmp_path / f"killed-{delay}"
        proc = subprocess.Popen([str(exe), "build", str(ZOO / "tiny"), "-o", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        if out.exists():
            read_manifest(out)  # verifies every file's hash
        else:
            with pytest.raises(ArtifactError):
                read_manifest(out)


def test_16_bit_checkpoints_keep_their_precision(tmp_path):
    """A bf16 checkpoint is stored as bf16 by default (half the fp32 bytes) and computes exactly what
    --weights fp32 computes: the fp32 copy of a bf16 value is exact."""
    import torch

    from speedc.build import build
    from speedc.models.checkpoint.torch_io import save_checkpoint
    from speedc.passes.base import BuildOptions
    from speedc.runtimes.engine import Engine

    model = randomize(SharedLlama(random_config(hidden=64, heads=4, kv_heads=2, blocks=2, layers=4)), seed=3)
    checkpoint = save_checkpoint(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    auto = build(checkpoint, tmp_path / "auto").out
    wide = build(checkpoint, tmp_path / "fp32", BuildOptions(dtype="fp32")).out
    assert read_manifest(auto).dtype == "bf16" and read_manifest(wide).dtype == "fp32"
    ratio = read_manifest(auto).weights["stored_bytes"] / read_manifest(wide).weights["stored_bytes"]
    assert 0.5 <= ratio < 0.56  # norms and other small tables stay fp32
    for backend in ("onnx", "onnx-numpy", "torch"):
        ids = Engine.load(auto, backend=backend).generate([5, 9, 2, 7], max_new_tokens=24, stop_at_eos=False).ids
        assert ids == Engine.load(wide, backend=backend).generate([5, 9, 2, 7], max_new_tokens=24, stop_at_eos=False).ids
    # --dtype stays an alias of --weights
    result = run_cli("build", checkpoint, "-o", tmp_path / "alias", "--dtype", "fp16", "--no-measure")
    assert result.returncode == 0, result.stderr
    assert read_manifest(tmp_path / "alias").dtype == "fp16"
