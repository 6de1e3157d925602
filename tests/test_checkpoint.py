"""Checkpoint round trips and bad input: every problem is one line naming the file, exit != 0."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import ZOO, assert_one_line_error, random_config, randomize, run_cli
from speedc.errors import CheckpointError
from speedc.models.checkpoint import load_checkpoint, load_model, save_checkpoint, save_unrolled_hf
from speedc.models.llama import SharedLlama


@pytest.fixture()
def checkpoint(tmp_path):
    model = randomize(SharedLlama(random_config(blocks=2, layers=4)), seed=5)
    return save_checkpoint(model, tmp_path / "ckpt"), model


def test_round_trip_stores_each_block_once(checkpoint):
    path, model = checkpoint
    cfg, tensors = load_checkpoint(path)
    assert cfg.layer_map == [0, 1, 0, 1]
    assert not any(".blocks.2." in name for name in tensors)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(load_model(path)(ids).logits, model(ids).logits, rtol=0, atol=0)


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key == "speedc_layer_map":
            config["speedc"]["layer_map"] = value
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, fragments", [
    (lambda p: (p / "model.safetensors").unlink(), ["no model.safetensors"]),
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:5000]),
     ["model.safetensors", "unreadable safetensors"]),
    (lambda p: _edit_config(p, hidden_size=48), ["model.safetensors", "shape", "config.json implies"]),
    (lambda p: _edit_config(p, speedc_layer_map={"pattern": "zigzag", "num_blocks": 2}), ["unknown layer-map pattern"]),
    (lambda p: _edit_config(p, speedc_layer_map=[0, 1, 0]), ["3 entries but the model has 4 layers"]),
    (lambda p: _edit_config(p, model_type="gpt2"), ["unsupported architecture", "gpt2"]),
    (lambda p: (p / "config.json").write_text("{not json"), ["config.json", "not valid JSON"]),
], ids=["missing-weights", "truncated", "shape-mismatch", "unknown-pattern", "short-map", "architecture", "bad-json"])
def test_bad_checkpoints_fail_in_one_line(checkpoint, tmp_path, damage, fragments):
    path, _ = checkpoint
    damage(path)
    result = run_cli("build", path, "-o", tmp_path / "out")
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "out").exists()


def test_missing_directory(tmp_path):
    assert_one_line_error(run_cli("build", tmp_path / "nope", "-o", tmp_path / "out"), "not a checkpoint directory")


def test_pickle_refused_unless_allowed(checkpoint, tmp_path):
    path, model = checkpoint
    pickled = tmp_path / "pickled"
    shutil.copytree(path, pickled)
    state = load_checkpoint(path)[1]
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    assert_one_line_error(run_cli("build", pickled, "-o", tmp_path / "out"), "pytorch_model.bin", "--allow-pickle")
    with pytest.raises(CheckpointError):
        load_checkpoint(pickled)
    cfg, tensors = load_checkpoint(pickled, allow_pickle=True)  # weights_only=True loading
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    result = run_cli("build", pickled, "-o", tmp_path / "out", "--allow-pickle", "--no-measure")
    assert result.returncode == 0, result.stderr


def test_hf_layout_with_mismatched_tied_head(tmp_path):
    model = randomize(SharedLlama(random_config(blocks=2, layers=4)), seed=2)
    hf = save_unrolled_hf(model, tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        load_checkpoint(hf)


def test_zoo_cards_hold_measured_numbers():
    for name in ("tiny", "small"):
        card_dir = ZOO / name
        if not (card_dir / "model.safetensors").exists():
            continue
        card = (card_dir / "MODEL_CARD.md").read_text()
        history = json.loads((card_dir / "training.json").read_text())["history"][-1]
        assert str(history["val_loss_final"]) in card and str(history["agree_top1"]) in card
        assert "speedc train" in card and json.loads((card_dir / "training.json").read_text())["corpus_sha256"] in card
