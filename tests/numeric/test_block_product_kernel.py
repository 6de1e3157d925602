"""speedc's block-quantized product kernel (runtimes/kernels/block_product.c) against a numpy reference
written from its description: weights (code - 2^(bits-1)) x scale per block; the scales of each
superblock (256 values at 4 bits, 64 at 8 bits) held as one float unit (largest |scale| / 2047) and
integer steps rint(scale / unit); activations quantized to int8 per superblock (dx = max|x| / 127,
q = rint(x * 127 / max|x|)); a superblock's sum of step x integer dot is exact, scaled once by unit x dx.
Integer arithmetic is compared exactly, the float scaling within rounding; every row's sums are bitwise
the same whatever the row count or thread count (what SPEED's losslessness needs), on every path this
CPU runs; the paths that sum each superblock to one exact integer give the portable path's bits."""

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
PATHS = KERNEL.paths if KERNEL is not None else []  # every path this CPU runs, the AVX2 / plain-C stand-ins included
LANE_SPREAD = ("avx2", "avx-vnni", "avx-vnni-standin")  # paths whose superblock sums are spread over lanes before scaling
EXACT_PATHS = [path for path in PATHS if path not in LANE_SPREAD]  # the portable path's bits exactly


def unpacked_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[N, blocks, bytes] -> [N, blocks * block_size] signed weights code - 2^(bits-1) (int64)."""
    if bits == 4:
        values = np.empty((*codes.shape[:2], codes.shape[2] * 2), np.int64)
        values[..., 0::2], values[..., 1::2] = codes & 15, codes >> 4  # the lower K index in the low nibble
    else:
        values = codes.astype(np.int64)
    return values.reshape(codes.shape[0], -1) - (1 << (bits - 1))


def super_blocks(bits: int) -> int:
    return 8 if bits == 4 else 2


def superblock_weights(codes: np.ndarray, bits: int, k: int, supers: int) -> np.ndarray:
    """[N, supers, super, 32] signed weights of the row's sub-blocks (every code of each, as the kernel
    multiplies them), zeros past the row's last sub-block."""
    sup, n = super_blocks(bits), codes.shape[0]
    w = np.zeros((n, supers * sup * 32), np.int64)
    used = min(w.shape[1], -(-k // 32) * 32)
    w[:, :used] = unpacked_codes(codes, bits)[:, :used]
    return w.reshape(n, supers, sup, 32)


def prepared(scales: np.ndarray, k: int, bits: int, block_size: int):
    """(steps [N, supers, super] int64, units [N, supers] float32): the weight's scales as the description says."""
    sub_blocks, sup = -(-k // 32), super_blocks(bits)
    supers = -(-sub_blocks // sup)
    per_sub = np.zeros((scales.shape[0], supers * sup), np.float32)
    per_sub[:, :sub_blocks] = np.repeat(scales, block_size // 32, axis=1)[:, :sub_blocks]
    per_sub = per_sub.reshape(scales.shape[0], supers, sup)
    units = (np.abs(per_sub).max(-1) / np.float32(2047)).astype(np.float32)
    safe = np.where(units > 0, units, 1)[..., None]
    steps = np.where(units[..., None] > 0, np.clip(np.rint(per_sub / safe), -2047, 2047), 0).astype(np.int64)
    return steps, units


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int, block_size: int):
    """(y [M, N] float64, each superblock's exact integer sum [M, N, supers] int64, a bound on the size of
    every partial sum the kernel forms [M, N]) as the description says."""
    m, k = x.shape
    sup = super_blocks(bits)
    steps, units = prepared(scales, k, bits, block_size)
    supers = units.shape[1]
    padded = np.zeros((m, supers * sup * 32), np.float32)
    padded[:, :k] = x
    groups = padded.reshape(m, supers, sup * 32)
    largest = np.abs(groups).max(-1)  # [M, supers]
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    q = np.rint(groups * inverse[..., None]).astype(np.int64).reshape(m, supers, sup, 32)
    dx = (largest / np.float32(127)).astype(np.float32)
    w = superblock_weights(codes, bits, k, supers)
    totals = (np.einsum("msbi,nsbi->mnsb", q, w) * steps[None]).sum(-1)  # [M, N, supers]
    scale = (units[None] * dx[:, None]).astype(np.float32).astype(np.float64)  # unit x dx, a float32 product
    # 4 bits: the vector path adds q + 128 (unsigned) and takes 128 x sum(w) back: its lanes hold up to that
    shifted = np.abs(q) + (128 if bits == 4 else 0)
    magnitude = (np.einsum("msbi,nsbi->mnsb", shifted, np.abs(w)) * np.abs(steps[None])).sum(-1)
    return (totals * scale).sum(-1), totals, (magnitude * np.abs(scale)).sum(-1)


def weights(rng, n: int, k: int, bits: int, block_size: int):
    return quantize_rows(rng.standard_normal((n, k)).astype(np.float32), bits, block_size)


def product(x, codes, scales, n, k, bits, block_size, **kw):
    return KERNEL.product(np.ascontiguousarray(x, np.float32), codes, scales, n=n, k=k, bits=bits,
                          block_size=block_size, **kw)


def exact_case(k: int, bits: int, block_size: int, *, n: int, m: int):
    """(x [M, K], codes, scales) on which every float the kernel forms is an integer times 2^-11 below
    2^24: activations already on the int8 grid (each superblock's largest magnitude 127: q = x, dx = 1),
    and scales that make every unit 2^-11 and every step a small integer (each superblock's first block
    carries the largest scale, 2047 x 2^-11, over zero weights)."""
    rng = np.random.default_rng(k + bits)
    sup = super_blocks(bits)
    blocks = -(-k // block_size)
    codes = rng.integers(0, 256, size=(n, blocks, block_size * bits // 8), dtype=np.uint8)
    zero = 0x88 if bits == 4 else 0x80
    if blocks * block_size > k:  # the padded tail holds zero weights, as the quantizer writes it
        flat = codes.reshape(n, -1)
        flat[:, k * bits // 8:] = zero
    scales = (rng.integers(1, 16, size=(n, blocks)) * 2.0 ** -11).astype(np.float32)
    firsts = np.arange(0, blocks * block_size, sup * 32) // block_size  # the block opening each superblock
    scales[:, firsts] = 2047 * 2.0 ** -11
    codes[:, firsts] = zero
    x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
    x[:, ::sup * 32] = 127
    return x, codes, scales


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits,block_size,k", [(4, 32, 256), (4, 64, 320), (4, 128, 300), (4, 32, 70), (8, 32, 256),
                                               (8, 32, 70)])
def test_integer_sums_are_exact(path, bits, block_size, k):
    """On exact_case's operands y must equal the exact sum bit for bit: a wrong code, nibble or
    activation order, zero point, step, offset or padding cannot hide in rounding."""
    n = 37
    x, codes, scales = exact_case(k, bits, block_size, n=n, m=12)  # amx: 12 rows run on tiles
    expected, totals, magnitude = reference(x, codes, scales, bits, block_size)
    assert magnitude.max() < 2 ** 24 * 2.0 ** -11 and np.abs(totals).max() > 0
    y = product(x, codes, scales, n, k, bits, block_size, path=path)
    assert np.array_equal(y, expected.astype(np.float32))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits,k", [(4, 256), (4, 300), (8, 70)])
def test_activations_round_to_nearest_even(path, bits, k):
    """exact_case's operands off the int8 grid: x = q + 1/2 and q + 1/4 (each superblock's largest still 127, so
    x * 127 / largest = x), ties going to the even integer as rint says; K past a whole register and a whole
    superblock, so every part of the activations' quantization rounds."""
    x, codes, scales = exact_case(k, bits, 32, n=21, m=5)
    rng = np.random.default_rng(k)
    offsets = rng.choice(np.array([0.5, -0.5, 0.25, -0.25], np.float32), size=x.shape)
    inside = np.abs(x) < 126
    x[inside] += offsets[inside]
    expected, totals, _ = reference(x, codes, scales, bits, 32)
    ties = np.abs(offsets) == 0.5
    assert np.abs(totals).max() > 0 and (ties & inside).any() and (~ties & inside).any()
    y = product(x, codes, scales, 21, k, bits, 32, path=path)
    assert np.array_equal(y, expected.astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_prepared_steps_and_units_follow_the_description(bits):
    """The weight's prepared form in place (portable, avx2, avx-vnni, Arm): units largest |scale| / 2047
    per superblock, steps rint(scale / unit) (0 past the row), and at 4 bits the offsets 128 x sum over
    the superblock of step x (code - zp)."""
    rng = np.random.default_rng(bits)
    n, k, block_size = 19, 610, 64
    codes, scales = weights(rng, n, k, bits, block_size)
    scales[3] = 0  # a row of zero scales: unit 0, steps 0
    bound = KERNEL.bound(codes, scales, n=n, k=k, bits=bits, block_size=block_size, path="portable")
    steps, units, offsets = bound.prepared
    want_steps, want_units = prepared(scales, k, bits, block_size)
    assert bound.packed.size == 0  # the codes are read where they are
    assert np.array_equal(units.reshape(want_units.shape), want_units)
    assert np.array_equal(steps.reshape(want_steps.shape), want_steps)
    if bits == 4:
        sums = superblock_weights(codes, bits, k, want_units.shape[1]).sum(-1)
        assert np.array_equal(offsets.reshape(want_units.shape), 128 * (sums * want_steps).sum(-1))
    else:
        assert not offsets.any()


@pytest.mark.skipif("amx-standin" not in PATHS, reason="no lanes16 path on this CPU (x86 with AVX2 has amx-standin)")
@pytest.mark.parametrize("bits", [4, 8])
def test_the_lanes16_layout_follows_the_description(bits):
    """avx512-vnni / amx / amx-standin repack a weight once: per group of 16 features, superblock and
    sub-block, a chunk whose 4-byte column j of tile row r holds feature 16 g + j's code bytes 4 r' + e
    (4 bits: 256 bytes, row r' = r // 2 of nibbles; 8 bits: 512 bytes), steps as int16 pairs
    [g][s][b / 2][16][2], units [g][s][16]; features past n have zero steps and units."""
    rng = np.random.default_rng(bits)
    n, k, block_size = 19, 610, 64
    codes, scales = weights(rng, n, k, bits, block_size)
    bound = KERNEL.bound(codes, scales, n=n, k=k, bits=bits, block_size=block_size, path="amx-standin")
    steps, units, _ = bound.prepared
    want_steps, want_units = prepared(scales, k, bits, block_size)  # [N, supers, super], [N, supers]
    groups, supers, sup = -(-n // 16), want_units.shape[1], super_blocks(bits)
    padded_steps = np.zeros((groups * 16, supers, sup), np.int64)
    padded_steps[:n] = want_steps
    padded_units = np.zeros((groups * 16, supers), np.float32)
    padded_units[:n] = want_units
    pairs = steps.reshape(groups, supers, sup // 2, 16, 2)
    assert np.array_equal(pairs.transpose(0, 3, 1, 2, 4).reshape(groups * 16, supers, sup), padded_steps)
    assert np.array_equal(units.reshape(groups, supers, 16).transpose(0, 2, 1).reshape(-1, supers), padded_units)
    sub_bytes = 32 * bits // 8
    zero = 0x88 if bits == 4 else 0x80
    by_sub = np.full((groups * 16, supers * sup, sub_bytes), zero, np.uint8)
    sub_blocks = -(-k // 32)
    by_sub[:n, :sub_blocks] = codes.reshape(n, -1)[:, :sub_blocks * sub_bytes].reshape(n, sub_blocks, sub_bytes)
    chunks = by_sub.reshape(groups, 16, supers, sup, sub_bytes // 4, 4).transpose(0, 2, 3, 4, 1, 5)
    assert np.array_equal(bound.packed.reshape(chunks.shape), chunks)


@pytest.mark.parametrize("path", EXACT_PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_exact_paths_give_the_portable_bits(path, bits):
    """Every path that sums each superblock to one exact integer per (row, feature) and scales it once
    gives the portable path's bits: 1 row (amx: on avx512-vnni), a few, a whole tile, past a tile (amx:
    a second group of tile rows), on 1 and 3 threads."""
    rng = np.random.default_rng(bits + 3)
    n, k = 83, 1000  # a partial group of 16 features and a partial superblock
    codes, scales = weights(rng, n, k, bits, 32)
    x = (rng.standard_normal((33, k)) * 3).astype(np.float32)
    for rows in (1, 3, 8, 10, 16, 17, 33):
        portable = product(x[:rows], codes, scales, n, k, bits, 32, path="portable")
        for threads in (1, 3):
            assert np.array_equal(product(x[:rows], codes, scales, n, k, bits, 32, path=path, threads=threads), portable), (rows, threads)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 300), bits=st.sampled_from([4, 8]),
       block_size=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**31 - 1), path=st.sampled_from(PATHS or ["avx2"]))
def test_fuzzed_shapes_match_the_reference(m, n, k, bits, block_size, seed, path):
    rng = np.random.default_rng(seed)
    codes, scales = weights(rng, n, k, bits, block_size)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1, 30])).astype(np.float32)
    x[rng.random((m, k)) < 0.1] = 0
    expected, _, magnitude = reference(x, codes, scales, bits, block_size)
    y = product(x, codes, scales, n, k, bits, block_size, path=path)
    # float32 roundings of a few conversions, products and sums per superblock, each within 2^-24 of a partial sum
    assert np.all(np.abs(y - expected) <= 1e-6 * magnitude + 1e-30)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_sums_the_same_alone_among_rows_and_on_any_thread_count(path, bits):
    """Row invariance: rows computed alone, in any batch of 1..12 rows (amx: on tiles from 8 or 10), on 1,
    2 or 3 threads, are bitwise equal (plain decoding runs one row, a SPEED step P; nothing pads a row to
    make them agree)."""
    rng = np.random.default_rng(bits)
    n, k = 203, 352  # 11 sub-blocks: a partial superblock at the end of every row (4 bits: 8 + 3; 8 bits: 2 x 5 + 1)
    codes, scales = weights(rng, n, k, bits, 32)
    x = rng.standard_normal((12, k)).astype(np.float32)
    alone = np.stack([product(x[i:i + 1], codes, scales, n, k, bits, 32, path=path)[0] for i in range(12)])
    for rows in range(1, 13):
        for threads in (1, 2, 3):
            together = product(x[:rows], codes, scales, n, k, bits, 32, path=path, threads=threads)
            assert np.array_equal(together, alone[:rows]), (rows, threads)


def test_paths_agree_within_rounding():
    """Every path against the portable one: the same sums up to float rounding (avx2 and avx-vnni spread a
    superblock's integer over vector lanes before scaling it)."""
    rng = np.random.default_rng(7)
    for bits in (4, 8):
        codes, scales = weights(rng, 64, 512, bits, 32)
        x = rng.standard_normal((4, 512)).astype(np.float32)
        portable = product(x, codes, scales, 64, 512, bits, 32, path="portable")
        for path in PATHS:
            assert np.allclose(product(x, codes, scales, 64, 512, bits, 32, path=path), portable, rtol=1e-5, atol=1e-5), path


def test_the_avx2_stand_in_is_the_avx_vnni_path_bit_for_bit():
    """avx-vnni-standin replaces each AVX-VNNI instruction by an exact AVX2 equivalent: on a CPU with
    AVX-VNNI both give the same bits (so the stand-in's tests, which run on any AVX2 CPU, test that path)."""
    if "avx-vnni" not in PATHS:
        pytest.skip("this CPU has no AVX-VNNI")
    rng = np.random.default_rng(11)
    for bits in (4, 8):
        codes, scales = weights(rng, 93, 1000, bits, 32)
        x = (rng.standard_normal((5, 1000)) * 40).astype(np.float32)
        real, stand_in = (product(x, codes, scales, 93, 1000, bits, 32, path=p) for p in ("avx-vnni", "avx-vnni-standin"))
        assert np.array_equal(real, stand_in)


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
    with pytest.raises(KernelError, match="code -3"):  # a path of the other architecture
        KERNEL.product(x, codes, scales, n=8, k=64, bits=4, block_size=32, path="dotprod" if "avx2" in PATHS else "avx2")
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
