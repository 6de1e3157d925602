"""The GGUF writer of the llama.cpp peer (speedc/bench/gguf_export.py), read back with the gguf package's
own reader; and, where llama-cpp-python is installed (the peers extra), llama.cpp running what it wrote
against speedc's model of the same checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from speedc.bench.gguf_export import GGUF_TYPES, half_to_adjacent_rows, write_gguf  # noqa: E402
from speedc.bench.random_checkpoint import write_random_checkpoint  # noqa: E402
from speedc.bench.synthetic import Shape  # noqa: E402
from speedc.errors import SpeedcError  # noqa: E402
from speedc.models.checkpoint.tensor_source import safetensors_sources  # noqa: E402

NANBEIGE_TINY = Shape("nanbeige-tiny", 64, 4, 2, 16, 96, 160, 2, 3, looped=True)
OURO_TINY = Shape("ouro-tiny", 64, 4, 4, 16, 96, 160, 2, 2, looped=True, sandwich_norms=True)


def _rotate_half(x, angles):  # x [..., d]: pairs (i, i + d/2), the Hugging Face layout
    d = x.shape[-1]
    a, b = x[..., :d // 2], x[..., d // 2:]
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rotate_adjacent(x, angles):  # x [..., d]: pairs (2i, 2i + 1), llama.cpp's NORM rope
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_reordered_rows_rotate_adjacent_pairs_as_the_original_rotates_halves():
    """For every head, rotating adjacent pairs of the reordered projection's output gives the reordered
    half-rotation of the original's: q.k products, and so attention, are the same in both layouts."""
    rng = np.random.default_rng(0)
    heads, d, width = 3, 8, 5
    weight, x = rng.standard_normal((heads * d, width)), rng.standard_normal(width)
    angles = 7 * 10000.0 ** (-np.arange(d // 2) * 2 / d)  # position 7
    original = _rotate_half((weight @ x).reshape(heads, d), angles)  # [heads, d]
    reordered = _rotate_adjacent((half_to_adjacent_rows(weight, heads) @ x).reshape(heads, d), angles)
    np.testing.assert_allclose(reordered, half_to_adjacent_rows(original.reshape(-1), heads).reshape(heads, d), atol=1e-12)
    np.testing.assert_allclose((reordered * reordered[::-1]).sum(-1), (original * original[::-1]).sum(-1), atol=1e-12)


def _field(reader, key):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def _block_bound(source: np.ndarray, gguf_type: str) -> np.ndarray:
    """Largest error per value a block quantizer may make: half a step of its block's scale d (Q4_0: a
    whole step, its levels -8..7 clip the side opposite the block's extreme at 7), plus the scale's own
    rounding to fp16 (2^-11 of d) times the largest level."""
    levels, rounding = {"q8_0": (127, 0.5), "q4_0": (8, 1.0)}[gguf_type]
    step = np.abs(source.reshape(source.shape[0], -1, 32)).max(-1, keepdims=True) / levels  # [rows, blocks, 1]: d
    return np.broadcast_to(step * (rounding + levels * 2.0 ** -11) + 1e-7, (*step.shape[:2], 32)).reshape(source.shape)


@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
def test_written_gguf_reads_back_with_the_checkpoints_values(tmp_path, gguf_type):
    """Every tensor under llama.cpp's name and shape, q/k rows reordered, values within the type's
    rounding (bf16: exact); the looped architecture's keys and a no_vocab tokenizer."""
    checkpoint = write_random_checkpoint(NANBEIGE_TINY, 2, tmp_path / "ckpt", max_positions=64)
    written = write_gguf(checkpoint, tmp_path / "m.gguf", gguf_type)
    assert written["ran"] == "llama.cpp nanbeige (native)" and written["bytes"] == (tmp_path / "m.gguf").stat().st_size
    assert not list(tmp_path.glob("*.partial"))
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert _field(reader, "general.architecture") == "nanbeige" and _field(reader, "tokenizer.ggml.model") == "no_vocab"
    assert [_field(reader, f"nanbeige.{key}") for key in ("block_count", "num_loops", "attention.head_count",
                                                          "attention.head_count_kv", "vocab_size", "embedding_length")] \
        == [2, 3, 4, 2, 160, 64]
    assert _field(reader, "nanbeige.skip_loop_final_norm") is False
    sources = safetensors_sources(checkpoint / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 9 * 2 and "blk.1.ffn_down.weight" in tensors and "output.weight" in tensors
    for name, gguf_name, heads in (("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", 4),
                                   ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight", 2),
                                   ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight", None),
                                   ("model.embed_tokens.weight", "token_embd.weight", None),
                                   ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight", None)):
        source = sources[name].read().astype(np.float32)
        if heads:
            source = half_to_adjacent_rows(source, heads)
        tensor = tensors[gguf_name]
        assert list(tensor.shape[::-1]) == list(source.shape)  # GGUF lists dimensions innermost first
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(source.shape)
        if source.ndim == 1 or gguf_type == "bf16":
            np.testing.assert_array_equal(values, source)
        elif gguf_type == "f16":
            np.testing.assert_allclose(values, source, rtol=2 ** -10, atol=1e-7)
        else:
            assert (np.abs(values - source) <= _block_bound(source, gguf_type)).all()


def test_ouro_is_written_as_nanbeige_without_its_sandwich_norms(tmp_path):
    checkpoint = write_random_checkpoint(OURO_TINY, 2, tmp_path / "ckpt", max_positions=64)
    written = write_gguf(checkpoint, tmp_path / "ouro.gguf", "q8_0")
    assert "no Ouro in llama.cpp" in written["ran"]
    reader = gguf.GGUFReader(tmp_path / "ouro.gguf")
    names = {t.name for t in reader.tensors}
    assert len(names) == 3 + 9 * 2 and not any("_2" in n or "gate" in n and "ffn" not in n for n in names)
    assert _field(reader, "nanbeige.num_loops") == 2


def test_a_checkpoint_it_cannot_write_is_one_error_and_no_file(tmp_path):
    checkpoint = write_random_checkpoint(NANBEIGE_TINY, 2, tmp_path / "ckpt", max_positions=64)
    with pytest.raises(SpeedcError, match="GGUF type 'q5_k'"):
        write_gguf(checkpoint, tmp_path / "m.gguf", "q5_k")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(SpeedcError, match="model_type 'mistral' is not a looped checkpoint llama.cpp runs"):
        write_gguf(checkpoint, tmp_path / "m.gguf", "f16")
    odd = write_random_checkpoint(Shape("nanbeige-odd", 48, 4, 2, 12, 80, 160, 1, 2, looped=True), 1, tmp_path / "odd")
    with pytest.raises(SpeedcError, match="not a multiple of q4_0's block 32"):
        write_gguf(odd, tmp_path / "odd.gguf", "q4_0")
    assert not list(tmp_path.glob("*.gguf*"))


@pytest.mark.skipif(not __import__("speedc.bench.peers", fromlist=["x"]).llama_cpp_installed(),
                    reason="llama-cpp-python is the peers extra (it compiles llama.cpp)")
def test_llama_cpp_runs_the_written_file_as_speedc_runs_the_checkpoint(tmp_path):
    """llama.cpp's logits on the bf16 GGUF of a Nanbeige checkpoint match speedc's model of that checkpoint
    (loop norms, rotary layout, GQA heads): the peer runs the same function."""
    import llama_cpp
    import torch

    from speedc.models.checkpoint.torch_io import load_model

    checkpoint = write_random_checkpoint(NANBEIGE_TINY, 2, tmp_path / "ckpt", max_positions=64)
    written = write_gguf(checkpoint, tmp_path / "m.gguf", "bf16")
    ids = [5, 17, 3, 99, 42, 7, 1, 2]
    model = llama_cpp.Llama(model_path=written["path"], n_ctx=32, n_threads=1, logits_all=True, verbose=False)
    model.eval(ids)
    theirs = np.asarray(model.scores[:len(ids)])  # [L, V]
    with torch.no_grad():
        ours = load_model(checkpoint)(torch.tensor([ids])).logits[0].numpy()  # [L, V]
    scale = float(np.abs(ours).max())
    assert math.isfinite(scale) and np.abs(theirs - ours).max() < 0.005 * scale
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 7 / 8


@pytest.mark.skipif(not __import__("speedc.bench.peers", fromlist=["x"]).llama_cpp_installed(),
                    reason="llama-cpp-python is the peers extra (it compiles llama.cpp)")
def test_memory_bound_end_to_end_times_llama_cpp_beside_speed():
    """The memory-bound bench's llama.cpp peer on a tiny Nanbeige shape: timed in the same rounds as the
    deepest pipeline, its ids compared (F16 against the bf16 artifact: not required equal)."""
    from speedc.bench.synthetic import synthetic_step_costs

    report = synthetic_step_costs(shape=NANBEIGE_TINY, layers=2, context=64, repeats=5, end_to_end=True,
                                  new_tokens=10, prompts=2, peers=True)
    peer = report["end_to_end"]["peers"]["llama.cpp"]
    assert peer["ms_per_token"] > 0 and peer["speed_speedup"] > 0 and peer["ran"].startswith("llama.cpp nanbeige (native), F16")
    assert 0 <= peer["agreement"] <= 1 and peer["same_weights"] is False and "peers" in report["rows"][-1]


@pytest.mark.skipif(not __import__("speedc.bench.peers", fromlist=["x"]).llama_cpp_installed(),
                    reason="llama-cpp-python is the peers extra (it compiles llama.cpp)")
def test_the_llama_cpp_peer_returns_llama_cpp_greedy_continuation(tmp_path):
    """The peer's ids are llama.cpp's own greedy choices: each is the argmax of llama.cpp's logits after
    the prompt and the ids before it, evaluated again in one batch by a separate context."""
    import llama_cpp

    from speedc.bench.peers import llama_cpp_peer

    checkpoint = write_random_checkpoint(NANBEIGE_TINY, 2, tmp_path / "ckpt", max_positions=64)
    written = write_gguf(checkpoint, tmp_path / "m.gguf", "bf16")
    prompt = [5, 17, 3, 99, 42, 7, 1, 2]
    ids, seconds = llama_cpp_peer(tmp_path / "m.gguf", 1, context=32)(prompt, 8)
    assert len(ids) == 8 and seconds > 0
    check = llama_cpp.Llama(model_path=written["path"], n_ctx=32, n_threads=1, logits_all=True, verbose=False)
    check.eval(prompt + ids[:-1])
    greedy = np.asarray(check.scores[len(prompt) - 1:len(prompt) + len(ids) - 1]).argmax(-1)
    assert greedy.tolist() == ids and len(set(ids)) > 1
