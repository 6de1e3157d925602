"""Family `parcae` (models/families/parcae.py): Parcae's looped core with its diagonal injection, through the depth plan.

Tiny checkpoints in the published layout (tests/parcae_checkpoints.py: the config dataclass's fields,
pytorch_model.bin with transformer.* names, value_embeds.{i}, the tied lm_head stored twice, the rotary
buffer) against an oracle written from the published code (adjacent-pair rotary then a weightless q/k
norm, ReLU^2 MLP, value embeddings where table and gate both exist, ln_prelude, the diagonal-decay
injection, the readout projection C), which recomputes the whole sequence per token:

    settled  prelude 2, core 2 x 8, coda 2 (Parcae-140M's phases), decay 0.05 and small layer weights:
             the state nearly settles after one repeat, drafts mostly hold (and some fail)
    random   the same phases, the published decay sqrt(1/5) and larger weights: drafts mostly fail

The settled model is built at every valid P (2, 4, 8: K = 4, 2, 1 repeats per slot): batched SPEED ids ==
batched plain ids == the oracle's, single-sequence too; seeded sampling SPEED == plain; both accepted
and flushed speculations occur (per_sequence=False: counts independent of this host's timings). The
random model runs at P = 8 (flushes), the settled one also from a random start state and at another
recurrence; each refused option is one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from looped_checkpoints import assert_batch_lossless, batch_plain_and_speed
from parcae_checkpoints import HIDDEN, config, load_tensors, oracle_greedy, oracle_logits, write_checkpoint
from speedc import Engine
from speedc.build import build
from speedc.errors import CheckpointError, SpeedcError
from speedc.format.artifact import read_manifest
from speedc.models.checkpoint.torch_io import load_model, open_checkpoint
from speedc.models.families import load_config, read_config
from speedc.format.depth_plan import DepthPlan
from speedc.passes.base import BuildOptions

NEW_TOKENS = 12
PROMPTS = ([5, 7, 9, 11, 3, 40], [8, 1, 4], [60, 61, 62, 63, 64])
SETTLED = dict(seed=6, layer_scale=0.03, decay=0.05)
RANDOM = dict(seed=5)
STATE_STD = (2 / (5 * HIDDEN)) ** 0.5  # like-init: the embedding's init std


@pytest.fixture(scope="module")
def settled(tmp_path_factory):
    root = tmp_path_factory.mktemp("parcae-settled")
    directory = write_checkpoint(root / "ckpt", **SETTLED)
    tensors, cfg = load_tensors(directory), json.loads((directory / "config.json").read_text())
    expected = [oracle_greedy(tensors, cfg, p, NEW_TOKENS) for p in PROMPTS]
    return root, directory, expected


def test_config_emits_the_parcae_depth_plan(tmp_path):
    directory = write_checkpoint(tmp_path / "ckpt", weights_file="model.safetensors", **RANDOM)  # inspect reads no pickle
    cfg = load_config(directory / "config.json")
    assert cfg.architecture == "parcae" and cfg.qk_norm and cfg.mlp_act == "relu2" and not cfg.post_norms
    assert cfg.value_embed_blocks == (1, 3, 5)  # prelude, core and coda blocks: alternating, the last included
    assert cfg.depth_plan == DepthPlan((0, 1), (2, 3), 8, (4, 5), loop_norm=False, final_norm=True,
                                       injection="diagonal-decay", prelude_norm=True, readout_projection=True,
                                       state_std=STATE_STD)
    assert cfg.layer_map == [0, 1, *[2, 3] * 8, 4, 5] and cfg.exit_layer == 4  # the draft: after one repeat
    assert cfg.carries_token_id and cfg.state_width == 2 * HIDDEN + 1  # [state | e | token id]
    assert cfg.depth_plan.valid_slots(cfg.exit_layer, pipelined_phases=True) == [1, 2, 4, 8]
    assert read_config(cfg.to_json_dict()) == cfg  # what an artifact's config.json reads back as
    shown = run_cli("inspect", directory, env={"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    assert "injection diagonal-decay (state from zero)" in shown.stdout and "projection at each readout" in shown.stdout
    assert "state_init='like-init'" in shown.stdout and "unless built with --state-init random" in shown.stdout


@pytest.mark.parametrize("weights", [RANDOM, SETTLED])
def test_reference_matches_oracle_final_and_draft(tmp_path, weights):
    directory = write_checkpoint(tmp_path / "ckpt", **weights)
    tensors, cfg = load_tensors(directory), json.loads((directory / "config.json").read_text())
    ids = [3, 17, 4, 90, 21, 8, 8, 50, 1]
    with torch.no_grad():
        out = load_model(directory, allow_pickle=True)(torch.tensor([ids]), with_exit=True)
    theirs, draft = oracle_logits(tensors, cfg, ids), oracle_logits(tensors, cfg, ids, recurrence=1)
    torch.testing.assert_close(out.logits[0].double(), theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)
    torch.testing.assert_close(out.exit_logits[0].double(), draft, atol=1e-4 * float(draft.abs().max()), rtol=0)
    assert (theirs.max(-1).values - theirs.min(-1).values).min() > 1.0  # not near-constant logits


def test_unpartnered_value_embeddings_are_dropped(tmp_path):
    """prelude 1, core 3, coda 1, backprop depth 1: tables on blocks 0 2 4 (of 5), gates on even layer ids
    (of 3): the coda's layer id 25 has none, so its table is never applied; the oracle applies what the
    published module applies."""
    directory = write_checkpoint(tmp_path / "ckpt", seed=9, prelude=1, core=3, coda=1, backprop_depth=1,
                                 weights_file="model.safetensors")
    cfg, _ = open_checkpoint(directory)
    assert cfg.value_embed_blocks == (0, 2)
    tensors, data = load_tensors(directory), json.loads((directory / "config.json").read_text())
    assert "value_embeds.4.weight" in tensors
    ids = [7, 3, 99, 12, 5]
    with torch.no_grad():
        ours = load_model(directory)(torch.tensor([ids])).logits[0].double()
    theirs = oracle_logits(tensors, data, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)
    shown = run_cli("inspect", directory, env={"COLUMNS": "400"})
    assert "tables [4] and gates [] have no partner" in shown.stdout, shown.stdout


def test_safetensors_upload_reads_as_the_bin(tmp_path):
    """The published loader also takes model.safetensors: the same model either way."""
    binary = write_checkpoint(tmp_path / "bin", **SETTLED)
    safe = write_checkpoint(tmp_path / "safe", weights_file="model.safetensors", **SETTLED)
    ids = torch.tensor([[4, 9, 33, 2]])
    with torch.no_grad():
        torch.testing.assert_close(load_model(safe)(ids).logits, load_model(binary, allow_pickle=True)(ids).logits)


@pytest.mark.parametrize("slots", [2, 4, 8])
def test_speed_equals_plain_equals_oracle(settled, slots):
    root, directory, expected = settled
    art = build(directory, root / f"art{slots}", BuildOptions(slots=slots), allow_pickle=True).out
    manifest = read_manifest(art)
    assert manifest.slots == slots and manifest.model["state_width"] == 2 * HIDDEN + 1
    assert manifest.schedule["readouts"]["draft"]["coda"] and manifest.schedule["readouts"]["final"]["slot"] == slots - 1
    engine = Engine.load(art, lazy=True)
    prompts = [list(p) for p in PROMPTS]
    accepted, mispredicted = assert_batch_lossless(engine, prompts, expected, NEW_TOKENS)
    assert accepted > 0 and mispredicted > 0, (accepted, mispredicted)  # both paths covered


def test_random_weights_flush_and_stay_lossless(tmp_path):
    """The published decay with larger weights at P = 8 (one repeat per slot): drafts fail, ids still the oracle's."""
    directory = write_checkpoint(tmp_path / "ckpt", **RANDOM)
    tensors, cfg = load_tensors(directory), json.loads((directory / "config.json").read_text())
    prompts = [list(p) for p in PROMPTS]
    expected = [oracle_greedy(tensors, cfg, p, NEW_TOKENS) for p in prompts]
    engine = Engine.load(build(directory, tmp_path / "art", BuildOptions(slots=8), allow_pickle=True).out, lazy=True)
    plain, speed = batch_plain_and_speed(engine, prompts, NEW_TOKENS)
    assert [r.ids for r in plain] == [r.ids for r in speed] == expected
    assert sum(r.stats.mispredicted for r in speed) > 0


