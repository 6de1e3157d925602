"""Checkpoint round trips and bad input: every problem is one line naming the file, exit != 0."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import ZOO, assert_one_line_error, random_config, randomize, run_cli
from speedc.errors import CheckpointError
from speedc.models.checkpoint.torch_io import load_checkpoint, load_model, save_checkpoint, save_unrolled_hf
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


def _edit_section(path, *keys, value):
    config = json.loads((path / "config.json").read_text())
    target = config
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    (path / "config.json").write_text(json.dumps(config))


def _retype_tensor(path, name: str, dtype):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(path / "model.safetensors"))


def _duplicate_in_second_file(path):
    from safetensors.torch import load_file, save_file

    name = "model.blocks.0.mlp.down_proj.weight"
    save_file({name: torch.zeros_like(load_file(str(path / "model.safetensors"))[name])}, str(path / "zz.safetensors"))


@pytest.mark.parametrize("damage, message", [
    (lambda p: _edit_config(p, num_hidden_layers=4.7), "num_hidden_layers must be a positive integer, got 4.7"),
    (lambda p: _edit_config(p, tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (lambda p: _edit_config(p, speedc=[1]), "speedc must be an object"),
    (lambda p: _edit_section(p, "speedc", "exit", value=5), "speedc.exit must be an object"),
    (lambda p: _edit_config(p, head_dim=-8), "head_dim must be a positive even integer"),
    (lambda p: _edit_config(p, rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
    (lambda p: _edit_config(p, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "unsupported rope type 'llama3'"),
    (lambda p: _edit_config(p, max_position_embeddings=10 ** 9), "max_position_embeddings 1,000,000,000 is beyond"),
    (lambda p: (p / "generation_config.json").write_text('{"eos_token_id": 5000}'), "eos_token_id 5000"),
    (lambda p: _edit_section(p, "speedc", "format_version", value=99), "speedc.format_version 99"),
    (lambda p: _retype_tensor(p, "model.blocks.0.mlp.down_proj.weight", torch.int32), "is int32; weights must be floating"),
    (_duplicate_in_second_file, "is in both model.safetensors and zz.safetensors"),
    (lambda p: (p / "training.json").write_text('{"history": [{"agree_top1": 5}]}'), "agree_top1 5.0 is not an agreement"),
], ids=["float-layers", "string-bool", "section-list", "exit-number", "negative-head-dim", "nan-eps", "rope-scaling-beside",
        "huge-context", "eos-outside", "format-version", "int-weight", "duplicate-tensor", "training-hint"])
def test_config_and_weight_values_are_refused_in_one_line(checkpoint, damage, message):
    """Before: a traceback (AttributeError, ZeroDivisionError), a silent coercion (4.7 layers -> 4, "false" ->
    true), or an artifact that built and then generated nothing useful. Now each is a CheckpointError."""
    from speedc.models.checkpoint.files import acceptance_hint_from_training

    path, _ = checkpoint
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)
        acceptance_hint_from_training(path)


@pytest.mark.parametrize("option, value", [
    ("qk_norm", True), ("use_qk_norm", True), ("qk_layernorm", True), ("attn_logit_softcapping", 50.0),
    ("final_logit_softcapping", 30.0), ("query_pre_attn_scalar", 256), ("use_sliding_window", True),
    ("layer_types", ["sliding_attention", "full_attention"] * 2), ("partial_rotary_factor", 0.5),
])
def test_options_the_model_does_not_compute_are_refused_by_name(checkpoint, option, value):
    """Before: loaded and built, the option silently ignored (an attention, or logits, other than the
    checkpoint's). Now one line naming it."""
    path, _ = checkpoint
    _edit_config(path, **{option: value})
    with pytest.raises(CheckpointError, match=rf"^config.json: LlamaForCausalLM option {option}=.* is not supported"):
        load_checkpoint(path)


def test_rotary_over_part_of_each_head_is_refused_in_rope_parameters(checkpoint):
    path, _ = checkpoint
    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    with pytest.raises(CheckpointError, match=r"unsupported partial_rotary_factor 0.25 \(rope_parameters\)"):
        load_checkpoint(path)


def test_those_options_switched_off_still_load(checkpoint):
    path, model = checkpoint
    _edit_config(path, qk_norm=False, attn_logit_softcapping=None, use_sliding_window=False, sliding_window=4096,
                 layer_types=["full_attention"] * 4, partial_rotary_factor=1.0)
    assert load_checkpoint(path)[0].layer_map == model.cfg.layer_map


def test_tokenizers_that_cannot_serve_the_model_are_refused(tmp_path):
    from speedc.models.checkpoint.torch_io import read_tokenizer_json

    shutil.copy(ZOO / "small" / "tokenizer.json", tmp_path / "tokenizer.json")  # 4,096 tokens
    assert read_tokenizer_json(tmp_path, 4096)
    with pytest.raises(CheckpointError, match="4096 tokens, but the model's vocabulary has 1024 rows"):
        read_tokenizer_json(tmp_path, 1024)
    (tmp_path / "tokenizer.json").write_text("{bad")
    with pytest.raises(CheckpointError, match="not a tokenizer the tokenizers package can load"):
        read_tokenizer_json(tmp_path, 4096)


def test_an_artifact_given_as_the_checkpoint_is_named_as_one(tiny_artifact, tmp_path):
    assert_one_line_error(run_cli("build", tiny_artifact, "-o", tmp_path / "out"), "a speedc artifact", "not a checkpoint")


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


def test_every_end_of_text_id_in_generation_config_stops_generation(tiny_artifact, tmp_path):
    """Before: of generation_config.json's eos_token_id [a, b] (Llama-3-style chat models list several)
    only a was kept, and generation ran on past b. Now the artifact records all and stops at any."""
    from speedc import Engine
    from speedc.build import build
    from speedc.passes.base import BuildOptions

    plain = Engine.load(tiny_artifact).generate("ROMEO:", max_new_tokens=12, stop_at_eos=False).ids
    stop_at = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])  # first time this id appears
    checkpoint = shutil.copytree(ZOO / "tiny", tmp_path / "ckpt")
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [1000, plain[stop_at]]}))
    build(checkpoint, tmp_path / "art", BuildOptions())
    engine = Engine.load(tmp_path / "art")
    assert engine.manifest.model["eos_token_ids"] == [1000, plain[stop_at]]
    for mode in ("speed", "autoregressive"):
        result = engine.generate("ROMEO:", max_new_tokens=12, mode=mode)
        assert result.ids == plain[:stop_at + 1] and result.stats.stop_reason == "eos"


