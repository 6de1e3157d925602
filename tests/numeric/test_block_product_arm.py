"""speedc's kernel on Arm (dotprod, i8mm and portable paths), from this x86 machine: block_product.c is
cross-compiled with a C driver (tests/native/block_product_driver.c) by Debian's aarch64-linux-gnu-gcc and
run under qemu-aarch64 -cpu max, which has dotprod and i8mm. Against test_block_product_kernel.py's numpy
reference: exact where every value is an integer; each row bitwise the same alone and among rows, on 1
and 3 threads; and (the Arm paths scale each superblock's exact integer sum as the portable path does)
bitwise the portable path's result computed here on x86."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from speedc.runtimes.kernels import native
from test_block_product_kernel import exact_case, reference, weights

COMPILER, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
pytestmark = [
    pytest.mark.skipif(platform.machine() in ("aarch64", "arm64"),
                       reason="an Arm host runs these paths in process (test_block_product_kernel.py)"),
    pytest.mark.skipif(COMPILER is None or QEMU is None,
                       reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user)"),
    pytest.mark.skipif(native.load() is None, reason=f"no native kernel here: {native.unavailable_reason()}"),
]
ROOT = Path(__file__).resolve().parents[2]
ARM_PATHS = ("portable", "dotprod", "i8mm")


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arm") / "block_product_driver"
    built = subprocess.run([COMPILER, "-O3", "-static", "-pthread", "-ffp-contract=off", "-std=gnu11", "-o", str(out),
                            str(ROOT / "tests" / "native" / "block_product_driver.c"), str(native.SOURCE)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return out


def run_arm(driver: Path, folder: Path, x, codes, scales, *, k: int, bits: int, block_size: int, path: str, threads: int):
    """(auto path, paths this CPU runs, y of all rows in one call, y of each row alone) from the driver."""
    m, n = x.shape[0], codes.shape[0]
    blocks = -(-k // block_size)
    operands = folder / "in.bin"
    with operands.open("wb") as f:
        f.write(np.array([m, n, k, blocks], np.int64).tobytes() + np.array([block_size, bits], np.int32).tobytes())
        f.write(np.ascontiguousarray(x, np.float32).tobytes() + codes.tobytes() + scales.tobytes())
    result = subprocess.run([QEMU, "-cpu", "max", str(driver), str(operands), str(folder / "out.bin"),
                             str(native.PATHS[path]), str(threads)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    raw = (folder / "out.bin").read_bytes()
    chosen, paths = int(np.frombuffer(raw, np.int32, 1)[0]), int(np.frombuffer(raw, np.uint32, 1, 4)[0])
    ys = np.frombuffer(raw, np.float32, 2 * m * n, 8).reshape(2, m, n)
    return native.PATH_NAMES[chosen], [name for name, code in native.PATHS.items() if code and paths >> code & 1], ys[0], ys[1]


def test_qemu_reports_dotprod_and_i8mm_and_auto_takes_i8mm(driver, tmp_path):
    x = np.ones((1, 64), np.float32)
    codes, scales = weights(np.random.default_rng(0), 4, 64, 4, 32)
    chosen, paths, _, _ = run_arm(driver, tmp_path, x, codes, scales, k=64, bits=4, block_size=32, path="auto", threads=1)
    assert paths == ["portable", "dotprod", "i8mm"] and chosen == "i8mm"


@pytest.mark.parametrize("bits,block_size,k", [(4, 32, 256), (4, 128, 300), (4, 32, 70), (8, 32, 256), (8, 64, 70)])
def test_integer_sums_are_exact_and_rows_invariant(driver, tmp_path, bits, block_size, k):
    """The exact case of test_block_product_kernel.py (every float an integer times 2^-11 below 2^24) on
    each Arm path, 1 and 3 threads: y is the exact sum, every row the same alone and among 7 rows
    (i8mm pairs rows and features: an odd count of each is covered)."""
    x, codes, scales = exact_case(k, bits, block_size, n=37, m=7)
    expected = reference(x, codes, scales, bits, block_size)[0].astype(np.float32)
    for path in ARM_PATHS:
        for threads in (1, 3):
            _, _, together, alone = run_arm(driver, tmp_path, x, codes, scales, k=k, bits=bits, block_size=block_size,
                                            path=path, threads=threads)
            assert np.array_equal(together, expected), (path, threads)
            assert np.array_equal(alone, together), (path, threads)


@pytest.mark.parametrize("seed", range(4))
def test_random_operands_give_the_portable_paths_bits(driver, tmp_path, seed):
    """Random weights and activations (one of them with outliers): the Arm paths equal the portable path
    run here bit for bit, row for row, and the reference within rounding."""
    rng = np.random.default_rng(seed)
    bits, block_size = (4, 8)[seed % 2], (32, 64)[seed // 2]
    m, n, k = 1 + 3 * seed, 21 + seed, 352 - 40 * seed
    codes, scales = weights(rng, n, k, bits, block_size)
    x = (rng.standard_normal((m, k)) * (1 + 30 * (seed == 3))).astype(np.float32)
    here = native.load().product(x, codes, scales, n=n, k=k, bits=bits, block_size=block_size, path="portable")
    expected, _, magnitude = reference(x, codes, scales, bits, block_size)
    for path in ARM_PATHS:
        _, _, together, alone = run_arm(driver, tmp_path, x, codes, scales, k=k, bits=bits, block_size=block_size,
                                        path=path, threads=2)
        assert np.array_equal(together, here) and np.array_equal(alone, here), path
        assert np.all(np.abs(together - expected) <= 1e-6 * magnitude + 1e-30)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_products_give_the_portable_bits_of_x86(driver, tmp_path, dtype):
    """The 16-bit products (half_product.h) on aarch64, NEON (dotprod and i8mm CPUs) and portable, give
    x86's portable bits (one summation order, exact conversions, fused multiply-adds), every row the same
    alone and among 9 rows, on 1 and 3 threads."""
    import ml_dtypes

    rng = np.random.default_rng(2)
    n, k, m = 37, 1000, 9
    w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16 if dtype == "bf16" else np.float16)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    x86 = native.load().half_bound(w.view(np.uint16), n=n, k=k, dtype=dtype, path="portable")(x)
    for path, threads in (("i8mm", 1), ("dotprod", 3), ("portable", 3)):
        operands = tmp_path / "in.bin"
        with operands.open("wb") as f:
            f.write(np.array([m, n, k, 0], np.int64).tobytes() + np.array([native.HALF_DTYPES[dtype], 16], np.int32).tobytes())
            f.write(x.tobytes() + w.view(np.uint16).tobytes())
        result = subprocess.run([QEMU, "-cpu", "max", str(driver), str(operands), str(tmp_path / "out.bin"),
                                 str(native.PATHS[path]), str(threads)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        together, alone = np.frombuffer((tmp_path / "out.bin").read_bytes(), np.float32, 2 * m * n, 8).reshape(2, m, n)
        assert np.array_equal(together, x86) and np.array_equal(alone, x86), path
