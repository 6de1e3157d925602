"""Peer systems for `speedc bench`: the PyTorch reference decoder, Hugging Face transformers'
LlamaForCausalLM.generate on the unrolled checkpoint (every layer stored), and, when onnxruntime-genai
is installed (the `bench` extra), ONNX Runtime GenAI on exports its own model builder made offline
from that unrolled checkpoint: one at fp32 and one at int4 (MatMulNBits, block 32, accuracy level 4:
int8 dot products; the precision the builder recommends for CPU, what a CPU user would run).

Each peer is a function (prompt ids, new tokens) -> new ids, timed end to end. What the bench does
with its ids depends on what it computes with (PEERS below):
  same weights     fp32 arithmetic on exactly the values the artifact computes with (a float artifact:
                   fp16/bf16 storage widens to fp32 exactly). Its ids must equal SPEED's: any difference
                   refuses the report (a lossless guard, as for speed vs autoregressive).
  other precision  the GenAI int4 export (the builder re-quantizes), or any fp32 peer on a block-quantized
                   artifact (it runs the dequantized values in fp32; the artifact's MatMulNBits runs int8
                   dot products). Its ids are compared, not required equal: agreement is reported.
Loading and exporting need torch and transformers (the dev extra); running a GenAI export does not."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from speedc.errors import SpeedcError

Peer = Callable[[list[int], int], list[int]]


@dataclass(frozen=True)
class PeerSpec:
    """One peer system: how it is loaded and what arithmetic it runs."""
    name: str
    load: Callable[..., Peer]  # (spec, artifact dir, manifest, workdir, threads) -> its generate function
    precision: str = "fp32"  # what it computes with: "fp32" on the artifact's weight values, or its own re-quantization
    genai_options: tuple[str, ...] = ()  # for GenAI exports: the builder's --extra_options

    def same_weights(self, manifest) -> bool:
        """True when the peer computes with the artifact's own numbers, so its ids must equal SPEED's."""
        from speedc.format.artifact import is_quantized

        return self.precision == "fp32" and not is_quantized(manifest)

    def export_dir(self, workdir: Path) -> Path:
        return workdir / self.name


@dataclass(frozen=True)
class LoadedPeer:
    """What run_bench times: the generate function, and whether its ids must equal SPEED's."""
    generate: Peer
    must_match: bool


def peers_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def genai_installed() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


LLAMA_CPP_INSTALL = ("pip install 'speedc[peers]' (llama-cpp-python has no wheels on the registry: "
                     "its install compiles llama.cpp, 4-25 minutes on 2 cores)")


def llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class PeerFailed(SpeedcError):
    """A peer's process crashed, hung or answered nonsense: its row says so and the bench goes on."""


PEER_ANSWER_SECONDS = 900  # one prompt's answer at most (a 1-4 B model's 128 tokens on 2 cores: about a minute)


def process_peer(driver: str, args: list[str], *, answer_seconds: float = PEER_ANSWER_SECONDS) -> "PeerProcess":
    """A peer run in a process of its own: DRIVER (Python source) loads the model from ARGS and then
    answers one JSON line {"ids", "seconds"} per JSON line {"prompt", "new_tokens"} it reads. Returns
    generate(prompt ids, new tokens) -> (ids, decode seconds per token), with .close(); a crash
    (signal or exit), a hang (no answer in ANSWER_SECONDS) or a malformed answer raises PeerFailed and
    ends the process, never the bench."""
    return PeerProcess(driver, args, answer_seconds)


