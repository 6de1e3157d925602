"""Family `huginn` (models/families/huginn.py): Huginn-0125's recurrent depth through the depth plan.

Tiny checkpoints in the published layout (tests/huginn_checkpoints.py: transformer.* names, fused Wqkv
and fc, qk_bias, the adapter, the tied lm_head stored twice, the rotary buffer) against an oracle
written from the published description (adjacent-pair rotary, post-norm sandwich blocks, the adapter
injection, ln_f twice), which recomputes the whole sequence per token:

    random   prelude 2, core 2 x 4, coda 2 (the published phases' lengths but the core's); random weights:
             drafts mostly wrong (flushes); the draft readout's second coda layer attends over its
             own depth's past, in the prefill program too
    settled  prelude 1, core 2 x 4, coda 1, the adapter near [I | 0] and small layer weights: the state
             settles, drafts hold

Each is built at P = 4 (one repeat per slot) and P = 2 (two repeats per slot): batched SPEED ids ==
batched plain ids == the oracle's, single-sequence too; seeded sampling SPEED == plain; the final
readout's coda K/V hold final-depth states only.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import run_cli
from huginn_checkpoints import (HEAD_DIM, HEADS, HIDDEN, load_tensors, oracle_greedy, oracle_logits,
                                write_checkpoint)
from looped_checkpoints import assert_batch_lossless
from speedc import Engine
from speedc.build import build
from speedc.errors import CheckpointError, GenerationError, SpeedcError
from speedc.format.artifact import read_manifest
from speedc.models.checkpoint.tensor_source import safetensors_sources
from speedc.models.checkpoint.torch_io import load_model
from speedc.models.families import load_config
from speedc.format.depth_plan import DepthPlan
from speedc.passes.base import BuildOptions

NEW_TOKENS = 12
PROMPTS = ([5, 7, 9, 11, 3, 40], [8, 1, 4], [60, 61, 62, 63, 64])
CASES = {"random": dict(seed=5, prelude=2, coda=2), "settled": dict(seed=6, layer_scale=0.03, adapter_identity=1.0)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"huginn-{request.param}")
    directory = write_checkpoint(root / "ckpt", **CASES[request.param])
    tensors, config = load_tensors(directory), json.loads((directory / "config.json").read_text())
    expected = [oracle_greedy(tensors, config, p, NEW_TOKENS) for p in PROMPTS]
    artifacts = {slots: build(directory, root / f"art{slots}", BuildOptions(slots=slots)).out for slots in (4, 2)}
    return request.param, directory, expected, artifacts


def test_config_emits_the_recurrent_depth_plan(case):
    name, directory, _, _ = case
    p, c = CASES[name].get("prelude", 1), CASES[name].get("coda", 1)
    cfg = load_config(directory / "config.json")
    assert cfg.architecture == "huginn" and cfg.post_norms and cfg.sandwich_norms and cfg.qk_bias
    assert cfg.depth_plan == DepthPlan(tuple(range(p)), (p, p + 1), 4, tuple(range(p + 2, p + 2 + c)), loop_norm=False,
                                       final_norm=True, injection="adapter-concat", readout_norm=True, state_std=0.4 ** 0.5)
    assert cfg.layer_map == [*range(p), *[p, p + 1] * 4, *range(p + 2, p + 2 + c)]
    assert cfg.exit_layer == p + 2  # the draft: after the prelude and one repeat
    assert cfg.embed_scale == pytest.approx(HIDDEN ** 0.5) and cfg.state_width == 2 * HIDDEN
    shown = run_cli("inspect", directory, env={"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    assert "injection adapter-concat (state from zero)" in shown.stdout and "unless built with --state-init random" in shown.stdout


def test_reference_matches_oracle(case):
    _, directory, _, _ = case
    tensors, config = load_tensors(directory), json.loads((directory / "config.json").read_text())
    ids = [3, 17, 4, 90, 21, 8, 8, 50, 1]
    with torch.no_grad():
        ours = load_model(directory)(torch.tensor([ids])).logits[0].double()
    theirs = oracle_logits(tensors, config, ids)
    torch.testing.assert_close(ours, theirs, atol=4e-4 * float(theirs.abs().max()), rtol=0)  # fp32 over R = 32 repeats
    assert (theirs.max(-1).values - theirs.min(-1).values).min() > 1.0  # not near-constant logits


@pytest.mark.parametrize("slots", [4, 2])
def test_speed_equals_plain_equals_oracle(case, slots):
    name, _, expected, artifacts = case
    manifest = read_manifest(artifacts[slots])
    assert manifest.slots == slots and manifest.model["state_width"] == 2 * HIDDEN
    assert manifest.schedule["readouts"]["draft"]["coda"] and manifest.schedule["readouts"]["final"]["slot"] == slots - 1
    engine = Engine.load(artifacts[slots], lazy=True)
    prompts = [list(p) for p in PROMPTS]
    accepted, mispredicted = assert_batch_lossless(engine, prompts, expected, NEW_TOKENS)
    assert (accepted if name == "settled" else mispredicted) > 0, (accepted, mispredicted)  # both paths covered


def test_final_readout_coda_holds_final_depth_states(case):
    """After SPEED the final readout's coda K/V equal plain decoding's (only verified, final-depth states
    wrote them); the draft readout's coda K/V, computed from draft-depth states, differ."""
    from speedc.format.cache_layout import CODA

    _, _, _, artifacts = case
    engine = Engine.load(artifacts[4], lazy=True)
    pools = {}
    for mode, row_budget in (("speed", None), ("plain", 0)):
        scheduler = engine.batch_scheduler(max_batch=1, row_budget=row_budget)
        engine.generate_batch([list(PROMPTS[0])], max_new_tokens=NEW_TOKENS, stop_at_eos=False, scheduler=scheduler)
        pools[mode] = [pool.copy() for pool in scheduler.backend.pool.buffers[CODA]]  # [Lc, 2, W, kvh, T+1, hd]
    written = len(PROMPTS[0]) + NEW_TOKENS - 1
    for speed, plain in zip(pools["speed"], pools["plain"]):
        assert np.abs(plain[:, 1, 0, :, :written]).max() > 0
        np.testing.assert_allclose(speed[:, 1, 0, :, :written], plain[:, 1, 0, :, :written], atol=1e-5, rtol=1e-5)
        assert np.abs(speed[:, 0, 0, :, :written] - speed[:, 1, 0, :, :written]).max() > 1e-3


