"""Peer systems for `speedc bench`, run on the same weights: the PyTorch reference decoder,
Hugging Face transformers' LlamaForCausalLM.generate on the unrolled checkpoint (every layer stored),
and, when onnxruntime-genai is installed (the `bench` extra), ONNX Runtime GenAI on a model its own
builder exported offline from that unrolled checkpoint.
Each peer is a function (prompt ids, new tokens) -> new ids; the bench times it end to end and checks
its ids against SPEED's before reporting any speed. Needs torch and transformers (the dev extra)."""

from __future__ import annotations

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


def genai_export(hf_dir: Path, out_dir: Path) -> bool:
    """Export with ORT GenAI's model builder (offline, from the local directory); False when
    onnxruntime-genai is not installed."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out_dir),
                            "-p", "fp32", "-e", "cpu"], capture_output=True, text=True)
    if built.returncode != 0:
        raise SpeedcError(f"ORT GenAI model builder failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}")
    return True


def genai_peer(model_dir: Path) -> Peer:
    """ONNX Runtime GenAI's greedy generator on an export of its model builder."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))

    def generate(prompt: list[int], new_tokens: int) -> list[int]:
        params = og.GeneratorParams(model)
        total = len(prompt) + new_tokens
        params.set_search_options(max_length=total, min_length=total, do_sample=False)  # min_length: no EOS stop
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        return list(generator.get_sequence(0))[len(prompt):]

    return generate


def genai_batched(model_dir: Path, max_batch: int, threads: int | None):
    """ONNX Runtime GenAI's own batching (its Python og.Engine: requests, turns, one run() per step) on an
    export of its model builder. Returns run(prompts ids, new tokens) -> (new ids per prompt, [(first,
    last) token times per prompt], graph runs, most sequences one run advanced). Greedy, no EOS stop.

    Its static batching scheduler is the one this export can use: dynamic batching wants a paged KV
    cache, which the builder's fp32 CPU export does not have."""
    import json
    import time

    import numpy as np
    import onnxruntime_genai as og

    from speedc.runtimes.backend import resolve_threads

    config = og.Config(str(model_dir))
    config.overlay(json.dumps({"engine": {"static_batching": {"max_batch_size": max_batch}},
                               "model": {"decoder": {"session_options": {"intra_op_num_threads": resolve_threads(threads)}}}}))
    engine = og.Engine(og.Model(config))
    buffer = engine.create_event_buffer(4 * max_batch)
    token_flag = int(og.EngineEventFlags.TOKEN.value)

    def run(prompts: list[list[int]], new_tokens: int):
        requests = []
        for prompt in prompts:
            request = engine.create_request()
            turn = og.TurnOptions(request)
            turn.set_do_sample(False)
            turn.set_max_generated_tokens(new_tokens)
            turn.set_min_generated_tokens(new_tokens)  # no EOS stop, as the other systems
            request.begin_turn(np.asarray(prompt, np.int32), turn)
            requests.append(request)
        index = {id(r): i for i, r in enumerate(requests)}
        ids: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        runs = widest = 0
        while engine.has_pending_requests():
            events = [e for e in engine.run(buffer) if int(e.flags.value) & token_flag]
            now = time.perf_counter()
            runs += 1
            widest = max(widest, len(events))
            for event in events:
                i = index[id(event.request)]
                ids[i].append(int(event.token))
                times[i] = [times[i][0] if times[i] else now, now]
        for request in requests:
            request.close()
        return ids, times, runs, widest

    return run


PEER_NAMES = ("pytorch-reference", "transformers", "onnxruntime-genai")


def prepare_peers(directory: Path, manifest, threads: int | None, workdir: Path) -> dict[str, int]:
    """Write what the peers load into WORKDIR: the unrolled HF checkpoint and, when onnxruntime-genai
    is installed, its builder's export. Returns the bytes of weights each peer's export stores."""
    if not peers_available():
        raise SpeedcError("peer systems need torch and transformers: pip install 'speedc[dev]'")
    from speedc.artifact import TOKENIZER
    from speedc.models.checkpoint import save_unrolled_hf
    from speedc.runtimes.torch_backend import load_model_from_artifact

    _set_threads(threads)
    if manifest.model.get("architecture", "llama") != "llama":
        return {}  # an unrolled Llama export cannot express a looped family's loop norm / sandwich norms
    tokenizer = directory / TOKENIZER
    hf_dir = save_unrolled_hf(load_model_from_artifact(directory, manifest), workdir / "hf",
                              tokenizer_json=tokenizer.read_text() if tokenizer.exists() else None)
    weight_bytes = {"transformers": sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))}
    if tokenizer.exists() and genai_export(hf_dir, workdir / "genai"):
        weight_bytes["onnxruntime-genai"] = sum(p.stat().st_size for p in (workdir / "genai").glob("*.data"))
    return weight_bytes


def _set_threads(threads: int | None) -> None:
    import torch

    from speedc.runtimes.backend import resolve_threads

    torch.set_num_threads(resolve_threads(threads))


def load_peer(name: str, directory: Path, manifest, threads: int | None, workdir: Path) -> Peer:
    """One peer, from the artifact (pytorch-reference) or from what prepare_peers wrote."""
    import torch

    _set_threads(threads)
    if name == "pytorch-reference":
        from speedc.models.generate import generate
        from speedc.runtimes.torch_backend import load_model_from_artifact

        model = load_model_from_artifact(directory, manifest)
        return lambda prompt, new_tokens: generate(model, prompt, new_tokens)
    if name == "transformers":
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(workdir / "hf", torch_dtype=torch.float32).eval()

        @torch.no_grad()
        def transformers_generate(prompt: list[int], new_tokens: int) -> list[int]:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
            return out[0, len(prompt):].tolist()

        return transformers_generate
    if name == "onnxruntime-genai":
        return genai_peer(workdir / "genai")
    raise SpeedcError(f"unknown peer {name!r} (known: {', '.join(PEER_NAMES)})")


def load_peers(directory: Path, manifest, threads: int | None, workdir: Path) -> tuple[dict[str, Peer], dict[str, int]]:
    """(peer functions by name, bytes of weights each peer's export stores)."""
    weight_bytes = prepare_peers(directory, manifest, threads, workdir)
    peers = {name: load_peer(name, directory, manifest, threads, workdir)
             for name in PEER_NAMES if name == "pytorch-reference" or name in weight_bytes}
    return peers, weight_bytes
