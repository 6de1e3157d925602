"""The compiled batch step graph, run by ONNX Runtime for one sequence (n = 1, what a single-sequence
call runs), equals the PyTorch reference slot by slot.

For random slot contents (a token in slot 0, random hidden states in slots 1..P-1), random per-slot
positions and a random KV cache, every slot's hidden state after its stage, its new K/V rows, the
early-exit argmax (every slot's exit head asked for) and the oldest slot's final logits must match the
reference model computing the same logical layers. Tolerance: atol 1e-4, rtol 1e-4 (fp32; summation
order differs).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import build_artifact, random_config, randomize, run_engine_program
from speedc.format import contract
from speedc.format.artifact import read_manifest
from speedc.models.llama import LayerCache, SharedLlama, rope_cos_sin

ATOL = RTOL = 1e-4
CASES = [
    dict(blocks=2, layers=6, heads=4, kv_heads=2),
    dict(blocks=2, layers=8, heads=4, kv_heads=1, tie=False, exit_norm="final"),
    dict(blocks=3, layers=6, heads=2, kv_heads=2, hidden=48, exit_layer=2),
]


@pytest.mark.parametrize("shape", CASES, ids=["gqa", "mqa-untied", "exit-mid-stage"])
def test_batch_step_graph_matches_reference(shape, tmp_path):
    cfg = random_config(**shape)
    model = randomize(SharedLlama(cfg), seed=21)
    art = build_artifact(model, tmp_path / "art")
    manifest = read_manifest(art)
    slots, stage = manifest.slots, manifest.stage_layers
    assert slots == cfg.num_hidden_layers // cfg.num_blocks and stage == cfg.num_blocks
    session = ort.InferenceSession(str(art / "engine.onnx"))
    rng = np.random.default_rng(0)
    context = 24
    width = contract.candidate_count(cfg.vocab_size)
    for trial in range(3):
        positions = rng.choice(np.arange(1, context), size=slots, replace=False)
        token = int(rng.integers(cfg.vocab_size))
        hidden_in = rng.standard_normal((slots - 1, 1, cfg.hidden_size)).astype(np.float32)
        kv_shape = (stage, slots, cfg.num_key_value_heads, context, cfg.head_dim)
        key = rng.standard_normal(kv_shape).astype(np.float32)
        value = rng.standard_normal(kv_shape).astype(np.float32)
        feeds = {"input_ids": np.array([[token]]), "positions": positions.astype(np.int64), "hidden_in": hidden_in,
                 "final_rows": np.array([slots - 1]), "exit_rows": np.arange(slots),  # row s = slot s (n = 1)
                 "check_rows": np.zeros(0, np.int64), "check_candidates": np.zeros((0, width), np.int64)}
        for j in range(stage):
            for s in range(slots):
                feeds[f"cache.key.{j}.{s}"], feeds[f"cache.value.{j}.{s}"] = key[j, s][None], value[j, s][None]
        out = run_engine_program(session, contract.BATCH_STEP, feeds)

        with torch.no_grad():
            for slot in range(slots):
                x = model.model.embed_tokens(torch.tensor([[token]])) if slot == 0 else torch.from_numpy(hidden_in[slot - 1:slot])
                pos = int(positions[slot])
                cos, sin = rope_cos_sin(torch.tensor([[pos]]), cfg.head_dim, cfg.rope_theta)
                exit_hidden = None
                for j in range(stage):
                    layer = slot * stage + j
                    cache = LayerCache(torch.from_numpy(key[j, slot][None].copy()), torch.from_numpy(value[j, slot][None].copy()))
                    x = model.model.blocks[cfg.layer_map[layer]](x, cos, sin, cache, start_pos=pos)
                    np.testing.assert_allclose(out["new_key"][j, slot, :, 0], cache.k[0, :, pos].numpy(), atol=ATOL, rtol=RTOL)
                    np.testing.assert_allclose(out["new_value"][j, slot, :, 0], cache.v[0, :, pos].numpy(), atol=ATOL, rtol=RTOL)
                    if j + 1 == manifest.exit_layer:
                        exit_hidden = x
                np.testing.assert_allclose(out["hidden_out"][slot], x[0].numpy(), atol=ATOL, rtol=RTOL)
                exit_logits = model.exit_head(exit_hidden)[0, 0]
                assert out["exit_tokens"][slot] == int(exit_logits.argmax())
                if slot == slots - 1:
                    final = model.final_head(x)[0, 0].numpy()
                    np.testing.assert_allclose(out["final_logits"][0], final, atol=ATOL, rtol=RTOL)
                    assert out["final_token"][0] == int(final.argmax())