def test_random_start_state_is_the_same_in_plain_decoding_and_speed(settled, tmp_path):
    """--state-init random --seed S: each position's start state drawn from (S, position) at the published
    like-init scale; plain decoding, SPEED (P = 4) and the oracle's own draw agree."""
    _, directory, _ = settled
    tensors, cfg = load_tensors(directory), json.loads((directory / "config.json").read_text())
    prompts = [list(p) for p in PROMPTS[:2]]
    expected = [oracle_greedy(tensors, cfg, p, 8, seed=3) for p in prompts]
    art = build(directory, tmp_path / "art", BuildOptions(slots=4, state_init="random", state_seed=3), allow_pickle=True).out
    assert read_manifest(art).model["initial_state"] == {"seed": 3, "std": pytest.approx(STATE_STD)}
    engine = Engine.load(art, lazy=True)
    plain, speed = batch_plain_and_speed(engine, prompts, 8, max_batch=2)
    assert [r.ids for r in plain] == [r.ids for r in speed] == expected


@pytest.mark.parametrize("change, message", [
    ({"injection_type": "linear"}, "injection_type='linear' is not supported"),
    ({"nonlin_name": "GELU"}, "nonlin_name='GELU' is not supported"),
    ({"mlp_class_name": "GatedMLP"}, "mlp_class_name='GatedMLP' is not supported"),
    ({"qk_bias": True}, "qk_bias=True is not supported"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"logit_softcap": 15.0}, "logit_softcap=15.0 is not supported"),
    ({"init_strategy": "takase-scaled"}, "init_strategy='takase-scaled' is not supported"),
    ({"mup_model_scaling_factor": 2}, "mup_model_scaling_factor=2 is not supported"),
    ({"attn_impl": "debug-skip"}, "attn_impl='debug-skip' is not supported"),
    ({"recurrent_embedding_dimension": 32}, "recurrent_embedding_dimension=32"),
    ({"recurrent_num_attention_heads": 2}, "recurrent_num_attention_heads=2 is not supported"),
    ({"num_key_value_heads": 2}, "2 key/value heads for 4 heads is not supported"),
    ({"use_fused_head": "full-triton", "tie_embeddings": False}, "use_fused_head='full-triton' with untied"),
    ({"rope_settings": {"use_rope": True, "rope_condense_ratio": 2, "rope_base": 50000}}, "rope_settings="),
    ({"n_embd": 62}, "must be a multiple of num_attention_heads"),
])
def test_bad_config_is_one_line(change, message):
    with pytest.raises(CheckpointError) as error:
        read_config({**config(2, 2, 2, 8), **change})
    assert "\n" not in str(error.value) and message in str(error.value)


