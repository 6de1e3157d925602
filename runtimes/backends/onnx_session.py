"""ONNX Runtime plumbing of the ONNX Runtime backend (runtimes/backends/onnx.py) and the benchmarks:
the import, sessions, and the model dimensions read from the manifest. Imports numpy and onnxruntime only."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from speedc.format.artifact import Manifest
from speedc.errors import ArtifactError, SpeedcError
from speedc.runtimes.backends.protocol import resolve_threads


def onnxruntime_module():
    try:
        import onnxruntime
    except ImportError:
        raise SpeedcError("the ONNX Runtime backend needs onnxruntime: pip install onnxruntime") from None
    return onnxruntime


def bound_address(binding, name: str, array: np.ndarray, dtype) -> int:
    """The address to bind tensor NAME of BINDING (an ONNX Runtime IO binding) to ARRAY by raw pointer.

    ONNX Runtime then reads and writes that memory as a dense tensor of DTYPE and ARRAY's shape without
    knowing ARRAY: a strided view or another dtype would be misread (or written past its end), and an
    array freed while bound would have the next run write into freed memory. So ARRAY must be C-contiguous
    and of DTYPE, and BINDING keeps a reference to it (as ONNX Runtime's own bind_cpu_input does), by
    name: rebinding NAME releases the array bound before."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        raise SpeedcError(f"internal: {name} is bound by address but is not a C-contiguous array")
    if array.dtype != np.dtype(dtype):
        raise SpeedcError(f"internal: {name} is bound as {np.dtype(dtype)} but the array holds {array.dtype}")
    vars(binding).setdefault("speedc_bound_arrays", {})[name] = array
    return array.ctypes.data


def take_dimensions(backend, manifest: Manifest, phases: bool = False) -> None:
    """The sizes every ONNX Runtime backend reads from the manifest, as attributes of BACKEND. PHASES: the
    backend runs a depth plan's pipelined prelude / coda (the batch backend); others refuse such artifacts."""
    plan = manifest.schedule.get("depth_plan") or {}
    if not phases and manifest.slots > 1 and (plan.get("prelude") or plan.get("coda")):
        raise ArtifactError(f"this artifact pipelines a depth plan with a prelude / coda, which only the batch path "
                            f"runs (Engine.generate_batch / --prompts-file); the {getattr(backend, 'name', 'single-sequence')} "
                            "backend does not")
    model = manifest.model
    backend.slots, backend.stage_layers = manifest.slots, manifest.stage_layers
    backend.num_layers = model["num_layers"]
    backend.vocab_size, backend.max_context = model["vocab_size"], model["max_context"]
    backend.kv_heads, backend.head_dim, backend.hidden_size = model["num_kv_heads"], model["head_dim"], model["hidden_size"]


def session_options(threads: int | None):
    """The options every speedc session runs with (the benchmarks' weight floor too)."""
    ort = onnxruntime_module()
    options = ort.SessionOptions()
    options.intra_op_num_threads = resolve_threads(threads)
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # An engine runs several sessions (prefill, batch_step, ...), each with its own thread pool.
    # By default a pool's workers keep spinning after a run ends; on a 2-core machine the next
    # session's run then shares its cores with the last one's spinning workers (measured: a step
    # 35 ms instead of 16, a plain token 91 ms instead of 45). Spin during a run, stop at its end.
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def open_sessions(directory: Path, manifest: Manifest, names: tuple[str, ...], providers: list, threads: int | None,
                  profile_prefix: str | None = None) -> dict:
    """ONNX Runtime sessions for the artifact graphs in NAMES that it has (a plain engine has no batch step).
    PROFILE_PREFIX: ONNX Runtime profiles each session's runs into PROFILE_PREFIX<graph>_<time>.json."""
    ort = onnxruntime_module()
    options = session_options(threads)
    sessions = {}
    for name in names:
        spec = manifest.graphs.get(name)
        if spec is None:
            continue
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = f"{profile_prefix}{name}"
        try:
            session = ort.InferenceSession(str(directory / spec["file"]), options, providers=providers)
        except Exception as bad:  # ORT raises its own exception types
            raise ArtifactError(f"{directory / spec['file']}: ONNX Runtime cannot load it ({str(bad).splitlines()[0]})") from None
        check_session_io(directory, name, spec, session)
        sessions[name] = session
    return sessions


def check_session_io(directory: Path, name: str, spec: dict, session) -> None:
    """The graph file must take and return what the manifest records (which read_manifest checked
    against the contract): a file swapped or edited behind the manifest is refused by name."""
    for side, actual in (("input", session.get_inputs()), ("output", session.get_outputs())):
        recorded = {t["name"] for t in spec[f"{side}s"]}
        present = {t.name for t in actual}
        for missing in sorted(recorded - present):
            raise ArtifactError(f"{directory / spec['file']}: graph {name} has no {side} {missing} (the manifest records "
                                "one); rebuild the artifact")
        for extra in sorted(present - recorded):
            raise ArtifactError(f"{directory / spec['file']}: graph {name} has an {side} {extra} the manifest does not "
                                "record; rebuild the artifact")
