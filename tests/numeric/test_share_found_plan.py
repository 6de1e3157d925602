"""A depth plan found by the `share` pass pipelines like the same plan declared by a family.

The checkpoint is a plain, unrolled LlamaForCausalLM (model_type llama, every layer stored) whose stored
layers repeat as prelude / core / coda: layer map [0, 1, 2, 1, 2, 1, 2, 3]. Nothing declares the loops;
the build finds them in the weights (before the trace, as `share` after it) and traces the model once with
that plan, so the artifact pipelines P = 3 (slot 0 runs the prelude, the coda at each readout) instead of
building a plain engine.

Checked against transformers running the unrolled checkpoint itself (recomputing the sequence per token):
batched SPEED ids == plain ids == the oracle's (greedy), SPEED == plain (seeded sampling), with
speculative steps run and both paths (accepted drafts, mispredictions) exercised over the two scales.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from looped_checkpoints import hf_greedy, seeded_prompt
from speedc import Engine
from speedc.build import build
from speedc.format.artifact import read_manifest
from speedc.passes.base import BuildOptions

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 96, 64, 4, 2, 16, 128
PROMPT_LEN, NEW_TOKENS, PROMPT_SEEDS = 6, 16, (0, 1, 2)
STORED_OF_LAYER = [0, 1, 2, 1, 2, 1, 2, 7]  # the layer whose weights each layer copies: prelude, core x 3, coda
LAYER_MAP = [0, 1, 2, 1, 2, 1, 2, 3]  # the blocks share should find
LAYER_SCALES = {"random": 0.15, "scaled": 0.03}  # 0.03: small residual branches, drafts often right


def hf_config() -> LlamaConfig:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=len(STORED_OF_LAYER), num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
                         mlp_bias=False, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return config


def write_unrolled_checkpoint(directory: Path, seed: int, layer_scale: float) -> LlamaForCausalLM:
    """An unrolled Llama whose layer l holds a copy of layer STORED_OF_LAYER[l]'s random weights; returns it."""
    directory.mkdir(parents=True)
    model = LlamaForCausalLM(hf_config())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = layer_scale if name.startswith("model.layers.") else 0.15
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else scale * noise)
        for layer, stored in enumerate(STORED_OF_LAYER):
            if stored != layer:
                model.model.layers[layer].load_state_dict(model.model.layers[stored].state_dict())
    tensors = {name: t.clone().contiguous() for name, t in model.state_dict().items() if "rotary" not in name}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config().to_dict(), "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (directory / "config.json").write_text(json.dumps(config))
    return model.eval()


def oracle_greedy(oracle: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    return hf_greedy(oracle, prompt, NEW_TOKENS)


def prompt(seed: int) -> list[int]:
    return seeded_prompt(seed, PROMPT_LEN, VOCAB)


@pytest.fixture(scope="module", params=list(LAYER_SCALES))
def case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    oracle = write_unrolled_checkpoint(directory, seed=5, layer_scale=LAYER_SCALES[request.param])
    ran = []  # the passes run, in order
    result = build(directory, directory.parent / "art", BuildOptions(), on_pass=lambda report: ran.append(report.name))
    result.passes_run = ran
    return request.param, oracle, result


def test_share_finds_and_pipelines_the_plan(case):
    _, _, result = case
    manifest = read_manifest(result.out)
    assert manifest.layer_map == LAYER_MAP
    plan = manifest.schedule["depth_plan"]
    assert (len(plan["prelude"]), len(plan["core"]), plan["repeats"], len(plan["coda"])) == (1, 2, 3, 1)
    assert manifest.slots == 3, manifest.schedule["reason"]
    assert manifest.schedule["slot_layers"][0][:2] == [0, 1]  # slot 0 runs the prelude, then its loop
    assert manifest.schedule["readouts"]["draft"]["coda"]
    assert any("traced with the depth plan found in the weights" in note for note in result.notes)
    assert result.passes_run.count("trace") == 1 and result.passes_run.count("share") == 1  # one trace, not two


def test_greedy_and_sampled_ids(case):
    name, oracle, result = case
    engine = Engine.load(result.out, lazy=True)
    prompts = [prompt(seed) for seed in PROMPT_SEEDS]
    expected = [oracle_greedy(oracle, p) for p in prompts]
    plain = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, row_budget=0, max_batch=3)
    assert [r.ids for r in plain] == expected
    speed = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, row_budget=None,
                                  per_sequence=False, max_batch=3)
    assert [r.ids for r in speed] == expected
    assert sum(r.stats.speed_steps for r in speed) > 0
    accepted, mispredicted = sum(r.stats.accepted for r in speed), sum(r.stats.mispredicted for r in speed)
    assert (accepted if name == "scaled" else mispredicted) > 0, (accepted, mispredicted)
    settings = [{"temperature": 0.9, "top_p": 0.95, "seed": s} for s in (11, 12, 13)]
    runs = [engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, stop_at_eos=False, settings=settings, max_batch=3,
                                  **extra) for extra in ({"row_budget": None, "per_sequence": False}, {"row_budget": 0})]
    assert [r.ids for r in runs[0]] == [r.ids for r in runs[1]]
    assert sum(r.stats.speed_steps for r in runs[0]) > 0