def test_recurrence_chosen_at_build(tmp_path):
    directory = write_checkpoint(tmp_path / "ckpt", seed=7, recurrence=4)
    tensors, config = load_tensors(directory), json.loads((directory / "config.json").read_text())
    expected = [int(t) for t in oracle_greedy(tensors, {**config, "mean_recurrence": 6}, list(PROMPTS[1]), 8)]
    built = run_cli("build", directory, "-o", tmp_path / "art", "--recurrence", "6", "--slots", "3", "--no-measure")
    assert built.returncode == 0, built.stderr
    manifest = read_manifest(tmp_path / "art")
    assert manifest.schedule["depth_plan"]["repeats"] == 6 and manifest.slots == 3
    engine = Engine.load(tmp_path / "art", lazy=True)
    assert engine.generate(list(PROMPTS[1]), max_new_tokens=8, stop_at_eos=False).ids == expected
    assert engine.generate(list(PROMPTS[1]), max_new_tokens=8, stop_at_eos=False, mode="autoregressive").ids == expected
    # per request (its generate's num_steps) up to the built 6: 3 reads out inside slot 1 (2 repeats a slot)
    shallower = [int(t) for t in oracle_greedy(tensors, {**config, "mean_recurrence": 3}, list(PROMPTS[1]), 8)]
    assert engine.generate(list(PROMPTS[1]), max_new_tokens=8, stop_at_eos=False, loops=3).ids == shallower != expected
    with pytest.raises(GenerationError, match=r"loops must be an integer in 1..6 \(the artifact was built for 6\)"):
        engine.generate(list(PROMPTS[1]), max_new_tokens=8, loops=7)
    refused = run_cli("build", directory, "-o", tmp_path / "bad", "--recurrence", "6", "--slots", "4", "--no-measure")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr and not (tmp_path / "bad").exists()


