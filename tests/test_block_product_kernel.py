"""speedc's block-quantized product kernel (runtimes/kernels/block_product.c) against a numpy reference
written from its description: weights (code - 2^(bits-1)) x scale per block, activations quantized to
int8 per 32 values (dx = max|x| / 127, q = rint(x * 127 / max|x|)), one integer dot per 32 values,
scaled by scale x dx. Integer arithmetic is compared exactly, the float scaling within rounding; every
row's sums are bitwise the same whatever the row count or thread count (what SPEED's losslessness
needs), on both the AVX2 and the portable path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speedc.passes.block_quant import quantize_rows
from speedc.runtimes.kernels import native
from speedc.runtimes.kernels.native import KernelError

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no native kernel here: {native.unavailable_reason()}")
PATHS = [p for p in ("portable", "avx2") if KERNEL is not None and (p == "portable" or KERNEL.path == "avx2")]


def unpacked_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[N, blocks, bytes] -> [N, blocks * block_size] signed weights code - 2^(bits-1) (int64)."""
    if bits == 4:
        values = np.empty((*codes.shape[:2], codes.shape[2] * 2), np.int64)
        values[..., 0::2], values[..., 1::2] = codes & 15, codes >> 4  # the lower K index in the low nibble
    else:
        values = codes.astype(np.int64)
    return values.reshape(codes.shape[0], -1) - (1 << (bits - 1))


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int, block_size: int):
    """(y [M, N] float64, the integer dots [M, N, K/32] int64, sum of |every product| [M, N]) as the
    description says."""
    m, k = x.shape
    subs = -(-k // 32)
    padded = np.zeros((m, subs * 32), np.float32)
    padded[:, :k] = x
    groups = padded.reshape(m, subs, 32)
    largest = np.abs(groups).max(-1)  # [M, subs]
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    q = np.rint(groups * inverse[..., None]).astype(np.int64)  # [M, subs, 32]
    dx = (largest / np.float32(127)).astype(np.float32)
    w = unpacked_codes(codes, bits)[:, :subs * 32].reshape(codes.shape[0], subs, 32)  # [N, subs, 32]
    dots = np.einsum("msi,nsi->mns", q, w)
    w_scales = np.repeat(scales, block_size // 32, axis=1)[:, :subs].astype(np.float64)  # [N, subs]
    scale = w_scales[None] * dx[:, None].astype(np.float64)  # [M, N, subs]
    magnitude = (np.einsum("msi,nsi->mns", np.abs(q), np.abs(w)) * np.abs(scale)).sum(-1)  # bounds any partial sum
    return (dots * scale).sum(-1), dots, magnitude


def weights(rng, n: int, k: int, bits: int, block_size: int):
    return quantize_rows(rng.standard_normal((n, k)).astype(np.float32), bits, block_size)


def product(x, codes, scales, n, k, bits, block_size, **kw):
    return KERNEL.product(np.ascontiguousarray(x, np.float32), codes, scales, n=n, k=k, bits=bits,
                          block_size=block_size, **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block_size,k", [(32, 256), (64, 320), (128, 300), (32, 70)])
def test_integer_dots_are_exact(path, bits, block_size, k):
    """Activations already on the int8 grid (each 32 values' largest magnitude 127: q = x) and weight
    scales of 1: every float the kernel forms is an integer below 2^24, so y must equal the exact
    integer sum bit for bit; a wrong code, nibble order, zero point or padding cannot hide in rounding."""
    rng = np.random.default_rng(k + bits)
    n, m = 37, 6
    codes = rng.integers(0, 256, size=(n, -(-k // block_size), block_size * bits // 8), dtype=np.uint8)
    if -(-k // block_size) * block_size > k:  # the padded tail holds zero weights, as the quantizer writes it
        zero = 0x88 if bits == 4 else 0x80
        flat = codes.reshape(n, -1)
        first = k * bits // 8
        flat[:, first:] = zero
    scales = np.ones((n, -(-k // block_size)), np.float32)
    x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
    x[:, ::32] = 127  # each 32 values' largest magnitude: dx = 1
    expected, dots, magnitude = reference(x, codes, scales, bits, block_size)
    assert magnitude.max() < 2 ** 24
    y = product(x, codes, scales, n, k, bits, block_size, path=path)
    assert np.array_equal(y, expected.astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 70), k=st.integers(1, 300), bits=st.sampled_from([4, 8]),
       block_size=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**31 - 1), path=st.sampled_from(PATHS or ["avx2"]))
def test_fuzzed_shapes_match_the_reference(m, n, k, bits, block_size, seed, path):
    rng = np.random.default_rng(seed)
    codes, scales = weights(rng, n, k, bits, block_size)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1, 30])).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0
    expected, _, magnitude = reference(x, codes, scales, bits, block_size)
    y = product(x, codes, scales, n, k, bits, block_size, path=path)
    # float32 roundings of a few products and sums per 32 values, each within 2^-24 of a partial sum
    assert np.all(np.abs(y - expected) <= 1e-6 * magnitude + 1e-30)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_sums_the_same_alone_among_rows_and_on_any_thread_count(path, bits):
    """Row invariance: rows computed alone, in any batch of 1..9 rows, on 1, 2 or 3 threads, are
    bitwise equal (plain decoding runs one row, a SPEED step P; nothing pads a row to make them agree)."""
    rng = np.random.default_rng(bits)
    n, k = 203, 352  # 11 sub-blocks: a partial group of 4 at the end of every row
    codes, scales = weights(rng, n, k, bits, 32)
    x = rng.standard_normal((9, k)).astype(np.float32)
    alone = np.stack([product(x[i:i + 1], codes, scales, n, k, bits, 32, path=path)[0] for i in range(9)])
    for rows in range(1, 10):
        for threads in (1, 2, 3):
            together = product(x[:rows], codes, scales, n, k, bits, 32, path=path, threads=threads)
            assert np.array_equal(together, alone[:rows]), (rows, threads)


def test_paths_agree_within_rounding():
    if "avx2" not in PATHS:
        pytest.skip("this CPU has no AVX2")
    rng = np.random.default_rng(7)
    codes, scales = weights(rng, 64, 512, 4, 32)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    a, b = (product(x, codes, scales, 64, 512, 4, 32, path=p) for p in ("avx2", "portable"))
    assert np.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_arguments_it_does_not_take_are_refused():
    rng = np.random.default_rng(0)
    codes, scales = weights(rng, 8, 64, 4, 32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(KernelError, match="code -1"):
        KERNEL.product(x, codes, scales, n=8, k=64, bits=3, block_size=32)
    small_codes, small_scales = weights(rng, 8, 64, 4, 16)
    with pytest.raises(KernelError, match="code -2"):
        KERNEL.product(x, small_codes, small_scales, n=8, k=64, bits=4, block_size=16)
    with pytest.raises(KernelError, match="fewer bytes"):
        KERNEL.product(x, codes[:4], scales, n=8, k=64, bits=4, block_size=32)
    with pytest.raises(KernelError, match="C-contiguous float32"):
        KERNEL.product(x[:, ::2].copy().astype(np.float64), codes, scales, n=8, k=32, bits=4, block_size=32)


def test_without_a_compiler_load_says_why(tmp_path):
    """No C compiler: load() returns None with the reason (the runtime then runs MatMulNBits)."""
    code = ("from speedc.runtimes.kernels import native; k = native.load(); "
            "print(k is None, native.unavailable_reason())")
    env = {**os.environ, "CC": "", "PATH": str(tmp_path), "SPEEDC_KERNEL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True no C compiler found (cc, gcc or clang; or set CC)"


def test_a_build_is_cached_and_written_whole(tmp_path):
    """The library is compiled once into the cache folder (a temporary name, then renamed)."""
    env = {**os.environ, "SPEEDC_KERNEL_CACHE": str(tmp_path)}
    code = "from speedc.runtimes.kernels import native; print(native.load().library)"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and first.stdout == second.stdout
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(first.stdout.strip())]
