"""The reference model against an independent implementation: transformers' LlamaForCausalLM on the
unrolled weights (every logical layer stored, as save_pretrained writes it).

Tolerance: fp32 logits agree to atol 2e-4 / rtol 1e-4 (summation order differs between the two
implementations); greedy token ids must be identical.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import random_config, randomize
from speedc.models.checkpoint.torch_io import load_model, save_unrolled_hf
from speedc.models.generate import generate
from speedc.models.llama import SharedLlama

ATOL, RTOL = 2e-4, 1e-4

RANDOM_SHAPES = [
    dict(blocks=2, layers=6, heads=4, kv_heads=2),
    dict(blocks=3, layers=6, heads=4, kv_heads=4, tie=False),
    dict(blocks=1, layers=4, heads=2, kv_heads=1, theta=500.0),
    dict(blocks=4, layers=8, heads=8, kv_heads=2, hidden=64, exit_norm="final"),
    dict(layer_map={"pattern": "sequence", "num_blocks": 2}, layers=6, blocks=2),
    dict(layer_map={"pattern": "middle-cycle", "num_blocks": 4}, layers=8, blocks=4, exit_layer=3),
    dict(layer_map=[0, 1, 0, 2, 1], layers=5, blocks=3, tie=False, theta=1e6),
]


def _oracle(model: SharedLlama, tmp_path) -> LlamaForCausalLM:
    hf_dir = save_unrolled_hf(model, tmp_path / "hf")
    oracle = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    return oracle.eval()


def _compare(model: SharedLlama, oracle: LlamaForCausalLM, prompt: list[int], new_tokens: int) -> None:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ours = model(ids).logits
        theirs = oracle(ids).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
    expected = oracle.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert generate(model, prompt, new_tokens) == expected


@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_random_models_match_transformers(shape, tmp_path):
    cfg = random_config(**shape)
    model = randomize(SharedLlama(cfg), seed=len(str(shape)))
    prompt = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    _compare(model, _oracle(model, tmp_path), prompt, new_tokens=12)


def test_zoo_model_matches_transformers(zoo_model_dir, tmp_path):
    model = load_model(zoo_model_dir)
    oracle = _oracle(model, tmp_path)
    for seed in range(3):
        prompt = torch.randint(0, model.cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        _compare(model, oracle, prompt, new_tokens=24)


def test_unrolled_checkpoint_loads_as_identity_map(tmp_path):
    cfg = random_config(blocks=2, layers=4)
    model = randomize(SharedLlama(cfg), seed=3)
    hf_dir = save_unrolled_hf(model, tmp_path / "hf")
    reloaded = load_model(hf_dir)
    assert reloaded.cfg.layer_map == [0, 1, 2, 3]
    # No speedc section: the exit defaults to the end of the first pass through the blocks, via the final norm.
    assert reloaded.cfg.exit_layer == 4 and reloaded.cfg.exit_norm == "final"
    ids = torch.tensor([[1, 5, 7, 2]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
