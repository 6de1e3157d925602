"""Peak resident memory of each benchmarked system, each measured in a fresh process.

A high-water mark is per process, so systems sharing one process would hide each other's peaks.
Each system therefore runs once in its own interpreter (`python -m speedc.bench.memory`): import
what it needs, load, generate, report VmHWM from /proc/self/status (the peak of this process's own
address space; ru_maxrss is not used because Linux carries the forking parent's peak across exec). The figure includes the interpreter and the
libraries the system imports (a deployment pays for those too): speedc's ONNX Runtime path imports
numpy, onnxruntime and tokenizers only; the peers import torch.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from speedc.errors import SpeedcError

PROBE_PROMPT = "ROMEO:\n"


def peak_rss_mb(system: str, artifact: Path, workdir: Path | None, new_tokens: int, threads: int | None,
                backend: str = "onnx", device: str = "cpu") -> float:
    """Peak RSS in MB of a fresh process that loads SYSTEM and generates NEW_TOKENS tokens."""
    command = [sys.executable, "-m", "speedc.bench.memory", system, str(artifact), str(workdir or ""), str(new_tokens),
               str(threads or 0), backend, device]
    probe = subprocess.run(command, capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpeedcError(f"peak-memory probe for {system} failed: {last}")
    return json.loads(probe.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def _probe(system: str, artifact: Path, workdir: Path, new_tokens: int, threads: int | None, backend: str,
           device: str) -> float:
    if system in ("speed", "autoregressive"):
        from speedc.runtimes.engine import Engine

        engine = Engine.load(artifact, backend=backend, device=device, threads=threads)
        engine.generate(PROBE_PROMPT, max_new_tokens=new_tokens, stop_at_eos=False, mode=system)
    else:
        from speedc.format.artifact import TOKENIZER, read_manifest
        from speedc.bench.peers import load_peer

        peer = load_peer(system, artifact, read_manifest(artifact), threads, workdir)
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(artifact / TOKENIZER)).encode(PROBE_PROMPT).ids
        peer(ids, new_tokens)
    return _peak_rss_kib() / 1024


def _peak_rss_kib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1])  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)


if __name__ == "__main__":
    name, artifact_dir, work, tokens, thread_count, backend_name, device_name = sys.argv[1:8]
    peak = _probe(name, Path(artifact_dir), Path(work) if work else None, int(tokens), int(thread_count) or None,
                  backend_name, device_name)
    print(json.dumps({"system": name, "peak_rss_mb": round(peak, 1)}))
