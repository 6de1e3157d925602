"""speedc's block-quantized product kernel (block_product.c): built on first use, loaded with ctypes.

The runtime never needs it: where no C compiler is found or the build fails, `load()` returns None and
says why (`unavailable_reason()`), and the ONNX Runtime sessions run their MatMulNBits products
(runtimes/backends/onnx_session.py; SPEEDC_NATIVE_KERNEL=0 asks for that too). Imports numpy and the standard library only.

The library is built once per source text, compiler and CPU family into $SPEEDC_KERNEL_CACHE (default
~/.cache/speedc/kernels; 1-2 s with gcc -O3), written under a temporary name and renamed into place,
so concurrent first uses never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("block_product.c")
HEADERS = sorted(SOURCE.parent.glob("*.h"))  # the per-architecture paths and 16-bit products it includes
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-std=gnu11")
# The kernel's paths (block_product.c PATH_*). The stand-ins run only when asked for by name.
PATHS = {"auto": 0, "portable": 1, "avx2": 2, "avx-vnni": 3, "avx512-vnni": 4, "avx-vnni-standin": 5, "dotprod": 6,
         "i8mm": 7, "amx": 8, "amx-standin": 9}
STAND_INS = ("avx-vnni-standin", "amx-standin")  # exact equivalents that test a path's logic on CPUs without it
PATH_NAMES = {v: k for k, v in PATHS.items()}
HALF_DTYPES = {"bf16": 0, "fp16": 1}  # half_product.h HALF_*
# The KV caches the attention reads and writes (attention.h KV_*): name -> (numpy dtype of the buffer, its code).
# int8: each position's head of hd values is one row of hd + hd / 8 bytes, [hd / 32 float32 scales | hd codes].
KV_CACHES = {"float32": (np.float32, 0), "float16": (np.float16, 1), "int8": (np.uint8, 2)}
KV_BLOCK = 32  # int8 caches: values per scale


def kv_row_width(cache: str, head_dim: int) -> int:
    """Elements of a KV buffer's last axis (one position's head) for CACHE (KV_CACHES) at HEAD_DIM."""
    return head_dim + head_dim // 8 if cache == "int8" else head_dim


_lock = threading.Lock()
_loaded: "BlockProductKernel | None" = None
_reason: str | None = None


class KernelError(RuntimeError):
    """The kernel refused its arguments (a bug of the caller: shapes are checked before)."""


def cache_dir() -> Path:
    given = os.environ.get("SPEEDC_KERNEL_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speedc" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str) -> Path:
    source = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()
                         + platform.machine().encode()).hexdigest()[:16]
    target = cache_dir() / f"block_product-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise OSError(f"{Path(compiler).name} failed on {SOURCE.name}: {first}")
        os.replace(partial, target)
    return target


class BlockProductKernel:
    """The loaded library: `product` runs y = x . dequant(W)^T over MatMulNBits codes and scales."""

    def __init__(self, library: Path) -> None:
        self.library = library
        self._lib = ctypes.CDLL(str(library))
        f = self._lib.speedc_block_product
        i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        f.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, cint, cint, ptr, cint, cint]
        f.restype = cint
        self._product = f
        self._prepare = self._lib.speedc_block_prepare
        self._prepare.argtypes = [ptr, ptr, i64, i64, i64, cint, cint, cint, ptr, ptr, ptr, ptr, cint]
        self._prepare.restype = cint
        self._lib.speedc_block_prepared_sizes.argtypes = [i64, i64, cint, cint, ptr]
        self._lib.speedc_block_product_path.restype = ctypes.c_int
        self._lib.speedc_block_product_paths.restype = ctypes.c_uint
        self._half = self._lib.speedc_half_product
        self._half.argtypes = [ptr, i64, i64, ptr, i64, cint, ptr, cint, cint]
        self._half.restype = cint
        self._attention = self._lib.speedc_attention
        self._attention.argtypes = [ptr, i64, i64, cint, cint, cint, ptr, ptr, ptr, ptr, ptr, cint, i64, i64, i64, i64,
                                    ptr, ptr, i64, ctypes.c_float, ptr, cint, cint]
        self._attention.restype = cint
        self.path = PATH_NAMES[self._lib.speedc_block_product_path()]  # what "auto" runs on this CPU
        mask = self._lib.speedc_block_product_paths()
        self.paths = [name for name, code in PATHS.items() if code and mask >> code & 1]  # what this CPU can run

    def product(self, x: np.ndarray, codes: np.ndarray, scales: np.ndarray, *, n: int, k: int, bits: int,
                block_size: int, threads: int = 1, path: str = "auto", out: np.ndarray | None = None) -> np.ndarray:
        """X [M, K] float32 (C-contiguous) times the weight [N, K] held as CODES [N, blocks, block_size*bits/8]
        uint8 and SCALES [N, blocks] float32 (ONNX Runtime's MatMulNBits layout); returns [M, N] float32
        (into OUT when given). Prepares the weight on every call: for one product; `bound` for many."""
        return self.bound(codes, scales, n=n, k=k, bits=bits, block_size=block_size, threads=threads, path=path)(x, out)

    def bound(self, codes: np.ndarray, scales: np.ndarray, *, n: int, k: int, bits: int, block_size: int,
              threads: int = 1, path: str = "auto"):
        """`product` over one weight, its arguments checked and the weight prepared once (its scales as
        per-superblock units and integer steps, block_product.c): a function (x [M, K], out=None) -> y [M, N]
        for the hot path (an operator's call: a few microseconds of Python around the kernel). The
        prepared arrays (`product.prepared`) hold 0.09 (4 bits) or 0.19 (8 bits) bytes per weight
        beside the codes."""
        blocks = -(-k // block_size)
        if codes.nbytes < n * blocks * block_size * bits // 8 or scales.size < n * blocks:
            raise KernelError(f"codes/scales hold fewer bytes than [{n}, {blocks}] blocks of {block_size} at {bits} bits")
        if not (codes.flags.c_contiguous and scales.flags.c_contiguous and scales.dtype == np.float32):
            raise KernelError("codes and scales must be C-contiguous (scales float32)")
        path_code = PATHS[path]
        sizes = np.zeros(4, np.int64)  # packed code bytes, steps, units, offsets
        self._lib.speedc_block_prepared_sizes(n, k, bits, path_code, sizes.ctypes.data)
        packed = np.empty(int(sizes[0]), np.uint8)
        steps, units, offsets = np.empty(int(sizes[1]), np.int16), np.empty(int(sizes[2]), np.float32), np.empty(int(sizes[3]), np.int32)
        rc = self._prepare(codes.ctypes.data, scales.ctypes.data, n, k, blocks, block_size, bits, path_code,
                           packed.ctypes.data, steps.ctypes.data, units.ctypes.data, offsets.ctypes.data, threads)
        if rc != 0:
            raise KernelError(f"block_product refused its arguments (code {rc}: bits {bits}, block {block_size}, path {path})")
        run = self._product
        read = packed if packed.size else codes  # a lanes16 path reads its repacked codes, the others the artifact's
        pointers = (read.ctypes.data, steps.ctypes.data, units.ctypes.data, offsets.ctypes.data)

        def product(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != k or not x.flags.c_contiguous:
                raise KernelError(f"x must be C-contiguous float32 [M, {k}], not {x.dtype} {x.shape}")
            y = np.empty((x.shape[0], n), np.float32) if out is None else out
            rc = run(x.ctypes.data, x.shape[0], k, *pointers, n, blocks, block_size, bits, y.ctypes.data, threads, path_code)
            if rc != 0:
                raise KernelError(f"block_product refused its arguments (code {rc}: bits {bits}, block {block_size})")
            return y

        product.weights = (codes, scales)  # the memory the pointers point into stays alive with the function
        product.prepared = (steps, units, offsets)
        product.packed = packed
        return product

    def half_bound(self, weight: np.ndarray, *, n: int, k: int, dtype: str, threads: int = 1, path: str = "auto"):
        """y = x . W^T over 16-bit weights WEIGHT [N, K] (DTYPE "bf16" or "fp16", any 2-byte numpy view of
        them, C-contiguous: read in place, nothing prepared or copied): a function (x [M, K], out=None)
        -> y [M, N] float32, every path the portable path's bits (half_product.h)."""
        if dtype not in HALF_DTYPES:
            raise KernelError(f"16-bit products take {' or '.join(HALF_DTYPES)} weights, not {dtype}")
        if weight.nbytes != n * k * 2 or weight.itemsize != 2 or not weight.flags.c_contiguous:
            raise KernelError(f"the weight must be C-contiguous 16-bit [{n}, {k}], not {weight.dtype} {weight.shape}")
        run, code, pointer = self._half, HALF_DTYPES[dtype], weight.ctypes.data
        path_code = PATHS[path]

        def product(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != k or not x.flags.c_contiguous:
                raise KernelError(f"x must be C-contiguous float32 [M, {k}], not {x.dtype} {x.shape}")
            y = np.empty((x.shape[0], n), np.float32) if out is None else out
            rc = run(x.ctypes.data, x.shape[0], k, pointer, n, code, y.ctypes.data, threads, path_code)
            if rc != 0:
                raise KernelError(f"half_product refused its arguments (code {rc}: {dtype}, path {path})")
            return y

        product.weights = (weight,)  # the memory the pointer points into stays alive with the function
        return product

    def attention_bound(self, *, heads: int, kv_heads: int, head_dim: int, inv_freq: np.ndarray, positions: int,
                        threads: int = 1, path: str = "auto"):
        """One layer shape's attention over a KV cache read and written in place (attention.h): a function
        (qkv [R, L, (heads + 2 kv_heads) hd] float32, row_of [R], pos [R], lengths [R] int64, key, value)
        -> out [R, L, heads hd] float32, where KEY / VALUE [rows, kv_heads, T, kv_row_width] are float32, float16
        or int8 rows (uint8, KV_CACHES; the last two axes C-contiguous) and row r's tokens i < lengths[r] sit at
        pos[r] + i of cache row row_of[r]. Rotary: Hugging Face's half-split rope by INV_FREQ [hd/2] (contract.
        rotary_inv_freq) at positions 0..POSITIONS-1."""
        angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # [positions, hd/2]
        cos, sin = np.ascontiguousarray(np.cos(angles), np.float32), np.ascontiguousarray(np.sin(angles), np.float32)
        width, run, path_code = (heads + 2 * kv_heads) * head_dim, self._attention, PATHS[path]
        scale = float(np.float32(head_dim ** -0.5))

        def attention(qkv: np.ndarray, row_of: np.ndarray, pos: np.ndarray, lengths: np.ndarray, key: np.ndarray,
                      value: np.ndarray) -> np.ndarray:
            if qkv.dtype != np.float32 or qkv.ndim != 3 or qkv.shape[2] != width or not qkv.flags.c_contiguous:
                raise KernelError(f"qkv must be C-contiguous float32 [R, L, {width}], not {qkv.dtype} {qkv.shape}")
            rows, chunk = qkv.shape[:2]
            for name, index in (("row_of", row_of), ("pos", pos), ("lengths", lengths)):
                if index.dtype != np.int64 or index.shape != (rows,) or not index.flags.c_contiguous:
                    raise KernelError(f"{name} must be C-contiguous int64 [{rows}], not {index.dtype} {index.shape}")
            if key.dtype != value.dtype or key.shape != value.shape or key.strides != value.strides:
                raise KernelError("the key and value caches must have one dtype, shape and layout")
            cache = next((name for name, (dtype, _) in KV_CACHES.items() if key.dtype == dtype), None)
            row = kv_row_width(cache, head_dim) if cache else 0
            if (cache is None or key.ndim != 4 or key.shape[1] != kv_heads or key.shape[3] != row
                    or key.strides[3] != key.itemsize or key.strides[2] != row * key.itemsize):
                raise KernelError(f"the caches must be float32, float16 or int8 rows (uint8) [rows, {kv_heads}, T, "
                                  f"{head_dim} (int8: {kv_row_width('int8', head_dim)})], positions contiguous, "
                                  f"not {key.dtype} {key.shape}")
            y = np.empty((rows, chunk, heads * head_dim), np.float32)
            rc = run(qkv.ctypes.data, rows, chunk, heads, kv_heads, head_dim, row_of.ctypes.data, pos.ctypes.data,
                     lengths.ctypes.data, key.ctypes.data, value.ctypes.data, KV_CACHES[cache][1], key.shape[0],
                     key.strides[0], key.strides[1], key.shape[2], cos.ctypes.data, sin.ctypes.data,
                     positions, scale, y.ctypes.data, threads, path_code)
            if rc != 0:
                raise KernelError(f"attention refused its arguments (code {rc}: rows {rows}, chunk {chunk}, "
                                  f"positions {pos.tolist()}, lengths {lengths.tolist()}, cache {key.shape})")
            return y

        attention.tables = (cos, sin)  # alive with the function
        return attention


def load() -> BlockProductKernel | None:
    """The kernel, built on first use; None where it cannot be had (unavailable_reason() says why)."""
    global _loaded, _reason
    with _lock:
        if _loaded is not None or _reason is not None:
            return _loaded
        compiler = _compiler()
        if compiler is None:
            _reason = "no C compiler found (cc, gcc or clang; or set CC)"
            return None
        try:
            _loaded = BlockProductKernel(_build(compiler))
        except (OSError, subprocess.SubprocessError) as e:
            _reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _loaded


def unavailable_reason() -> str | None:
    """Why load() returned None (None before a load, or when the kernel loaded)."""
    return _reason
