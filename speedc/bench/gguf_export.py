"""GGUF files for llama.cpp, written from a looped checkpoint in its published layout, for the llama.cpp
peer of `speedc bench memory-bound --end-to-end` (the same weights as the artifact where the type allows).

    checkpoint (HF layout, safetensors)                 GGUF (architecture "nanbeige", llama.cpp's looped Llama)
      model.embed_tokens.weight                  ->       token_embd.weight
      model.layers.{i}.input_layernorm           ->       blk.{i}.attn_norm            f32
      model.layers.{i}.self_attn.{q,k}_proj      ->       blk.{i}.attn_{q,k}           rows permuted (below)
      model.layers.{i}.self_attn.{v,o}_proj      ->       blk.{i}.attn_{v,output}
      model.layers.{i}.post_attention_layernorm  ->       blk.{i}.ffn_norm             f32
      model.layers.{i}.mlp.{gate,up,down}_proj   ->       blk.{i}.ffn_{gate,up,down}
      model.norm.weight, lm_head.weight          ->       output_norm.weight (f32), output.weight
    config: num_loops / total_ut_steps           ->       nanbeige.num_loops, nanbeige.skip_loop_final_norm

Nanbeige4.2 is native in llama.cpp (its `nanbeige` architecture: the physical layers run num_loops times,
the output norm between loops unless skip_loop_final_norm). llama.cpp has no Ouro; an Ouro checkpoint is
written as that architecture with Ouro's layer shapes: its second sandwich norms and exit gate are
left out (two elementwise ops a layer: the cost is the same, the function is not, so its ids are only
compared). Every matrix is stored at the one type asked (like llama-quantize --pure), norms at f32.
The vocabulary is llama.cpp's `no_vocab`: the bench feeds token ids, nothing is tokenized.

llama.cpp rotates adjacent pairs (x[2i], x[2i+1]) where the Hugging Face layout rotates halves (x[i],
x[i + d/2]), so each head's q and k rows are reordered: half-rotation row i goes to 2i, row i + d/2 to 2i + 1.
A matrix is converted a row block at a time (the 166144 x 3072 Nanbeige embedding is 2 GB at fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from speedc.errors import SpeedcError

GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_0")  # what the writer stores matrices as
GGUF_TYPE_FOR_WEIGHTS = {"int4": "q4_0", "int8": "q8_0"}  # the bench's llama.cpp peer per artifact precision; f16 else
ARCHITECTURE = "nanbeige"
ROW_BLOCK_BYTES = 64 << 20  # fp32 bytes of a matrix converted at a time
LLAMA_LAYER_TENSORS = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                       "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                       "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                       "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                       "mlp.down_proj.weight": "ffn_down.weight"}
DROPPED_OURO = ("input_layernorm_2.weight", "post_attention_layernorm_2.weight", "early_exit_gate.")


def gguf_module():
    try:
        import gguf
    except ImportError:
        raise SpeedcError("writing GGUF needs the gguf package: pip install 'speedc[peers]'") from None
    return gguf


def half_to_adjacent_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection's rows [heads * d, ...] reordered from half rotation to adjacent-pair rotation."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)  # [heads * d, ...]


def _checkpoint_sources(checkpoint: Path) -> dict:
    from speedc.models.checkpoint.tensor_source import safetensors_sources

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise SpeedcError(f"{checkpoint}: no safetensors files to write a GGUF from")
    sources = {}
    for path in files:
        sources.update(safetensors_sources(path))
    return sources


def gguf_plan(config: dict) -> dict:
    """What the GGUF says of CONFIG (a Nanbeige or Ouro config.json): loops, norms, and what it leaves out."""
    model_type = config.get("model_type")
    if model_type == "nanbeige":
        return {"loops": int(config.get("num_loops", 1) or 1), "skip_loop_final_norm": bool(config.get("skip_loop_final_norm", False)),
                "eps": float(config.get("rms_norm_eps", 1e-5)), "ran": "llama.cpp nanbeige (native)"}
    if model_type == "ouro":
        return {"loops": int(config.get("total_ut_steps", 4)), "skip_loop_final_norm": False,
                "eps": float(config.get("rms_norm_eps", 1e-6)),
                "ran": "llama.cpp nanbeige with Ouro's layer shapes (no Ouro in llama.cpp: sandwich norms and exit gate left out)"}
    raise SpeedcError(f"GGUF export: model_type {model_type!r} is not a looped checkpoint llama.cpp runs "
                      "(known: nanbeige; ouro as nanbeige)")


def _gguf_name(name: str) -> str | None:
    """The GGUF tensor of checkpoint tensor NAME (None: left out)."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers."):].split(".", 1)
        if rest in LLAMA_LAYER_TENSORS:
            return f"blk.{layer}.{LLAMA_LAYER_TENSORS[rest]}"
    if any(part in name for part in DROPPED_OURO):
        return None
    raise SpeedcError(f"GGUF export: no llama.cpp tensor for checkpoint tensor {name}")


