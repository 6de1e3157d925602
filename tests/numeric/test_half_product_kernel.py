"""speedc's 16-bit weight products (runtimes/kernels/half_product.h) against float64: y = x . W^T with W
bf16 or fp16 read in place. The description fixes one summation order (64 lanes, lane l takes k = l,
l + 64, ... by fused multiply-adds, then a fixed tree), so every path gives the portable path's bits, a
row sums the same alone or among any rows on any thread count, and the error stays within float32
rounding of that order."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from speedc.runtimes.kernels import native
from speedc.runtimes.kernels.native import KernelError

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no native kernel here: {native.unavailable_reason()}")
PATHS = KERNEL.paths if KERNEL is not None else []
DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def product(x, w, dtype, **kw):
    n, k = w.shape
    return KERNEL.half_bound(w.view(np.uint16), n=n, k=k, dtype=dtype, **kw)(np.ascontiguousarray(x, np.float32))


def lanes_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The description's order in float64 per lane, then the tree (what float32 rounding is measured from)."""
    k = x.shape[1]
    lanes = np.stack([x[:, l::64].astype(np.float64) @ w[:, l::64].astype(np.float64).T for l in range(min(64, k))], -1)
    lanes = np.concatenate([lanes, np.zeros((*lanes.shape[:2], 64 - lanes.shape[-1]))], -1)
    for width in (32, 16, 8, 4, 2, 1):
        lanes = lanes[..., :width] + lanes[..., width:2 * width]
    return lanes[..., 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(37, 256), (203, 1000), (5, 7), (16, 70)])
def test_within_float32_rounding_of_float64(dtype, n, k):
    rng = np.random.default_rng(n + k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(DTYPES[dtype])
    x = rng.standard_normal((9, k)).astype(np.float32)
    y = product(x, w, dtype).astype(np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    # a lane of ceil(k / 64) fused multiply-adds, then 6 adds: each rounding within 2^-24 of a partial sum
    assert np.all(np.abs(y - exact) <= (-(-k // 64) + 6) * 2.0 ** -24 * magnitude)
    assert np.allclose(y, lanes_reference(x, w), rtol=1e-6, atol=1e-6 * magnitude.max())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_gives_the_portable_bits_alone_among_rows_and_on_any_thread_count(path, dtype):
    rng = np.random.default_rng(3)
    n, k = 83, 1000  # a tail of 40 values past the last 64
    w = rng.standard_normal((n, k)).astype(DTYPES[dtype])
    x = (rng.standard_normal((12, k)) * 3).astype(np.float32)
    portable = product(x, w, dtype, path="portable")
    alone = np.stack([product(x[i:i + 1], w, dtype, path=path)[0] for i in range(12)])
    assert np.array_equal(alone, portable)
    for rows in (1, 2, 5, 8, 9, 12):
        for threads in (1, 3):
            assert np.array_equal(product(x[:rows], w, dtype, path=path, threads=threads), portable[:rows]), (rows, threads)


def test_fp16_values_convert_exactly_subnormals_and_specials_included():
    """Each fp16 weight becomes float32 exactly: a product of one value 1 reads each weight back alone."""
    bits = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xC000, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x8001,
                     0x1234, 0xABCD, 0x3555, 0x0200], np.uint16)
    w = bits.view(np.float16).reshape(-1, 1)  # [16 features, k = 1]
    x = np.ones((1, 1), np.float32)
    for path in PATHS:
        y = product(x, w, "fp16", path=path)[0]
        want = w[:, 0].astype(np.float32)
        assert np.array_equal(np.isnan(y), np.isnan(want)) and np.array_equal(y[~np.isnan(want)], want[~np.isnan(want)]), path


def test_arguments_it_does_not_take_are_refused():
    w = np.zeros((4, 8), np.float16)
    with pytest.raises(KernelError, match="bf16 or fp16"):
        KERNEL.half_bound(w.view(np.uint16), n=4, k=8, dtype="fp8")
    with pytest.raises(KernelError, match=r"16-bit \[4, 9\]"):
        KERNEL.half_bound(w.view(np.uint16), n=4, k=9, dtype="fp16")
    with pytest.raises(KernelError, match="C-contiguous float32"):
        KERNEL.half_bound(w.view(np.uint16), n=4, k=8, dtype="fp16")(np.zeros((2, 8), np.float64))
