"""speedc's weight products (runtimes/kernels/block_product.c) as ONNX Runtime operators.

An artifact's native engine graphs (passes/native_products.py) run each weight product as

    x [M, K] ── ai.onnx.contrib SpeedcBlockProduct(artifact, codes, scales, n, k, bits, block_size) ── y [M, N]
    x [M, K] ── ai.onnx.contrib SpeedcHalfProduct(artifact, weight, n, k, dtype) ── y [M, N]   (bf16 / fp16)
    qkv, positions, lengths, rows ── ai.onnx.contrib SpeedcAttention(artifact, key, value, ...) ── [R, L, h*hd]

Python operators of onnxruntime-extensions whose body is one ctypes call into the kernel. The node
names its weight by the artifact's id and the weight index names of its codes and scales (or of its
16-bit weight); the operator reads them from a read-only memory map of the artifact's weights.bin
(registered by the backend that opens the session, `register_weights`), so ONNX Runtime never holds a
copy of them. An attention node names its KV-cache buffers likewise: the runtime's pool, held outside ONNX
Runtime (a Python operator gets copies of its inputs, so the cache cannot be one), bound by name for the
length of each run (`WeightMap.caches_bound`) and read and written in place by the kernel (attention.h).

Only onnxruntime-extensions' native module is loaded (its package __init__ imports transformers and
torch), with our own result handler: its default turns every result into a Python list (3 ms for an
[8, 5632] product). An exception must never leave an operator (ONNX Runtime would abort the
process): a failing call records its error, returns an empty result, and the backend raises it after
the run (`raise_pending`). Imports numpy and the standard library; onnxruntime-extensions on first use.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import mmap
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from speedc.format import contract
from speedc.runtimes.kernels import native


_lock = threading.Lock()
_library: str | None = None  # the custom-ops library ONNX Runtime registers (onnxruntime-extensions' module)
_reason: str | None = None
_kernel: native.BlockProductKernel | None = None
_artifacts: "weakref.WeakValueDictionary[str, WeightMap]" = weakref.WeakValueDictionary()
_errors: list[BaseException] = []
_keep: list = []  # the operator definition, alive as long as the process


class WeightMap:
    """One artifact's weights.bin, memory-mapped read-only, and the products its native graphs run."""

    def __init__(self, weights_file: Path, index: dict, threads: int, path: str, artifact_id: str = "") -> None:
        with open(weights_file, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, np.uint8)
        self.index, self.threads, self.path, self.artifact_id = index, threads, path, artifact_id
        self.products: dict[tuple, object] = {}  # a node's attributes -> its bound kernel call
        self.attentions: dict[tuple, object] = {}  # (heads, kv_heads, head_dim, theta) -> its kernel call

    def caches_bound(self, caches: dict[str, np.ndarray]):
        """A context in which this artifact's attention nodes read and write CACHES (name -> buffer): held
        around a run, one run of the artifact's sessions at a time (they may share a map, or hold older ones)."""
        return _CachesBound(self.artifact_id, caches)

    def attend(self, attrs: dict, qkv: np.ndarray, positions: np.ndarray, lengths: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """One attention node's run (contract.NATIVE_ATTENTION): rows[i] indexes positions / lengths; its cache row
        is that entry's in the bound buffers (slots P > 1: entry s*n + b is pool row s*W + b)."""
        caches = _bound_caches.get(self.artifact_id, {})
        key, value = caches.get(attrs["key"]), caches.get(attrs["value"])
        if key is None or value is None:
            raise RuntimeError(f"no KV cache is bound under {attrs['key']} / {attrs['value']} (bind it around the run)")
        found = (attrs["heads"], attrs["kv_heads"], attrs["head_dim"], attrs["theta"])
        attention = self.attentions.get(found)
        if attention is None or attention.positions < key.shape[2]:  # its rotary tables cover the pool's positions
            attention = _kernel.attention_bound(heads=found[0], kv_heads=found[1], head_dim=found[2],
                                                inv_freq=contract.rotary_inv_freq(found[2], float(found[3])),
                                                positions=key.shape[2], threads=self.threads, path=self.path)
            attention.positions = key.shape[2]
            self.attentions[found] = attention
        slots, rows = attrs["slots"], rows.astype(np.int64, copy=False)
        row_of = rows
        if slots > 1:  # entry s*n + b -> pool row s*W + b
            n, width = positions.size // slots, key.shape[0] // slots
            row_of = rows // n * width + rows % n
        qkv = np.ascontiguousarray(qkv if qkv.ndim == 3 else qkv.reshape(len(rows), 1, -1), np.float32)
        return attention(qkv, np.ascontiguousarray(row_of), np.ascontiguousarray(positions[rows]),
                         np.ascontiguousarray(lengths[rows]), key, value)

    def product(self, attrs: tuple):
        found = self.products.get(attrs)
        if found is None:
            found = self.products[attrs] = self._bind(dict(attrs))
        return found

    def tensor(self, name: str, dtype) -> np.ndarray:
        entry = self.index.get(name)
        if entry is None:
            raise KeyError(f"the weight index has no {name}")
        return np.frombuffer(self.data, dtype=dtype, count=entry["length"] // np.dtype(dtype).itemsize, offset=entry["offset"])

    def _bind(self, attrs: dict):
        """The kernel bound to one node's weight, checked against the node's shape: a 16-bit weight read
        where it is mapped, or block-quantized codes and scales prepared."""
        if "weight" in attrs:  # contract.NATIVE_HALF_PRODUCT
            n, k, dtype = int(attrs["n"]), int(attrs["k"]), attrs["dtype"]
            weight = self.tensor(attrs["weight"], np.uint16)
            if weight.size != n * k:
                raise ValueError(f"{attrs['weight']}: {weight.size} 16-bit values do not make [{n}, {k}]")
            return _kernel.half_bound(weight, n=n, k=k, dtype=dtype, threads=self.threads, path=self.path)
        n, k, bits, block_size = (int(attrs[a]) for a in ("n", "k", "bits", "block_size"))
        codes, scales = self.tensor(attrs["codes"], np.uint8), self.tensor(attrs["scales"], np.float32)
        blocks = -(-k // block_size)
        if codes.size != n * blocks * block_size * bits // 8 or scales.size != n * blocks:
            raise ValueError(f"{attrs['codes']}: {codes.size} code bytes and {scales.size} scales do not make "
                             f"[{n}, {k}] at {bits} bits in blocks of {block_size}")
        bound = _kernel.bound(codes, scales, n=n, k=k, bits=bits, block_size=block_size, threads=self.threads, path=self.path)
        # what the product no longer reads leaves this process's memory (the page cache keeps it): the
        # scales once prepared, the codes where the path repacked them
        self._release(attrs["scales"])
        if bound.packed.size:
            self._release(attrs["codes"])
        return bound

    def _release(self, name: str) -> None:
        entry, page = self.index[name], mmap.PAGESIZE
        start, end = -(-entry["offset"] // page) * page, (entry["offset"] + entry["length"]) // page * page
        if end > start and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


_bound_caches: dict[str, dict[str, np.ndarray]] = {}  # artifact id -> the KV-cache buffers of its run in progress
_run_locks: dict[str, threading.Lock] = {}  # artifact id -> held while a run of its sessions has caches bound


class _CachesBound:
    def __init__(self, artifact_id: str, caches: dict[str, np.ndarray]) -> None:
        self.artifact_id, self.given = artifact_id, caches
        with _lock:
            self.lock = _run_locks.setdefault(artifact_id, threading.Lock())

    def __enter__(self) -> None:
        self.lock.acquire()
        _bound_caches[self.artifact_id] = self.given

    def __exit__(self, *exc) -> None:
        _bound_caches.pop(self.artifact_id, None)
        self.lock.release()


def _load_extensions():
    """onnxruntime-extensions' native module and its path, without running the package's __init__."""
    spec = importlib.util.find_spec("onnxruntime_extensions")
    if spec is None or not spec.submodule_search_locations:
        return None, "onnxruntime-extensions is not installed (pip install onnxruntime-extensions)"
    folder = spec.submodule_search_locations[0]
    found = [path for suffix in importlib.machinery.EXTENSION_SUFFIXES
             for path in glob.glob(os.path.join(folder, "_extensions_pydll" + suffix))]
    if not found:
        return None, "onnxruntime-extensions has no native module here"
    module_spec = importlib.util.spec_from_file_location("_extensions_pydll", found[0])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module, found[0]


def _install(module) -> None:
    node_attrs: dict[tuple, dict] = {}

    def handle(op_id, feed, raw):  # onnxruntime-extensions calls this for every run of every Python op
        try:
            key = tuple(raw.items())
            node = node_attrs.get(key)
            if node is None:  # (artifact id, the node's attributes as the weight map keys them, its attributes)
                casts = (contract.NATIVE_ATTENTION_ATTRIBUTES if "key" in raw else contract.NATIVE_HALF_PRODUCT_ATTRIBUTES
                         if "weight" in raw else contract.NATIVE_PRODUCT_ATTRIBUTES)
                attrs = {name: casts[name](value) for name, value in raw.items()}
                node = node_attrs[key] = (attrs["artifact"], tuple(sorted(attrs.items())), attrs if "key" in raw else None)
            weights = _artifacts.get(node[0])
            if weights is None:
                raise RuntimeError(f"artifact {node[0]} has no registered weights (register_weights before the run)")
            if node[2] is not None:
                y = weights.attend(node[2], *feed)
                return op_id, y.shape, y
            y = weights.product(node[1])(feed[0])
            return op_id, y.shape, y
        except BaseException as bad:  # noqa: BLE001 -- must not reach ONNX Runtime (it would abort)
            _errors.append(bad)
            return op_id, (0,), np.empty(0, np.float32)

    module.PyCustomOpDef.install_hooker(handle)
    floats, ints = module.PyCustomOpDef.dt_float, module.PyCustomOpDef.dt_int64
    for op_type, casts, inputs in ((contract.NATIVE_PRODUCT, contract.NATIVE_PRODUCT_ATTRIBUTES, [floats]),
                                   (contract.NATIVE_HALF_PRODUCT, contract.NATIVE_HALF_PRODUCT_ATTRIBUTES, [floats]),
                                   (contract.NATIVE_ATTENTION, contract.NATIVE_ATTENTION_ATTRIBUTES, [floats] + [ints] * 3)):
        definition = module.PyCustomOpDef()
        definition.op_type = op_type
        definition.obj_id = id(definition)
        definition.input_types = inputs
        definition.output_types = [floats]
        definition.attrs = {name: (module.PyCustomOpDef.dt_string if cast is str else ints) for name, cast in casts.items()}
        module.add_custom_op(definition)
        _keep.append(definition)


def custom_ops_library() -> str | None:
    """The library to register with SessionOptions.register_custom_ops_library, the operator and the
    kernel loaded; None where they cannot be (unavailable_reason() says why)."""
    global _library, _reason, _kernel
    with _lock:
        if _library is not None or _reason is not None:
            return _library
        kernel = native.load()
        if kernel is None:
            _reason = native.unavailable_reason()
            return None
        try:
            module, found = _load_extensions()
        except Exception as bad:  # noqa: BLE001 -- whatever the module raises, the MatMulNBits path still runs
            module, found = None, f"onnxruntime-extensions cannot be loaded ({str(bad).splitlines()[0]})"
        if module is None:
            _reason = found
            return None
        _install(module)
        _kernel, _library = kernel, found
        return _library


def unavailable_reason() -> str | None:
    return _reason


def choose_path(setting: str = "") -> tuple[str | None, str]:
    """(the kernel path the operator runs, why) after custom_ops_library() loaded the kernel: SETTING (a
    path's name from SPEEDC_NATIVE_KERNEL) where this CPU runs it, else the widest path it has; None
    where that is only the portable C path (several times slower than MatMulNBits) or the named path is
    not on this CPU."""
    paths = _kernel.paths
    if setting not in ("", "1", *native.PATHS) or setting == "auto":
        return None, f"SPEEDC_NATIVE_KERNEL={setting} is not 0, 1 or one of the kernel's paths ({', '.join(paths)} here)"
    if setting in native.PATHS:
        if setting in paths:
            return setting, f"SPEEDC_NATIVE_KERNEL={setting}"
        return None, f"this CPU has no {setting} path (it runs {', '.join(paths)})"
    if _kernel.path == "portable":
        return None, ("this CPU has none of the kernel's vector paths (AVX2, AVX-VNNI, AVX-512 VNNI, Arm dotprod / "
                      "i8mm); SPEEDC_NATIVE_KERNEL=portable runs its portable C path")
    return _kernel.path, "the widest this CPU runs"


def register_weights(artifact_id: str, weights_file: Path, index: dict, threads: int, path: str) -> WeightMap:
    """Make ARTIFACT_ID's products readable by the operator, run on kernel PATH; they stay so while the
    returned map lives (the backend keeps it). A second registration of the same artifact with the same
    threads and path shares the first's map."""
    with _lock:
        found = _artifacts.get(artifact_id)
        if found is None or (found.threads, found.path) != (threads, path):
            found = WeightMap(weights_file, index, threads, path, artifact_id)
            _artifacts[artifact_id] = found
        return found


def raise_pending() -> None:
    """Raise the first error an operator met during the last run (the run's outputs are then wrong)."""
    if _errors:
        bad = _errors[0]
        _errors.clear()
        raise RuntimeError(f"a native operator failed: {bad}") from bad