class _StreamedMatrix:
    """A matrix's GGUF bytes produced a row block at a time: what GGUFWriter.write_tensor_data reads of an
    array (nbytes, tofile) without the whole converted matrix in memory."""

    def __init__(self, source, ggml_type, heads: int | None, nbytes: int) -> None:
        self.source, self.ggml_type, self.heads, self.nbytes = source, ggml_type, heads, nbytes

    def tofile(self, out) -> None:
        gguf = gguf_module()
        rows = self.source.read().astype(np.float32) if self.heads else None  # q/k: permuted whole (<= 64 MB fp32)
        if rows is not None:
            rows = half_to_adjacent_rows(rows, self.heads)
        step = max(1, ROW_BLOCK_BYTES // (4 * self.source.shape[1]))
        for first in range(0, self.source.shape[0], step):
            block = rows[first:first + step] if rows is not None else self.source.read(first, min(step, self.source.shape[0] - first))
            out.write(_encode(gguf, np.asarray(block, np.float32), self.ggml_type).tobytes())


def _encode(gguf, block: np.ndarray, ggml_type) -> np.ndarray:
    types = gguf.GGMLQuantizationType
    if ggml_type == types.F32:
        return block
    if ggml_type == types.F16:
        return block.astype(np.float16)
    return gguf.quants.quantize(block, ggml_type)


def _add_header(writer, gguf, config: dict, plan: dict) -> None:
    """The model's sizes and loop rule as llama.cpp's nanbeige architecture reads them (no vocabulary)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(plan["eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_uint32(f"{ARCHITECTURE}.num_loops", plan["loops"])
    writer.add_bool(f"{ARCHITECTURE}.skip_loop_final_norm", plan["skip_loop_final_norm"])
    writer.add_tokenizer_model("no_vocab")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(checkpoint: Path, out: Path, gguf_type: str, *, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Write CHECKPOINT (a Nanbeige or Ouro checkpoint directory) as a GGUF file OUT whose matrices are
    GGUF_TYPE (GGUF_TYPES). Returns {"path", "bytes", "gguf_type", "ran"}. OUT appears only when complete."""
    gguf = gguf_module()
    if gguf_type not in GGUF_TYPES:
        raise SpeedcError(f"GGUF type {gguf_type!r}: one of {', '.join(GGUF_TYPES)}")
    checkpoint, out = Path(checkpoint), Path(out)
    config = json.loads((checkpoint / "config.json").read_text())
    plan = gguf_plan(config)
    types = gguf.GGMLQuantizationType
    matrix_type = {"f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0, "q4_0": types.Q4_0}[gguf_type]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, ARCHITECTURE)
    _add_header(writer, gguf, config, plan)
    tensors = []
    for name, source in _checkpoint_sources(checkpoint).items():
        target = _gguf_name(name)
        if target is None:
            continue
        if len(source.shape) == 1:
            ggml_type, nbytes = types.F32, 4 * source.numel
        else:
            ggml_type = matrix_type
            block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
            if source.shape[1] % block:
                raise SpeedcError(f"GGUF export: {name} has {source.shape[1]} columns, not a multiple of {gguf_type}'s block {block}")
            nbytes = source.shape[0] * source.shape[1] // block * block_bytes
        permute = heads if name.endswith("q_proj.weight") else kv_heads if name.endswith("k_proj.weight") else None
        writer.add_tensor_info(target, source.shape, np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
        tensors.append((target, source, ggml_type, permute, nbytes))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, total = 0, sum(t[4] for t in tensors)
        for target, source, ggml_type, permute, nbytes in tensors:
            if len(source.shape) == 1:
                writer.write_tensor_data(np.asarray(source.read(), np.float32))
            else:
                writer.write_tensor_data(_StreamedMatrix(source, ggml_type, permute, nbytes))
            done += nbytes
            progress(f"GGUF {gguf_type}: {done / 1e6:.0f} of {total / 1e6:.0f} MB")
        writer.close()
        partial.replace(out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return {"path": str(out), "bytes": out.stat().st_size, "gguf_type": gguf_type, "ran": plan["ran"]}