def test_random_start_state_is_the_same_in_plain_decoding_and_speed(tmp_path):
    """--state-init random --seed S: each position's start state drawn from (S, position), fed to every
    program that runs the token: plain decoding, SPEED (P = 4) and the oracle's own draw agree; another
    seed (or zero) continues differently; inspect says which start the artifact uses."""
    directory = write_checkpoint(tmp_path / "ckpt", seed=5)
    tensors, config = load_tensors(directory), json.loads((directory / "config.json").read_text())
    prompts = [list(p) for p in PROMPTS[:2]]
    expected = [oracle_greedy(tensors, config, p, 8, seed=3) for p in prompts]
    assert expected != [oracle_greedy(tensors, config, p, 8) for p in prompts]  # the draw matters
    built = run_cli("build", directory, "-o", tmp_path / "art", "--slots", "4", "--state-init", "random", "--seed", "3",
                    "--no-measure")
    assert built.returncode == 0, built.stderr
    assert read_manifest(tmp_path / "art").model["initial_state"] == {"seed": 3, "std": pytest.approx(0.4 ** 0.5)}
    engine = Engine.load(tmp_path / "art", lazy=True)
    plain = engine.generate_batch(prompts, max_new_tokens=8, stop_at_eos=False, row_budget=0, max_batch=2)
    speed = engine.generate_batch(prompts, max_new_tokens=8, stop_at_eos=False, max_batch=2)
    assert [r.ids for r in plain] == [r.ids for r in speed] == expected
    assert engine.generate(prompts[1], max_new_tokens=8, stop_at_eos=False).ids == expected[1]
    shown = run_cli("inspect", tmp_path / "art", env={"COLUMNS": "400"})
    assert "injection adapter-concat (state random, seed 3, std 0.6325)" in shown.stdout
    refused = run_cli("build", directory, "-o", tmp_path / "bad", "--seed", "3", "--no-measure")
    assert refused.returncode != 0 and "--seed goes with --state-init random" in refused.stderr
    refused = run_cli("build", "zoo:tiny", "-o", tmp_path / "bad", "--state-init", "random", "--no-measure")
    assert refused.returncode != 0 and "has no recurrent core with an injection" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "bad").exists()


def test_recurrence_refused_for_a_fixed_loop_count(tmp_path):
    built = run_cli("build", "zoo:tiny", "-o", tmp_path / "art", "--recurrence", "3", "--no-measure")
    assert built.returncode != 0 and "Traceback" not in built.stderr
    assert "not a recurrent core with an injection" in built.stderr and len(built.stderr.strip().splitlines()) == 1


def test_bf16_sharded_checkpoint_matches_its_values(tmp_path):
    """A bf16 upload in shards (the tied lm_head stored too) reads as the same model as its values in f32."""
    f32 = write_checkpoint(tmp_path / "f32", seed=8)
    bf16 = write_checkpoint(tmp_path / "bf16", seed=8, dtype=torch.bfloat16, shards=3)
    ids = torch.tensor([[4, 9, 33, 2]])
    tensors = load_tensors(bf16)  # the bf16 values, widened
    config = json.loads((bf16 / "config.json").read_text())
    with torch.no_grad():
        ours = load_model(bf16)(ids).logits[0].double()
    torch.testing.assert_close(ours, oracle_logits(tensors, config, ids[0].tolist()), atol=1e-3, rtol=1e-3)
    assert not torch.equal(ours, load_model(f32)(ids).logits[0].double())  # the bf16 values, not the f32 ones


