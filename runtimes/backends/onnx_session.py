"""ONNX Runtime plumbing of the ONNX Runtime backend (runtimes/backends/onnx.py) and the benchmarks:
the import, sessions, and the model dimensions read from the manifest. Imports numpy and onnxruntime only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from speedc.format import contract
from speedc.format.artifact import Manifest, is_quantized, native_io
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


def session_options(threads: int | None, *, spin_between_runs: bool):
    """The options every speedc session runs with (the benchmarks' weight floor too).

    SPIN_BETWEEN_RUNS: whether the session's workers keep spinning after a run ends (ONNX Runtime's
    default), ready for the next one. That pays where one session runs back to back, as an engine's
    does (it opens one session per process): zoo:small's SPEED step 3.70 ms instead of 4.05. Where
    sessions alternate (the benchmarks' weight floor, two sessions run in turns), the next session would
    share a 2-core machine with the last one's spinning workers (measured: a step 35 ms instead of 16),
    so those stop spinning at the end of each run."""
    ort = onnxruntime_module()
    options = ort.SessionOptions()
    options.intra_op_num_threads = resolve_threads(threads)
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if not spin_between_runs:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def open_session(directory: Path, manifest: Manifest, name: str, providers: list, threads: int | None,
                 profile_prefix: str | None = None):
    """The ONNX Runtime session of artifact graph NAME (ArtifactError when the artifact lacks it), its
    workers spinning between runs (the one session an engine runs, see session_options).
    PROFILE_PREFIX: ONNX Runtime profiles its runs into PROFILE_PREFIX<graph>_<time>.json.

    Where the graph has a native twin (an int8/int4 or 16-bit artifact, passes/native_products.py), its products
    are large enough to pay for the operator (_native_products) and speedc's kernel loads, the session
    runs the twin: its products on the kernel (with THREADS threads of its own), the weights read from
    weights.bin in place. Otherwise it runs the graph's own products; where the kernel was wanted but
    cannot load, it says why once per process on standard error. `session.speedc_products` says which."""
    ort = onnxruntime_module()
    spec = manifest.graphs.get(name)
    if spec is None:
        raise ArtifactError(f"{directory}: has no {name} graph; rebuild it with this speedc "
                            "(speedc build CHECKPOINT -o OUT --force)")
    options = session_options(threads, spin_between_runs=True)
    file, weight_map, products = spec["file"], None, fallback_products(manifest) if "native_file" in spec else "ONNX Runtime"
    native_cache = None  # the KV pool's dtype where the twin attends over the runtime's own pool
    if "native_file" in spec:
        weight_map, products = _native_products(directory, manifest, threads, options)
        if weight_map is not None:
            file, native_cache = spec["native_file"], spec.get(contract.NATIVE_CACHE)
            spec = {**spec, **native_io(spec, native_cache)}
    if native_cache is not None:
        # Products and attention run on the kernel's threads, so ONNX Runtime keeps the rest (norms, activations,
        # the heads' argmax) on the calling thread: its sleeping workers cost a wake-up wherever it split an op of
        # a few rows (a norm of [4, 2048] 29 us on two threads, 12 on one). A P = 4 step of Ouro-1.4B ran 5%
        # faster, a plain token 1.5%, a 128-token prefill chunk and a 32-row step alike (docs/benchmarks.md,
        # "ONNX Runtime's own ops on one thread").
        options.intra_op_num_threads = 1
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = f"{profile_prefix}{name}"
    try:
        session = ort.InferenceSession(str(directory / file), options, providers=providers,
                                       disabled_optimizers=_disabled_optimizers(manifest))
    except Exception as bad:  # ORT raises its own exception types
        raise ArtifactError(f"{directory / file}: ONNX Runtime cannot load it ({str(bad).splitlines()[0]})") from None
    check_session_io(directory, name, {**spec, "file": file}, session)
    session.speedc_products = products  # what runs the weight products (inspect, stats, bench)
    session.speedc_weight_map = weight_map  # keeps the native products' weights registered while the session lives
    session.speedc_native_cache = native_cache  # the twin attends over a pool the runtime binds (WeightMap.caches_bound)
    session.speedc_io = spec  # what the file it runs takes and returns
    return session


def _disabled_optimizers(manifest: Manifest) -> list[str]:
    """ONNX Runtime graph rewrites a session must not apply to this artifact's graphs. A cross-repeat layer
    (IQuest-Coder-V1-Loop) scores q against two caches, and whether ORT folds a key's Transpose into the
    MatMul (FusedMatMul, transB) depends on how many nodes read that Transpose: plain decoding's chunk keys
    feed both attentions, a step's do not, so one program got FusedMatMul and the other MatMul, and their
    sums rounded apart (logits 1e-6 apart in fp32; at int4 the activations' int8 rounding made that 1e-2,
    and a greedy id differed). Without the rewrite both run MatMul on the same terms: bit-identical."""
    return ["MatmulTransposeFusion"] if manifest.depth_plan.cross_window else []


_said_unavailable = False
# The native operator costs 15-20 us a call in Python around the kernel: worth it where products are
# large, not on small models (zoo:small int4: SPEED 5.3 ms/token native against 3.3 on MatMulNBits, its
# products ~0.1 MB; Ouro-1.4B's shape, 6 MB on average: native plain decoding 14% faster, same step).
NATIVE_MIN_MEAN_PRODUCT_BYTES = 4 << 20


def mean_product_bytes(manifest: Manifest) -> float:
    """Mean stored bytes per weight product of the artifact: the codes of each block-quantized weight, or
    each 16-bit matrix (0 where it has none)."""
    sizes = [e["length"] for e in manifest.store.index.values() if "within" not in e
             and (e.get("quantized", {}).get("role") == "codes"
                  or (e.get("dtype") in ("bfloat16", "float16") and len(e.get("shape", ())) == 2))]
    return sum(sizes) / len(sizes) if sizes else 0.0


def fallback_products(manifest: Manifest) -> str:
    """What runs a native twin's products where the twin does not run: the engine graph's own."""
    return "MatMulNBits" if is_quantized(manifest) else "ONNX Runtime (fp32 copies of the 16-bit weights)"


def _native_products(directory: Path, manifest: Manifest, threads: int | None, options):
    """(the weights registration, "speedc kernel (PATH)") where the native twin runs, with OPTIONS set
    for it; else (None, "FALLBACK (why)", FALLBACK from fallback_products). SPEEDC_NATIVE_KERNEL: unset,
    the twin where the kernel loads and the products are large enough to pay for the operator's per-call
    cost; 1 wherever it loads; a kernel path's name (portable, avx2, avx-vnni, avx512-vnni, amx, dotprod, i8mm,
    avx-vnni-standin, amx-standin) that path wherever this CPU runs it; 0 never."""
    global _said_unavailable
    from speedc.runtimes.kernels import ort_op

    setting = os.environ.get("SPEEDC_NATIVE_KERNEL", "").strip()
    fallback = fallback_products(manifest)
    if setting == "0":
        return None, f"{fallback} (SPEEDC_NATIVE_KERNEL=0)"
    if not setting and mean_product_bytes(manifest) < NATIVE_MIN_MEAN_PRODUCT_BYTES:
        return None, (f"{fallback} (products of {mean_product_bytes(manifest) / 1e6:.2f} MB on average: below "
                      f"{NATIVE_MIN_MEAN_PRODUCT_BYTES >> 20} MiB the native operator's per-call cost outweighs it)")
    library = ort_op.custom_ops_library()
    path, why = ort_op.choose_path(setting) if library is not None else (None, ort_op.unavailable_reason())
    if path is None:
        if not _said_unavailable:
            _said_unavailable = True
            print(f"speedc: the native product kernel is unavailable ({why}); products run on {fallback}",
                  file=sys.stderr)
        return None, f"{fallback} ({why})"
    options.register_custom_ops_library(library)
    kernel_threads = resolve_threads(threads)
    # ONNX Runtime's workers sleep between its ops instead of spinning: during a product the kernel's own
    # threads have the cores (spinning workers made a product 1.5-1.9x slower, measured)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    store = manifest.store
    weight_map = ort_op.register_weights(store.native_artifact, directory / store.file, store.index, kernel_threads,
                                         path)
    return weight_map, f"speedc kernel ({path}, {kernel_threads} threads)"


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


class ProgramSession:
    """One program (prefill, or the batch step) of an engine graph's session (speedc/format/contract.py):
    every binding and run also feeds the branch selector and a small placeholder for each input of the
    other program, which the graph takes but the branch not taken never reads."""

    def __init__(self, session, program: str, spec: dict, manifest: Manifest) -> None:
        """SPEC: the engine graph's manifest entry (its inputs, which load checked against the contract)."""
        self.session = session
        self.raise_native_error = None  # a native twin's: raises what its operators met in the last run
        # a twin attending over the runtime's own pool (its dtype; None: caches are bound into ONNX Runtime)
        self.native_cache = getattr(session, "speedc_native_cache", None)
        self._weight_map = getattr(session, "speedc_weight_map", None)
        if self._weight_map is not None:
            from speedc.runtimes.kernels.ort_op import raise_pending

            self.raise_native_error = raise_pending
        own = {name for name, _, _ in contract.program_io(program, contract.Dims.from_manifest(manifest))[0]}
        is_step = program.removesuffix(contract.FUSED_SUFFIX) == contract.BATCH_STEP
        self.fixed_feeds: dict[str, np.ndarray] = {}
        for tensor in spec["inputs"]:
            name = tensor["name"]
            if name == contract.RUN_STEP:
                self.fixed_feeds[name] = np.array(is_step)
            elif name not in own:
                self.fixed_feeds[name] = np.zeros([d if isinstance(d, int) else 1 for d in tensor["shape"]], tensor["dtype"])

    def io_binding(self):
        """A new IO binding with the selector and the placeholders bound (the caller binds the rest)."""
        binding = self.session.io_binding()
        for name, value in self.fixed_feeds.items():
            binding.bind_cpu_input(name, value)
        return binding

    def run_with_iobinding(self, binding, caches: dict[str, np.ndarray] | None = None) -> None:
        """Run BINDING; CACHES (name -> pool view): the KV-cache buffers its attention reads and writes where
        they are not bound into ONNX Runtime (native_cache)."""
        try:
            if self.native_cache is not None:
                with self._weight_map.caches_bound(caches or {}):
                    self.session.run_with_iobinding(binding)
            else:
                self.session.run_with_iobinding(binding)
        except Exception:  # ONNX Runtime's own types; a native product's error is the cause, raised first
            self._raise_native_error()
            raise
        self._raise_native_error()

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            outputs = self.session.run(names, {**self.fixed_feeds, **feeds})
        except Exception:
            self._raise_native_error()
            raise
        self._raise_native_error()
        return outputs

    def _raise_native_error(self) -> None:
        """The first error a native product met in the last run (its operator returns an empty result
        instead of raising; what ONNX Runtime then says about it is a consequence, not the cause)."""
        if self.raise_native_error is not None:
            self.raise_native_error()


def program_sessions(session, graph: str, manifest: Manifest) -> dict[str, ProgramSession]:
    """Program role (contract.PREFILL, contract.BATCH_STEP) -> its ProgramSession over SESSION, an ONNX
    Runtime session of engine graph GRAPH."""
    spec = getattr(session, "speedc_io", None) or manifest.graphs[graph]
    return {program.removesuffix(contract.FUSED_SUFFIX): ProgramSession(session, program, spec, manifest)
            for program in contract.engine_programs(graph, manifest.slots)}