class PeerProcess:
    """process_peer's generate: the peer's process, asked one prompt at a time."""

    def __init__(self, driver: str, args: list[str], answer_seconds: float) -> None:
        import tempfile

        self.answer_seconds = answer_seconds
        self.said = tempfile.TemporaryFile("w+")  # its standard error: a file, so a chatty peer never blocks on a full pipe
        self.child = subprocess.Popen([sys.executable, "-c", driver, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self.said, text=True, bufsize=1)
        self.ended: list[str] = []  # why the peer failed: once failed it is asked no more

    def __call__(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
        import select

        child = self.child
        if self.ended:
            raise PeerFailed(self.ended[0])
        if child.poll() is not None:
            raise self._fail(self._why_ended())
        try:
            child.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n")
            child.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail(self._why_ended()) from None
        ready, _, _ = select.select([child.stdout], [], [], self.answer_seconds)
        if not ready:
            raise self._fail(f"hung: no answer in {self.answer_seconds:.0f} s")
        line = child.stdout.readline()
        if not line:
            raise self._fail(self._why_ended())
        try:
            answer = json.loads(line)
            return [int(i) for i in answer["ids"]], float(answer["seconds"])
        except (ValueError, KeyError, TypeError):
            raise self._fail(f"answered {line.strip()[:80]!r}") from None

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.kill()
        self.child.wait()
        for stream in (self.child.stdin, self.child.stdout, self.said):
            stream.close()

    def _why_ended(self) -> str:
        import signal

        code = self.child.wait()
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            return f"crashed ({name})"
        self.said.seek(0)
        last = (self.said.read().strip().splitlines() or [""])[-1]
        return f"exited with status {code}" + (f": {last[:200]}" if last else "")

    def _fail(self, why: str) -> PeerFailed:
        if self.child.poll() is None:
            self.child.kill()
        self.child.wait()
        self.ended.append(why)
        return PeerFailed(why)


# llama.cpp's side of process_peer: greedy decoding, the prompt in one batch, then one token a call (as
# speedc's plain decoding runs); logits_all: llama-cpp-python keeps `scores` only then (without it they
# stay zeros), the extra cost is the prompt's logits, outside the timed decode.
_LLAMA_CPP_DRIVER = """
import json, sys, time
import llama_cpp, numpy as np
gguf, threads, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = llama_cpp.Llama(model_path=gguf, n_ctx=context, n_batch=min(512, context), n_threads=threads,
                        n_threads_batch=threads, logits_all=True, verbose=False)
for line in sys.stdin:
    ask = json.loads(line)
    model.reset()
    model.eval(ask["prompt"])
    ids = [int(np.argmax(model.scores[model.n_tokens - 1]))]
    start = time.perf_counter()
    while len(ids) < ask["new_tokens"]:
        model.eval([ids[-1]])
        ids.append(int(np.argmax(model.scores[model.n_tokens - 1])))
    print(json.dumps({"ids": ids, "seconds": (time.perf_counter() - start) / max(1, ask["new_tokens"] - 1)}), flush=True)
"""


def llama_cpp_peer(gguf: Path, threads: int | None, context: int):
    """llama.cpp (through llama-cpp-python) decoding greedily on GGUF file GGUF (speedc/bench/gguf_export.py),
    in a process of its own (process_peer: a crash of llama.cpp's CPU backend fails its row, not the bench).
    Returns generate(prompt ids, new tokens) -> (new ids, decode seconds per token after the first)."""
    from speedc.runtimes.backends.protocol import resolve_threads

    return process_peer(_LLAMA_CPP_DRIVER, [str(gguf), str(resolve_threads(threads)), str(context)])


# The builder's command line, run once per export in ONE interpreter: its imports (torch, transformers,
# onnx: about 7 s of CPU) are paid once for both exports, not once each.
_BUILDER_DRIVER = """
import json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv = ["onnxruntime_genai.models.builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""


def genai_export(hf_dir: Path, specs: list[PeerSpec], workdir: Path) -> None:
    """Export the unrolled checkpoint with ORT GenAI's model builder (offline, from the local directory),
    once per spec, at the spec's precision and options, for the CPU execution provider."""
    runs = [["-i", str(hf_dir), "-o", str(spec.export_dir(workdir)), "-p", spec.precision, "-e", "cpu",
             "-c", str(workdir / "builder-cache"), *(["--extra_options", *spec.genai_options] if spec.genai_options else [])]
            for spec in specs]
    built = subprocess.run([sys.executable, "-c", _BUILDER_DRIVER, json.dumps(runs)], capture_output=True, text=True)
    if built.returncode != 0:
        raise SpeedcError(f"ORT GenAI model builder failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}")


def _genai_config(model_dir: Path, threads: int | None, overlay: dict | None = None):
    """ORT GenAI's config of an export, with speedc's intra-op thread count (the builder's config leaves
    ORT's default, every core) and OVERLAY merged in."""
    import onnxruntime_genai as og

    from speedc.runtimes.backends.protocol import resolve_threads

    config = og.Config(str(model_dir))
    config.overlay(json.dumps({**(overlay or {}),
                               "model": {"decoder": {"session_options": {"intra_op_num_threads": resolve_threads(threads)}}}}))
    return config


def genai_peer(model_dir: Path, threads: int | None) -> Peer:
    """ONNX Runtime GenAI's greedy generator on an export of its model builder. Imports no torch."""
    import onnxruntime_genai as og

    model = og.Model(_genai_config(model_dir, threads))

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
    import time

    import numpy as np
    import onnxruntime_genai as og

    config = _genai_config(model_dir, threads, {"engine": {"static_batching": {"max_batch_size": max_batch}}})
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


def _set_threads(threads: int | None) -> None:
    import torch

    from speedc.runtimes.backends.protocol import resolve_threads

    torch.set_num_threads(resolve_threads(threads))


def _load_reference(spec: PeerSpec, directory: Path, manifest, workdir: Path, threads: int | None) -> Peer:
    from speedc.models.generate import generate
    from speedc.runtimes.backends.torch_backend import load_model_from_artifact

    _set_threads(threads)
    model = load_model_from_artifact(directory, manifest)
    return lambda prompt, new_tokens: generate(model, prompt, new_tokens)


def _load_transformers(spec: PeerSpec, directory: Path, manifest, workdir: Path, threads: int | None) -> Peer:
    import torch
    from transformers import LlamaForCausalLM

    _set_threads(threads)
    hf = LlamaForCausalLM.from_pretrained(workdir / "hf", torch_dtype=torch.float32).eval()

    @torch.no_grad()
    def transformers_generate(prompt: list[int], new_tokens: int) -> list[int]:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    return transformers_generate


def _load_genai(spec: PeerSpec, directory: Path, manifest, workdir: Path, threads: int | None) -> Peer:
    return genai_peer(spec.export_dir(workdir), threads)


# Accuracy level 4 and block 32 are the builder's CPU defaults; named so the export says what it is.
GENAI_INT4_OPTIONS = ("accuracy_level=4", "block_size=32")

PEERS: dict[str, PeerSpec] = {spec.name: spec for spec in (
    PeerSpec("pytorch-reference", _load_reference),
    PeerSpec("transformers", _load_transformers),
    PeerSpec("onnxruntime-genai", _load_genai),
    PeerSpec("onnxruntime-genai-int4", _load_genai, precision="int4", genai_options=GENAI_INT4_OPTIONS),
)}
PEER_NAMES = tuple(PEERS)
GENAI_PEERS = ("onnxruntime-genai", "onnxruntime-genai-int4")


def prepare_peers(directory: Path, manifest, threads: int | None, workdir: Path,
                  only: tuple[str, ...] | None = None) -> dict[str, int]:
    """Write what the peers load into WORKDIR: the unrolled HF checkpoint and, when onnxruntime-genai
    is installed, its builder's exports (of the GenAI peers in ONLY, default all). Returns the bytes of
    weights each peer's export stores."""
    if not peers_available():
        raise SpeedcError("peer systems need torch and transformers: pip install 'speedc[dev]'")
    from speedc.format.artifact import TOKENIZER
    from speedc.models.checkpoint.torch_io import save_unrolled_hf
    from speedc.runtimes.backends.torch_backend import load_model_from_artifact

    _set_threads(threads)
    if manifest.dims.architecture != "llama":
        return {}  # an unrolled Llama export cannot express a looped family's loop norm / sandwich norms
    tokenizer = directory / TOKENIZER
    hf_dir = save_unrolled_hf(load_model_from_artifact(directory, manifest), workdir / "hf",
                              tokenizer_json=tokenizer.read_text() if tokenizer.exists() else None)
    weight_bytes = {"transformers": sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))}
    if tokenizer.exists() and genai_installed():
        genai = [PEERS[name] for name in GENAI_PEERS if only is None or name in only]
        if genai:
            genai_export(hf_dir, genai, workdir)
        for spec in genai:
            weight_bytes[spec.name] = sum(p.stat().st_size for p in spec.export_dir(workdir).glob("*.data"))
    return weight_bytes


def load_peer(name: str, directory: Path, manifest, threads: int | None, workdir: Path) -> Peer:
    """One peer's generate function, from the artifact (pytorch-reference) or from what prepare_peers wrote."""
    if name not in PEERS:
        raise SpeedcError(f"unknown peer {name!r} (known: {', '.join(PEER_NAMES)})")
    spec = PEERS[name]
    return spec.load(spec, directory, manifest, workdir, threads)


def load_peers(directory: Path, manifest, threads: int | None, workdir: Path,
               only: tuple[str, ...] | None = None) -> tuple[dict[str, LoadedPeer], dict[str, int]]:
    """(peers by name, each with whether its ids must equal SPEED's; bytes of weights each peer's export
    stores). ONLY: these peers (default: every one this installation can run)."""
    weight_bytes = prepare_peers(directory, manifest, threads, workdir, only)
    peers = {name: LoadedPeer(load_peer(name, directory, manifest, threads, workdir), spec.same_weights(manifest))
             for name, spec in PEERS.items() if (name == "pytorch-reference" or name in weight_bytes)
             and (only is None or name in only)}
    return peers, weight_bytes
