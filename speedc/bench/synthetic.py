"""Step cost on a memory-bound configuration: a random-weight model, compiled at each pipeline
depth, then c(P) = (P-slot step time) / (plain token time / P), interleaved.

Shapes (`--shape`): the zoo family made large (hidden 1024 by default: unique fp32 weights far beyond
a CPU's last-level cache), or the real layer shapes of the looped checkpoints (Ouro-1.4B / 2.6B,
Nanbeige4.2-3B: their widths, heads, MLP, vocabulary, loop count, block and loop norms). This
version's build holds the model in fp32 and traces it through torch.onnx.export, whose protobuf
stops at 2 GiB, so a real shape runs with as many of its layers as fit (said in the report); a shape
whose embedding and LM head alone do not fit is refused.

Random weights make acceptance meaningless, so these rows are step cost only, never end-to-end
speedups."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from speedc.bench.run import measure_step_cost
from speedc.errors import SpeedcError



@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int  # unique blocks (a looped model's layers)
    loops: int  # passes over them (P)
    looped: bool  # loop-boundary norm, heads read the loop-normed state (Ouro, Nanbeige)
    sandwich_norms: bool = False
    tied: bool = False

    def block_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate + (4 if self.sandwich_norms else 2) * self.hidden

    def fixed_params(self) -> int:  # embedding, LM head, norms
        return self.vocab * self.hidden * (1 if self.tied else 2) + 2 * self.hidden


SHAPES = {
    "ouro-1.4b": Shape("ouro-1.4b", 2048, 16, 16, 128, 5632, 49152, 24, 4, looped=True, sandwich_norms=True),
    "ouro-2.6b": Shape("ouro-2.6b", 2048, 16, 16, 128, 5632, 49152, 48, 4, looped=True, sandwich_norms=True),
    "nanbeige-3b": Shape("nanbeige-3b", 3072, 48, 8, 128, 10752, 166144, 22, 2, looped=True),
}


def zoo_shape(hidden: int, blocks: int = 4, passes: int = 4) -> Shape:
    """The zoo family made large: cycle of BLOCKS blocks, PASSES passes, exit after the first."""
    heads = max(hidden // 64, 1)
    return Shape(f"zoo-{hidden}", hidden, heads, max(hidden // 256, 1), hidden // heads, 3 * hidden, 4096, blocks, passes,
                 looped=False, tied=True)


def layers_that_fit(shape: Shape, requested: int | None = None) -> int:
    """The requested layer count (default: the real one), cut to what the in-memory trace holds."""
    from speedc.build import TRACE_LIMIT_BYTES  # the compiler's limit (importing it loads the compiler)

    want = min(requested or shape.layers, shape.layers)
    room = TRACE_LIMIT_BYTES // 4 - shape.fixed_params()
    fit = room // shape.block_params() if room > 0 else 0
    if fit < 1:
        raise SpeedcError(f"--shape {shape.name}: its embedding and LM head alone are "
                          f"{4 * shape.fixed_params() / 1e9:.1f} GB of fp32 weights, past what this build can trace "
                          "(2 GiB): real-size builds need the streaming build, not in this version")
    return int(min(want, fit))


def shape_config(shape: Shape, layers: int):
    """ModelConfig of SHAPE with LAYERS unique blocks looped shape.loops times."""
    from speedc.models.config import ModelConfig
    from speedc.models.layer_map import cycle_map

    n = layers * shape.loops
    return ModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=n, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       layer_map=cycle_map(n, layers), exit_layer=layers, head_dim=shape.head_dim,
                       exit_norm="none" if shape.looped else "own", max_position_embeddings=1024,
                       tie_word_embeddings=shape.tied, sandwich_norms=shape.sandwich_norms, loop_norm=shape.looped,
                       final_norm=not shape.looped,
                       architecture=shape.name.split("-")[0] if shape.looped else "llama")


def synthetic_config(hidden: int, blocks: int, passes: int):
    return shape_config(zoo_shape(hidden, blocks, passes), blocks)


def random_model(hidden: int, blocks: int, passes: int, residual_scale: float = 1.0, seed: int = 0):
    """Random-weight shared model of the zoo shape (cycle map, exit after the first pass)."""
    return random_model_of(synthetic_config(hidden, blocks, passes), residual_scale, seed)


def random_model_of(cfg, residual_scale: float = 1.0, seed: int = 0):
    """Random weights N(0, 0.02), norms 1. RESIDUAL_SCALE < 1 shrinks what each block adds (o_proj,
    down_proj), so the early exit agrees with the final head often (end-to-end timings need that)."""
    import torch

    from speedc.models.llama import SharedLlama

    torch.manual_seed(seed)
    model = SharedLlama(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
                if residual_scale != 1.0 and name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(residual_scale)
    return model.eval()


def synthetic_step_costs(*, hidden: int = 1024, blocks: int = 4, passes: int = 4, context: int = 512,
                         threads: int | None = None, repeats: int = 100, backend: str = "onnx",
                         shape: Shape | None = None, layers: int | None = None, progress=lambda message: None) -> dict:
    """c(P) rows for SHAPE (default: the zoo shape at HIDDEN) at every valid depth in (2, 4, 8)."""
    from speedc.build import build
    from speedc.models.checkpoint import save_checkpoint
    from speedc.models.layer_map import valid_slot_counts
    from speedc.passes.base import BuildOptions
    from speedc.runtimes.engine import Engine

    shape = shape or zoo_shape(hidden, blocks, passes)
    used = layers_that_fit(shape, layers) if shape.looped else shape.layers
    progress(f"{shape.name}: random weights, {used} of {shape.layers} layers x {shape.loops} loops")
    cfg = shape_config(shape, used)
    model = random_model_of(cfg)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(model, Path(tmp) / "ckpt")
        unique_bytes = sum(p.numel() * 4 for p in model.parameters())
        del model  # the build reads the checkpoint; keep one copy of the weights in memory, not two
        for slots in [p for p in valid_slot_counts(cfg.layer_map, cfg.exit_layer) if p in (2, 4, 8)]:
            progress(f"{shape.name}: compiling P={slots} and measuring")
            art = build(checkpoint, Path(tmp) / f"p{slots}", BuildOptions(slots=slots, dtype="fp32"), force=True).out
            engine = Engine.load(art, backend=backend, threads=threads, verify=False)
            rows.append({"slots": slots, "step_cost": round(measure_step_cost(engine, context, repeats), 3)})
            del engine
    note = "" if used == shape.layers else (f"{used} of the real {shape.layers} layers (this build traces at most 2 GiB "
                                            "of fp32 weights); the embedding and LM head are full size")
    return {"label": "step cost only (random weights)", "backend": backend, "shape": shape.name, "hidden": shape.hidden,
            "blocks": used, "passes": shape.loops, "real_layers": shape.layers, "note": note,
            "unique_weight_mb": round(unique_bytes / 1e6, 1), "context": context, "rows": rows}
