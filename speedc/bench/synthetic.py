"""Step cost on a memory-bound configuration: a random-weight model of the zoo shape but large
(hidden 1024 by default: unique fp32 weights far beyond a CPU's last-level cache), compiled at
each pipeline depth, then c(P) = (P-slot step time) / (plain token time / P), interleaved.

Random weights make acceptance meaningless, so these rows are step cost only, never end-to-end
speedups."""

from __future__ import annotations

import tempfile
from pathlib import Path

from speedc.bench.run import measure_step_cost


def synthetic_config(hidden: int, blocks: int, passes: int):
    from speedc.models.config import ModelConfig

    return ModelConfig.from_json_dict({
        "model_type": "llama", "tie_word_embeddings": True, "vocab_size": 4096, "hidden_size": hidden, "intermediate_size": 3 * hidden,
        "num_hidden_layers": blocks * passes, "num_attention_heads": max(hidden // 64, 1),
        "num_key_value_heads": max(hidden // 256, 1), "max_position_embeddings": 1024,
        "speedc": {"layer_map": {"pattern": "cycle", "num_blocks": blocks}, "exit": {"layer": blocks, "norm": "own"}},
    })


def random_model(hidden: int, blocks: int, passes: int, residual_scale: float = 1.0, seed: int = 0):
    """Random-weight shared model of the zoo shape (cycle map, exit after the first pass): weights
    N(0, 0.02), norms 1. RESIDUAL_SCALE < 1 shrinks what each block adds (o_proj, down_proj), so the
    early exit agrees with the final head often (the GPU check's end-to-end timing needs that)."""
    import torch

    from speedc.models.llama import SharedLlama

    torch.manual_seed(seed)
    model = SharedLlama(synthetic_config(hidden, blocks, passes))
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
                         threads: int | None = None, repeats: int = 100, backend: str = "onnx") -> dict:
    from speedc.build import build
    from speedc.models.checkpoint import save_checkpoint
    from speedc.models.layer_map import valid_slot_counts
    from speedc.passes.base import BuildOptions
    from speedc.runtimes.engine import Engine

    model = random_model(hidden, blocks, passes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(model, Path(tmp) / "ckpt")
        unique_bytes = sum(p.numel() * 4 for p in model.parameters())
        for slots in [p for p in valid_slot_counts(model.cfg.layer_map, model.cfg.exit_layer) if p in (2, 4, 8)]:
            art = build(checkpoint, Path(tmp) / f"p{slots}", BuildOptions(slots=slots), force=True).out
            engine = Engine.load(art, backend=backend, threads=threads, verify=False)
            rows.append({"slots": slots, "step_cost": round(measure_step_cost(engine, context, repeats), 3)})
    return {"label": "step cost only (random weights)", "backend": backend, "hidden": hidden, "blocks": blocks, "passes": passes,
            "unique_weight_mb": round(unique_bytes / 1e6, 1), "context": context, "rows": rows}
