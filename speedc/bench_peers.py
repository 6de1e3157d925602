"""Peer systems for `speedc bench`, run on the same weights: the PyTorch reference decoder,
Hugging Face transformers' LlamaForCausalLM.generate on the unrolled checkpoint (every layer stored),
and, when onnxruntime-genai is installed (the `bench` extra), ONNX Runtime GenAI on a model its own
builder exported offline from that unrolled checkpoint.
Each peer is a function (prompt ids, new tokens) -> new ids; the bench times it end to end and checks
its ids against SPEED's before reporting any speed. Needs torch and transformers (the dev extra)."""

from __future__ import annotations

import os
import subprocess
import sys
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


def genai_peer(hf_dir: Path, out_dir: Path) -> tuple[Peer, int] | None:
    """Export with ORT GenAI's model builder (offline, from the local directory) and wrap its generator.
    Returns (peer, bytes of the exported weights), or None when onnxruntime-genai is not installed."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out_dir),
                            "-p", "fp32", "-e", "cpu"], capture_output=True, text=True)
    if built.returncode != 0:
        raise SpeedcError(f"ORT GenAI model builder failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}")
    model = og.Model(str(out_dir))
    stored = sum(p.stat().st_size for p in out_dir.glob("*.data"))

    def generate(prompt: list[int], new_tokens: int) -> list[int]:
        params = og.GeneratorParams(model)
        total = len(prompt) + new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False)  # min_length: no EOS stop
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        return list(generator.get_sequence(0))[len(prompt):]

    return generate, stored


def load_peers(directory: Path, manifest, threads: int | None, workdir: Path) -> tuple[dict[str, Peer], dict[str, int]]:
    """(peer functions by name, bytes of weights each peer's export stores where known)."""
    if not peers_available():
        raise SpeedcError("peer systems need torch and transformers: pip install 'speedc[dev]'")
    import torch
    from transformers import LlamaForCausalLM

    from speedc.models.checkpoint import save_unrolled_hf
    from speedc.models.generate import generate
    from speedc.runtimes.torch_backend import load_model_from_artifact

    torch.set_num_threads(threads or int(os.environ.get("SPEEDC_THREADS", 0)) or (os.cpu_count() or 1))
    model = load_model_from_artifact(directory, manifest)
    tokenizer = directory / "tokenizer.json"
    hf_dir = save_unrolled_hf(model, workdir / "hf", tokenizer_json=tokenizer.read_text() if tokenizer.exists() else None)
    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    genai = genai_peer(hf_dir, workdir / "genai") if tokenizer.exists() else None

    def reference(prompt: list[int], new_tokens: int) -> list[int]:
        return generate(model, prompt, new_tokens)

    @torch.no_grad()
    def transformers_generate(prompt: list[int], new_tokens: int) -> list[int]:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    peers = {"pytorch-reference": reference, "transformers": transformers_generate}
    weight_bytes = {}
    if genai is not None:
        peers["onnxruntime-genai"], weight_bytes["onnxruntime-genai"] = genai
    return peers, weight_bytes
