"""Family `looped_llama` (models/families/looped_llama.py): one file, its depth plan the only thing the
rest of speedc sees. Checked against an independent oracle: transformers' LlamaForCausalLM with the
loops unrolled (layer l gets the stored layer the published description assigns: prelude, then the
core num_loops times, then the coda), recomputing the whole sequence per token.

    cycle   (no prelude / coda, 3 loops): the artifact pipelines one loop per slot (P = 3)
    middle  (1 prelude, 2-layer core x 3, 1 coda; layer map [0, 1, 2, 1, 2, 1, 2, 3]): P = 3, slot 0
            runs the prelude then its loop, the coda runs at each readout with that readout depth's own
            coda K/V (the draft after slot 0, the final after slot 2)
    middle-scaled: the same with small residual branches, so drafts are often right (kept work)

Each: batched SPEED ids == batched plain ids == the oracle's (greedy), SPEED == plain (seeded sampling);
random weights mispredict (mispredicted > 0) and the scaled model accepts (accepted > 0), so the
equalities cover both paths. After SPEED the final readout's coda K/V equal plain decoding's (it only
ever held final-depth states).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import run_cli
from looped_checkpoints import batch_plain_and_speed, hf_greedy, seeded_prompt
from speedc import Engine
from speedc.format import contract
from speedc.format.artifact import read_manifest
from speedc.build import build
from speedc.errors import CheckpointError
from speedc.models.checkpoint.torch_io import load_model
from speedc.models.families import load_config
from speedc.format.depth_plan import DepthPlan
from speedc.passes.base import BuildOptions

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 96, 64, 4, 2, 16, 128
PROMPT_LEN, NEW_TOKENS, PROMPT_SEEDS = 6, 16, (0, 1, 2)
SHAPES = {"cycle": dict(prelude=0, core=2, coda=0, loops=3), "middle": dict(prelude=1, core=2, coda=1, loops=3),
          "middle-scaled": dict(prelude=1, core=2, coda=1, loops=3)}
LAYER_SCALE = {"middle-scaled": 0.03}  # layer weights' scale (else 0.15): small residual branches, drafts often right


def hf_config(layers: int) -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                         max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         attention_bias=False, mlp_bias=False, hidden_act="silu", tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return config


def unrolled_layers(prelude: int, core: int, coda: int, loops: int) -> list[int]:
    """The stored layer each logical layer runs, from the family's description (not speedc's code)."""
    return list(range(prelude)) + list(range(prelude, prelude + core)) * loops + list(range(prelude + core, prelude + core + coda))


def write_checkpoint(directory: Path, seed: int, prelude: int, core: int, coda: int, loops: int,
                     layer_scale: float = 0.15) -> Path:
    directory.mkdir(parents=True)
    stored = LlamaForCausalLM(hf_config(prelude + core + coda))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights far from uniform logits: drafts often wrong
        for name, param in stored.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = layer_scale if name.startswith("model.layers.") else 0.15
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else scale * noise)
    tensors = {name: t.contiguous() for name, t in stored.state_dict().items() if "rotary" not in name}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config(prelude + core + coda).to_dict(), "architectures": ["LoopedLlamaForCausalLM"],
              "model_type": "looped_llama", "num_prelude_layers": prelude, "num_coda_layers": coda, "num_loops": loops}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def oracle_for(directory: Path, prelude: int, core: int, coda: int, loops: int) -> LlamaForCausalLM:
    """LlamaForCausalLM over the unrolled layers, loaded strictly from the stored tensors."""
    from safetensors.torch import load_file

    stored = load_file(str(directory / "model.safetensors"))
    layers = unrolled_layers(prelude, core, coda, loops)
    state = {name: t for name, t in stored.items() if not name.startswith("model.layers.")}
    for logical, source in enumerate(layers):
        prefix = f"model.layers.{source}."
        state.update({f"model.layers.{logical}.{name[len(prefix):]}": t for name, t in stored.items() if name.startswith(prefix)})
    oracle = LlamaForCausalLM(hf_config(len(layers)))
    oracle.load_state_dict(state, strict=True)
    return oracle.eval()


def oracle_greedy(oracle: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    return hf_greedy(oracle, prompt, NEW_TOKENS)


def prompt(seed: int) -> list[int]:
    return seeded_prompt(seed, PROMPT_LEN, VOCAB)


@pytest.fixture(scope="module", params=list(SHAPES))
def case(request, tmp_path_factory):
    shape = SHAPES[request.param]
    directory = write_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", seed=5,
                                 layer_scale=LAYER_SCALE.get(request.param, 0.15), **shape)
    artifact = build(directory, directory.parent / "art", BuildOptions()).out
    return request.param, shape, directory, oracle_for(directory, **shape), artifact


def test_family_emits_its_depth_plan(case):
    name, shape, directory, _, _ = case
    cfg = load_config(directory / "config.json")
    assert cfg.architecture == "looped_llama"
    assert cfg.layer_map == unrolled_layers(**shape)
    p, c = shape["prelude"], shape["core"]
    assert cfg.depth_plan == DepthPlan(tuple(range(p)), tuple(range(p, p + c)), shape["loops"],
                                       tuple(range(p + c, p + c + shape["coda"])))
    assert cfg.exit_layer == p + c  # the draft: after the prelude and one loop


def test_reference_matches_oracle(case):
    _, _, directory, oracle, _ = case
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = load_model(directory)(ids).logits, oracle(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert (theirs.max(-1).values - theirs.min(-1).values).min() > 0.5  # not near-constant logits


def test_manifest_records_the_plan(case):
    name, shape, _, _, artifact = case
    manifest = read_manifest(artifact)
    plan = manifest.schedule["depth_plan"]
    assert (len(plan["prelude"]), len(plan["core"]), plan["repeats"], len(plan["coda"])) == (
        shape["prelude"], shape["core"], shape["loops"], shape["coda"])
    assert manifest.slots == shape["loops"] and manifest.schedule["readouts"]["final"]["slot"] == 2
    assert manifest.schedule["slot_layers"][0][:shape["prelude"] + 1] == list(range(shape["prelude"] + 1))  # prelude first
    assert manifest.schedule["readouts"]["draft"]["coda"] == bool(shape["coda"])
    assert (contract.fused(contract.ENGINE) in manifest.graphs) == (not shape["coda"])  # fused: cycles only
    shown = run_cli("inspect", artifact)
    assert shown.returncode == 0, shown.stderr
    assert f"depth plan: {DepthPlan.from_json(plan).describe()}" in shown.stdout


def test_greedy_and_sampled_ids(case):
    name, _, _, oracle, artifact = case
    engine = Engine.load(artifact, lazy=True)  # the batch path (no single-sequence backend: it runs cycles only)
    prompts = [prompt(seed) for seed in PROMPT_SEEDS]
    expected = [oracle_greedy(oracle, p) for p in prompts]
    plain, speed = batch_plain_and_speed(engine, prompts, NEW_TOKENS)
    assert [r.ids for r in plain] == expected
    assert {r.stats.mode for r in speed} == {"batch speed"}
    assert [r.ids for r in speed] == expected
    accepted, mispredicted = sum(r.stats.accepted for r in speed), sum(r.stats.mispredicted for r in speed)
    # Both paths are covered: random weights mispredict (flushes), the scaled model's drafts hold (kept work).
    assert (accepted if name in LAYER_SCALE else mispredicted) > 0, (accepted, mispredicted)
    settings = [{"temperature": 0.9, "top_p": 0.95, "seed": s} for s in (11, 12, 13)]
    runs = [engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, settings=settings, max_batch=3,
                                  **extra) for extra in ({}, {"row_budget": 0})]
    assert [r.ids for r in runs[0]] == [r.ids for r in runs[1]]


def test_final_readout_coda_holds_final_depth_states(case):
    """After SPEED the final readout's coda K/V of every position equal plain decoding's: only tokens
    leaving the last slot (verified, final depth) wrote them; the draft readout's are its own."""
    from speedc.format.cache_layout import CODA

    name, shape, _, _, artifact = case
    if not shape["coda"]:
        return
    engine = Engine.load(artifact, lazy=True)  # the batch path (no single-sequence backend: it runs cycles only)
    pools = {}
    for mode, row_budget in (("speed", None), ("plain", 0)):
        scheduler = engine.batch_scheduler(max_batch=1, row_budget=row_budget)
        engine.generate_batch([prompt(0)], max_new_tokens=NEW_TOKENS, stop_at_eos=False, scheduler=scheduler)
        pools[mode] = [pool.copy() for pool in scheduler.backend.pool.buffers[CODA]]  # [Lc, 2, W, kvh, T+1, hd]
    written = PROMPT_LEN + NEW_TOKENS - 1  # the last emitted token never runs
    for speed, plain in zip(pools["speed"], pools["plain"]):
        final = speed.shape[1] - 1
        assert np.abs(plain[:, final, 0, :, :written]).max() > 0  # rows that were written
        np.testing.assert_allclose(speed[:, final, 0, :, :written], plain[:, final, 0, :, :written], atol=1e-5, rtol=1e-5)


def test_bad_shape_is_one_line(tmp_path):
    data = {**hf_config(3).to_dict(), "architectures": ["LoopedLlamaForCausalLM"], "model_type": "looped_llama",
            "num_prelude_layers": 2, "num_coda_layers": 1, "num_loops": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as error:
        load_config(path)
    assert "\n" not in str(error.value) and "leave no core" in str(error.value)


def test_pytorch_backend_runs_cycles_and_refuses_a_pipelined_prelude_or_coda(case):
    """The PyTorch backend's stages are one cycle's layers: it runs the cycle artifact and refuses the
    middle one (prelude / coda pipelined into the slots) by name."""
    from speedc.errors import SpeedcError
    from speedc.runtimes.backends.torch_backend import TorchBackend

    name, _, _, _, artifact = case
    manifest = read_manifest(artifact)
    if name == "cycle":
        TorchBackend(artifact, manifest)
        return
    with pytest.raises(SpeedcError, match="pipelines one repeated cycle; this artifact's depth plan has a prelude / coda"):
        TorchBackend(artifact, manifest)