def _set_value(path, name: str, value: float):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name][1, 2] = value
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("value, weights, fragments", [
    (float("nan"), "fp32", ["mlp.up_proj", "1 nan/inf values in the checkpoint"]),
    (float("inf"), "int8", ["mlp.up_proj", "1 nan/inf values in the checkpoint"]),
    (1e5, "fp16", ["mlp.up_proj", "beyond float16's range", "1e+05", "--weights bf16 or fp32"]),
], ids=["nan-fp32", "inf-int8", "fp16-overflow"])
def test_weights_that_are_not_finite_are_refused(checkpoint, tmp_path, value, weights, fragments):
    """Before: a nan in a checkpoint, or a value beyond float16's range (inf once stored), built an artifact
    that generated one id over and over (numpy only warned "overflow encountered in cast")."""
    path, _ = checkpoint
    _set_value(path, "model.blocks.1.mlp.up_proj.weight", value)
    result = run_cli("build", path, "-o", tmp_path / "out", "--weights", weights, "--no-measure")
    assert_one_line_error(result, *fragments)
    assert "overflow" not in result.stderr and not (tmp_path / "out").exists()
    if value == 1e5:  # bfloat16 keeps float32's range
        assert run_cli("build", path, "-o", tmp_path / "bf16", "--weights", "bf16", "--no-measure").returncode == 0