def test_wrong_tensor_is_one_line(tmp_path):
    directory = write_checkpoint(tmp_path / "ckpt", **RANDOM)
    tensors = torch.load(directory / "pytorch_model.bin", weights_only=True)
    tensors["transformer.adapter.B"] = tensors["transformer.adapter.B"][:, :HIDDEN // 2].contiguous()
    del tensors["transformer.core_block.1.attn.ve_gate.weight"]
    torch.save(tensors, directory / "pytorch_model.bin")
    built = run_cli("build", directory, "-o", tmp_path / "art", "--allow-pickle", "--no-measure")
    assert built.returncode != 0 and "Traceback" not in built.stderr and len(built.stderr.strip().splitlines()) == 1
    assert "missing tensor model.blocks.3.self_attn.value_gate.weight" in built.stderr
    del tensors["transformer.core_block.1.attn.c_q.weight"]  # (the gate back: now the q projection is missing)
    tensors["transformer.core_block.1.attn.ve_gate.weight"] = torch.zeros(4, 32)
    torch.save(tensors, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="missing tensor model.blocks.3.self_attn.q_proj.weight"):
        open_checkpoint(directory, allow_pickle=True)
    tensors["transformer.core_block.1.attn.c_q.weight"] = torch.zeros(HIDDEN, HIDDEN)
    torch.save(tensors, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"model.injection.B has shape \[64, 32\] but config.json implies \[64, 64\]"):
        open_checkpoint(directory, allow_pickle=True)


def test_torch_backend_refuses_the_injection(tmp_path):
    from speedc.runtimes.backends.torch_backend import TorchBackend

    directory = write_checkpoint(tmp_path / "ckpt", **RANDOM)
    with pytest.raises(SpeedcError, match="injects its entry state"):
        TorchBackend.from_model(load_model(directory, allow_pickle=True), slots=1)


def test_bench_shape_writes_the_published_layout(tmp_path):
    """`speedc bench --shape parcae-770m`'s random checkpoint (speedc/bench/random_checkpoint.py) at a tiny
    size reads as Parcae and computes what the oracle computes from its tensors; the real shape has 770 M
    parameters (half of them value embeddings) and pipelines at P = 2, 4, 8."""
    from parcae_checkpoints import HEADS, INTERMEDIATE, VOCAB
    from speedc.bench.random_checkpoint import write_random_checkpoint
    from speedc.bench.synthetic import SHAPES, Shape, pipeline_depths

    tiny = Shape("parcae-tiny", HIDDEN, HEADS, HEADS, HIDDEN // HEADS, INTERMEDIATE, VOCAB, 2, 8, looped=False, tied=True,
                 prelude=2, coda=2, recurrent=True, family="parcae", value_embeds=3)
    directory = write_random_checkpoint(tiny, 2, tmp_path / "ckpt", residual_scale=0.5)
    cfg, _ = open_checkpoint(directory)
    assert cfg.architecture == "parcae" and cfg.value_embed_blocks == (1, 3, 5) and cfg.depth_plan.repeats == 8
    tensors, data = load_tensors(directory), json.loads((directory / "config.json").read_text())
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"]  # tied, not stored
    ids = [7, 3, 99, 12, 5]
    with torch.no_grad():
        ours = load_model(directory)(torch.tensor([ids])).logits[0].double()
    theirs = oracle_logits(tensors, data, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-3 * float(theirs.abs().max()), rtol=0)  # bf16 weights, fp32 math
    real = SHAPES["parcae-770m"]
    params = (real.prelude + real.layers + real.coda) * real.block_params() + real.fixed_params() + 2 * real.hidden ** 2
    assert 7.5e8 < params < 7.9e8 and pipeline_depths(real, real.layers) == [2, 4, 8]


def test_recurrence_chosen_at_build(settled, tmp_path):
    """--recurrence 4 (of the published 8): the oracle run with R = 4, at P = 2."""
    _, directory, _ = settled
    tensors, cfg = load_tensors(directory), json.loads((directory / "config.json").read_text())
    expected = oracle_greedy(tensors, {**cfg, "mean_recurrence": 4}, list(PROMPTS[1]), 8)
    art = build(directory, tmp_path / "art", BuildOptions(slots=2, recurrence=4), allow_pickle=True).out
    assert read_manifest(art).schedule["depth_plan"]["repeats"] == 4
    engine = Engine.load(art, lazy=True)
    assert engine.generate(list(PROMPTS[1]), max_new_tokens=8, stop_at_eos=False).ids == expected
    assert engine.generate(list(PROMPTS[1]), max_new_tokens=8, stop_at_eos=False, mode="autoregressive").ids == expected
