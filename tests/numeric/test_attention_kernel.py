"""speedc's attention over the KV-cache pool (runtimes/kernels/attention.h) against a float64 reference
written from the published description (Hugging Face's half-split rope, scaled dot products, softmax,
grouped kv heads): it writes each token's rotated key and its value at the token's position, rounded to
the cache's type, then attends over positions 0..p of the row's own cache rows. The description fixes
one order of operations, so a token attends bitwise the same alone, in a chunk, among any rows, on any
thread count and on every path (what SPEED == plain decoding needs)."""

from __future__ import annotations

import numpy as np
import pytest

from speedc.runtimes.kernels import native
from speedc.runtimes.kernels.native import KernelError

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no native kernel here: {native.unavailable_reason()}")
PATHS = [p for p in KERNEL.paths if p not in native.STAND_INS] if KERNEL is not None else []
HEADS, KV_HEADS, HD, THETA, T = 4, 2, 32, 10000.0, 40


def bound(**kw):
    return KERNEL.attention_bound(heads=HEADS, kv_heads=KV_HEADS, head_dim=HD, theta=THETA, positions=T, **kw)


def rope_reference(x: np.ndarray, p: int) -> np.ndarray:
    """x [.., hd] rotated at position p: x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]."""
    inv_freq = 1.0 / THETA ** (np.arange(0, HD, 2, dtype=np.float64) / HD)
    angle = np.concatenate([p * inv_freq, p * inv_freq])
    half = HD // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(angle) + rotated * np.sin(angle)


def reference(qkv, row_of, pos, lengths, key, value):
    """(out [R, L, h hd], key, value after the writes), in float64 from the description."""
    key, value = key.copy(), value.copy()
    rows, chunk, _ = qkv.shape
    q = qkv[..., :HEADS * HD].reshape(rows, chunk, HEADS, HD).astype(np.float64)
    k = qkv[..., HEADS * HD:(HEADS + KV_HEADS) * HD].reshape(rows, chunk, KV_HEADS, HD).astype(np.float64)
    v = qkv[..., (HEADS + KV_HEADS) * HD:].reshape(rows, chunk, KV_HEADS, HD)
    for r in range(rows):
        for i in range(lengths[r]):
            p = pos[r] + i
            key[row_of[r], :, p] = rope_reference(k[r, i], p).astype(key.dtype)
            value[row_of[r], :, p] = v[r, i].astype(value.dtype)
    out = np.zeros((rows, chunk, HEADS * HD))
    for r in range(rows):
        for i in range(lengths[r]):
            p = pos[r] + i
            for h in range(HEADS):
                g = h // (HEADS // KV_HEADS)
                scores = key[row_of[r], g, :p + 1].astype(np.float64) @ rope_reference(q[r, i, h], p) / np.sqrt(HD)
                weights = np.exp(scores - scores.max())
                out[r, i, h * HD:(h + 1) * HD] = weights @ value[row_of[r], g, :p + 1].astype(np.float64) / weights.sum()
    return out, key, value


def case(dtype, rows=3, chunk=5, seed=0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((rows, chunk, (HEADS + 2 * KV_HEADS) * HD)).astype(np.float32)
    cache_rows = rows + 2
    key = (rng.standard_normal((cache_rows, KV_HEADS, T, HD)) * 0.5).astype(dtype)
    value = rng.standard_normal((cache_rows, KV_HEADS, T, HD)).astype(dtype)
    row_of = rng.permutation(cache_rows)[:rows].astype(np.int64)
    pos = rng.integers(0, T - chunk, rows).astype(np.int64)
    lengths = rng.integers(1, chunk + 1, rows).astype(np.int64)
    return qkv, row_of, pos, lengths, key, value


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_writes_and_attention_match_the_float64_reference(path, dtype):
    qkv, row_of, pos, lengths, key, value = case(dtype)
    want, want_key, want_value = reference(qkv, row_of, pos, lengths, key, value)
    got = bound(path=path)(qkv, row_of, pos, lengths, key, value)
    # the writes: the rotated key and the value rounded to the cache's type, exactly where the description says
    assert np.allclose(key.astype(np.float64), want_key.astype(np.float64), rtol=2e-3 if dtype == np.float16 else 1e-5,
                       atol=1e-3 if dtype == np.float16 else 1e-5)
    assert np.array_equal(value, want_value)
    untouched = np.ones(key.shape[:3], bool)
    for r in range(len(row_of)):
        untouched[row_of[r], :, pos[r]:pos[r] + lengths[r]] = False
    assert np.array_equal(key[untouched], case(dtype)[4][untouched])
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4 if dtype == np.float32 else 2e-3)
    for r in range(len(row_of)):  # a right-padded chunk's tokens past the row's length: 0, nothing written
        assert not got[r, lengths[r]:].any()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_token_attends_the_same_alone_in_a_chunk_among_rows_on_any_thread_count_and_path(dtype):
    """Plain decoding's token alone against the same token in a prefill chunk and among a step's rows."""
    qkv, row_of, pos, lengths, key, value = case(dtype, rows=4, chunk=6, seed=1)
    lengths[:] = 6
    runs = {}
    for path in PATHS:
        for threads in (1, 2, 3):
            k, v = key.copy(), value.copy()
            runs[path, threads, "together"] = bound(path=path, threads=threads)(qkv, row_of, pos, lengths, k, v)
            k2, v2 = key.copy(), value.copy()
            alone = np.zeros_like(runs[path, threads, "together"])
            for i in range(6):  # token by token, rows in reverse order, each alone
                for r in reversed(range(4)):
                    one = np.ascontiguousarray(qkv[r:r + 1, i:i + 1])
                    alone[r, i] = bound(path=path, threads=threads)(one, row_of[r:r + 1], pos[r:r + 1] + i,
                                                                    np.ones(1, np.int64), k2, v2)[0, 0]
            runs[path, threads, "alone"] = alone
            assert np.array_equal(k, k2) and np.array_equal(v, v2)
    first = next(iter(runs.values()))
    for name, out in runs.items():
        assert np.array_equal(out, first), name


def test_bad_arguments_are_refused_not_run():
    qkv, row_of, pos, lengths, key, value = case(np.float16)
    attention = bound()
    with pytest.raises(KernelError, match="code -2"):  # past the cache's positions
        attention(qkv, row_of, np.full(3, T - 1, np.int64), np.full(3, 5, np.int64), key, value)
    with pytest.raises(KernelError, match="code -2"):  # a cache row it does not have
        attention(qkv, np.array([0, 1, 9], np.int64), pos, lengths, key, value)
    with pytest.raises(KernelError, match="one dtype"):
        attention(qkv, row_of, pos, lengths, key, value.astype(np.float32))
    with pytest.raises(KernelError, match="qkv must be"):
        attention(qkv[:, :, :-1].copy(), row_of, pos, lengths, key, value)
