"""Peer systems for `speedc bench`, run on the same weights: the PyTorch reference decoder, and
Hugging Face transformers' LlamaForCausalLM.generate on the unrolled checkpoint (every layer stored).
Each peer is a function (prompt ids, new tokens) -> new ids; the bench times it end to end and checks
its ids against SPEED's before reporting any speed. Needs torch and transformers (the dev extra)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from speedc.errors import SpeedcError

Peer = Callable[[list[int], int], list[int]]


def peers_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def load_peers(directory: Path, manifest, threads: int | None) -> dict[str, Peer]:
    if not peers_available():
        raise SpeedcError("peer systems need torch and transformers: pip install 'speedc[dev]'")
    import torch
    from transformers import LlamaForCausalLM

    from speedc.models.checkpoint import save_unrolled_hf
    from speedc.models.generate import generate
    from speedc.runtimes.torch_backend import load_model_from_artifact

    torch.set_num_threads(threads or int(os.environ.get("SPEEDC_THREADS", 0)) or (os.cpu_count() or 1))
    model = load_model_from_artifact(directory, manifest)
    with tempfile.TemporaryDirectory() as tmp:
        hf = LlamaForCausalLM.from_pretrained(save_unrolled_hf(model, Path(tmp) / "hf"), torch_dtype=torch.float32).eval()

    def reference(prompt: list[int], new_tokens: int) -> list[int]:
        return generate(model, prompt, new_tokens)

    @torch.no_grad()
    def transformers_generate(prompt: list[int], new_tokens: int) -> list[int]:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    return {"pytorch-reference": reference, "transformers": transformers_generate}