@pytest.mark.parametrize("change, message", [
    ({"injection_type": "add"}, "injection_type='add' is not supported"),
    ({"test_time_noise": 0.1}, "test_time_noise=0.1 is not supported"),
    ({"num_key_value_heads": 2}, "2 key/value heads for 4 heads is not supported"),
    ({"n_embd": 62}, "must be a multiple of n_heads"),
])
def test_bad_config_is_one_line(tmp_path, change, message):
    directory = write_checkpoint(tmp_path / "ckpt", seed=1)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as error:
        load_config(directory / "config.json")
    assert "\n" not in str(error.value) and message in str(error.value)


def test_missing_fused_tensor_is_one_line(tmp_path):
    directory = write_checkpoint(tmp_path / "ckpt", seed=1)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["transformer.core_block.1.mlp.fc.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    shutil.rmtree(tmp_path / "art", ignore_errors=True)
    built = run_cli("build", directory, "-o", tmp_path / "art", "--no-measure")
    assert built.returncode != 0 and "Traceback" not in built.stderr
    assert "missing tensor model.blocks.2.mlp.gate_proj.weight" in built.stderr


def test_torch_backend_refuses_the_injection(case):
    from speedc.runtimes.backends.torch_backend import TorchBackend

    _, directory, _, _ = case
    with pytest.raises(SpeedcError, match="injects its entry state"):
        TorchBackend.from_model(load_model(directory), slots=1)


def test_row_views_read_what_numpy_slicing_reads(tmp_path):
    """TensorSource.rows / reshaped / reordered over a file read the same values as numpy over the array."""
    from safetensors.numpy import save_file

    values = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    save_file({"w": values}, str(tmp_path / "w.safetensors"))
    source = safetensors_sources(tmp_path / "w.safetensors")["w"]
    order = np.array([4, 2, 5, 0, 1, 3])
    np.testing.assert_array_equal(source.rows(2, 3).read(), values[2:5])
    np.testing.assert_array_equal(source.rows(1, 4).reordered([3, 1, 0, 2]).read(), values[1:5][[3, 1, 0, 2]])
    np.testing.assert_array_equal(source.reordered(order).read(1, 3), values[order][1:4])
    np.testing.assert_array_equal(source.reshaped((48,)).rows(8, 16).read(), values.reshape(-1)[8:24])
    with pytest.raises(CheckpointError):
        source.reordered(np.array([0, 0, 1, 2, 3, 4]))


def test_half_split_order_turns_adjacent_rotary_into_half_split_rotary():
    """Permuting q and k rows per head by half_split_order, then rotating halves, gives the scores that
    rotating adjacent pairs of the stored rows gives (what lets speedc keep one rotary)."""
    from speedc.models.families.huginn import half_split_order
    from speedc.models.llama import apply_rope, rope_cos_sin

    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, HEADS, 5, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(5)[None]
    inv_freq = 1.0 / (50000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    angle = positions[0].double()[:, None] * inv_freq  # [L, hd/2]

    def adjacent(x):  # [1, h, L, hd]
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((pairs[..., 0] * angle.cos() - pairs[..., 1] * angle.sin(),
                            pairs[..., 1] * angle.cos() + pairs[..., 0] * angle.sin()), -1).flatten(-2)

    within = torch.from_numpy(half_split_order(1, HEAD_DIM))
    cos, sin = rope_cos_sin(positions, HEAD_DIM, 50000.0)
    ours = apply_rope(q[..., within], cos.double(), sin.double()) @ apply_rope(k[..., within], cos.double(), sin.double()).transpose(-1, -2)
    theirs = adjacent(q) @ adjacent(k).transpose(-1, -2)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert sorted(half_split_order(HEADS, HEAD_DIM).tolist()) == list(range(HEADS * HEAD_DIM))
