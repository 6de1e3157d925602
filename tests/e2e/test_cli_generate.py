"""`speedc generate` end to end, and its bad-input contract: one line, exit != 0, no traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import assert_one_line_error, run_cli


def test_generate_json_and_stats(tiny_artifact):
    result = run_cli("generate", tiny_artifact, "--prompt", "ROMEO:", "--max-new-tokens", "24", "--json", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["ids"]) == 24 and isinstance(data["text"], str)
    for key in ("tokens_per_step", "acceptance_rate", "accepted", "mispredicted", "steps", "prefill_seconds",
                "decode_seconds", "new_tokens"):
        assert key in data["stats"]
    assert data["products"] == "ONNX Runtime"  # an fp32 artifact's products: no MatMulNBits, no kernel
    plain = json.loads(run_cli("generate", tiny_artifact, "--prompt", "ROMEO:", "--max-new-tokens", "24", "--json",
                               "--ignore-eos", "--mode", "autoregressive").stdout)
    assert plain["ids"] == data["ids"]
    ids = ",".join(map(str, data["ids"][:5]))
    by_ids = run_cli("generate", tiny_artifact, "--prompt-ids", ids, "--max-new-tokens", "8", "--stats", "--stream")
    assert by_ids.returncode == 0 and "acceptance_rate" in by_ids.stderr


@pytest.mark.parametrize("args, fragments", [
    (["--prompt", ""], ["empty prompt"]),
    (["--prompt-ids", "1,99999"], ["99999", "outside the vocabulary"]),
    (["--prompt-ids", "1,x"], ["comma-separated integers"]),
    (["--prompt", "hi", "--max-new-tokens", "600"], ["exceeds the model's context of 512"]),
    (["--prompt", "hi", "--prompt-ids", "1"], ["exactly one of --prompt, --prompt-ids or --prompts-file"]),
    (["--prompt", "hi", "--temperature", "-1"], ["temperature"]),
    (["--prompt", "hi", "--top-p", "0"], ["top-p"]),
    (["--prompt", "hi", "--device", "cuda"], ["device 'cuda'"]),
    (["--prompt", "hi", "--temperature", "0.8", "--seed", "-1"], ["seed must be >= 0"]),
    # silently read, or ignored, before
    (["--prompt-ids", "1,,2"], ["comma-separated integers"]),
    (["--prompt", "hi", "--max-batch", "3"], ["--max-batch goes with --prompts-file"]),
    (["--prompt", "hi", "--row-budget", "0"], ["--row-budget goes with --prompts-file"]),
    (["--prompt", "hi", "--stream", "--json"], ["choose one"]),
    (["--prompt", "caf\udce9"], ["not valid Unicode text", "the byte 0xe9"]),  # a Latin-1 byte in argv: a traceback before
    (["--prompt", "hi", "--stop", ""], ["stop string must be a non-empty string"]),
])
def test_bad_requests(tiny_artifact, args, fragments):
    assert_one_line_error(run_cli("generate", tiny_artifact, *args), *fragments)


def test_damaged_artifacts(tiny_artifact, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_artifact, corrupt)
    blob = bytearray((corrupt / "weights.bin").read_bytes())
    (corrupt / "weights.bin").write_bytes(bytes(blob[:-64]))  # truncated: every load checks the size
    assert_one_line_error(run_cli("generate", corrupt, "--prompt", "hi"), "weights.bin", "the manifest records")
    blob[100] ^= 0xFF  # same size, other bytes: weights.bin is hashed by inspect --verify, not at every load
    (corrupt / "weights.bin").write_bytes(bytes(blob))
    assert_one_line_error(run_cli("inspect", corrupt, "--verify"), "weights.bin", "sha256 does not match")
    graph = corrupt / "engine.onnx"  # a small file is hashed at every load
    graph.write_bytes(graph.read_bytes()[:-1] + b"\0")
    assert_one_line_error(run_cli("generate", corrupt, "--prompt", "hi"), "engine.onnx", "sha256 does not match")

    old = tmp_path / "old"
    shutil.copytree(tiny_artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 99
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run_cli("generate", old, "--prompt", "hi"), "format version 99", "rebuild")

    assert_one_line_error(run_cli("generate", tmp_path / "nothing", "--prompt", "hi"), "not an artifact directory")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(tiny_artifact, unfinished)
    (unfinished / "manifest.json").unlink()
    assert_one_line_error(run_cli("generate", unfinished, "--prompt", "hi"), "no manifest.json")


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "'nan' is not a finite number"),
    (["--prompts-file", "p.txt", "--kv-cache-mb", "inf"], "'inf' is not a finite number"),
    (["--threads", "0"], "0 is not in the range x>=1"),
])
def test_option_values_click_refuses(tiny_artifact, args, message):
    """nan and inf pass click's float (and every range check); before, they failed deep inside with a
    traceback (a nan pool size, a nan timeout on the server). Refused as usage errors now."""
    result = run_cli("generate", tiny_artifact, "--prompt", "hi", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
