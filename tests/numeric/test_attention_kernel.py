"""speedc's attention over the KV-cache pool (runtimes/kernels/attention.h) against a float64 reference
written from the published description (Hugging Face's half-split rope, scaled dot products, softmax,
grouped kv heads): it writes each token's rotated key and its value at the token's position, rounded to
the cache's type (int8: a scale per block of 32 values, max |x| / 127, and rounded codes), then attends
over positions 0..p of the row's own cache rows. The description fixes one order of operations, so a
token attends bitwise the same alone, in a chunk, among any rows, on any thread count and on every path
(what SPEED == plain decoding needs)."""

from __future__ import annotations

import numpy as np
import pytest

from speedc.format import contract
from speedc.runtimes.kernels import native
from speedc.runtimes.kernels.native import KernelError

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no native kernel here: {native.unavailable_reason()}")
PATHS = [p for p in KERNEL.paths if p not in native.STAND_INS] if KERNEL is not None else []
HEADS, KV_HEADS, HD, THETA, T = 4, 2, 64, 10000.0, 40
CACHES = ("float16", "float32", "int8")
SCALES = HD // 32  # int8 rows: [SCALES float32 scales | HD int8 codes]


def bound(**kw):
    return KERNEL.attention_bound(heads=HEADS, kv_heads=KV_HEADS, head_dim=HD, inv_freq=contract.rotary_inv_freq(HD, THETA),
                                  positions=T, **kw)


def quantize(x: np.ndarray) -> np.ndarray:
    """Float rows [..., HD] as int8 cache rows [..., HD + HD / 8] (uint8): per block of 32, scale = max |x| / 127."""
    blocks = x.reshape(*x.shape[:-1], SCALES, 32).astype(np.float64)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    codes = np.rint(np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale > 0)).astype(np.int8)
    rows = np.concatenate([scale[..., 0].astype(np.float32).view(np.uint8).reshape(*x.shape[:-1], 4 * SCALES),
                           codes.reshape(*x.shape[:-1], HD).view(np.uint8)], -1)
    return np.ascontiguousarray(rows)


def values(cache: np.ndarray) -> np.ndarray:
    """The float64 values a cache holds (int8 rows: code * scale)."""
    if cache.dtype != np.uint8:
        return cache.astype(np.float64)
    scale = np.ascontiguousarray(cache[..., :4 * SCALES]).view(np.float32).astype(np.float64)
    codes = np.ascontiguousarray(cache[..., 4 * SCALES:]).view(np.int8).astype(np.float64)
    return (codes.reshape(*codes.shape[:-1], SCALES, 32) * scale[..., None]).reshape(codes.shape)


def rope_reference(x: np.ndarray, p: int) -> np.ndarray:
    """x [.., hd] rotated at position p: x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]."""
    inv_freq = 1.0 / THETA ** (np.arange(0, HD, 2, dtype=np.float64) / HD)
    angle = np.concatenate([p * inv_freq, p * inv_freq])
    half = HD // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(angle) + rotated * np.sin(angle)


def split(qkv):
    rows, chunk, _ = qkv.shape
    q = qkv[..., :HEADS * HD].reshape(rows, chunk, HEADS, HD).astype(np.float64)
    k = qkv[..., HEADS * HD:(HEADS + KV_HEADS) * HD].reshape(rows, chunk, KV_HEADS, HD).astype(np.float64)
    v = qkv[..., (HEADS + KV_HEADS) * HD:].reshape(rows, chunk, KV_HEADS, HD).astype(np.float64)
    return q, k, v


def written(qkv, pos, lengths):
    """{(r, p): (rotated key [kvh, HD], value [kvh, HD])} of every real token, in float64."""
    _, k, v = split(qkv)
    return {(r, pos[r] + i): (rope_reference(k[r, i], pos[r] + i), v[r, i]) for r in range(len(pos)) for i in range(lengths[r])}


def attend_reference(qkv, row_of, pos, lengths, key, value):
    """out [R, L, h hd] in float64 over the cache values KEY / VALUE hold (after the writes)."""
    q, _, _ = split(qkv)
    keys, vals = values(key), values(value)
    out = np.zeros((qkv.shape[0], qkv.shape[1], HEADS * HD))
    for r in range(qkv.shape[0]):
        for i in range(lengths[r]):
            p = pos[r] + i
            for h in range(HEADS):
                g = h // (HEADS // KV_HEADS)
                scores = keys[row_of[r], g, :p + 1] @ rope_reference(q[r, i, h], p) / np.sqrt(HD)
                weights = np.exp(scores - scores.max())
                out[r, i, h * HD:(h + 1) * HD] = weights @ vals[row_of[r], g, :p + 1] / weights.sum()
    return out


def case(cache, rows=3, chunk=5, seed=0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((rows, chunk, (HEADS + 2 * KV_HEADS) * HD)).astype(np.float32)
    cache_rows = rows + 2
    key, value = (rng.standard_normal((cache_rows, KV_HEADS, T, HD)) * s for s in (0.5, 1.0))
    key, value = ((quantize(x) if cache == "int8" else x.astype(cache)) for x in (key, value))
    row_of = rng.permutation(cache_rows)[:rows].astype(np.int64)
    pos = rng.integers(0, T - chunk, rows).astype(np.int64)
    lengths = rng.integers(1, chunk + 1, rows).astype(np.int64)
    return qkv, row_of, pos, lengths, key, value


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache", CACHES)
def test_writes_and_attention_match_the_float64_reference(path, cache):
    qkv, row_of, pos, lengths, key, value = case(cache)
    before = key.copy()
    got = bound(path=path)(qkv, row_of, pos, lengths, key, value)
    # the writes: the rotated key and the value rounded to the cache's type, exactly where the description says
    # (relative to each block of 32 values' largest; float32: the rotation's own float32 rounding at these positions)
    step = {"float16": 2.0 ** -10, "float32": 2.0 ** -16, "int8": 1 / 127}[cache]
    for (r, p), (k, v) in written(qkv, pos, lengths).items():
        for stored, want in ((key, k), (value, v)):
            largest = np.repeat(np.abs(want).reshape(KV_HEADS, -1, 32).max(-1), 32, -1)
            assert np.all(np.abs(values(stored[row_of[r], :, p]) - want) <= step * largest), (cache, r, p)
    untouched = np.ones(key.shape[:3], bool)
    for r in range(len(row_of)):
        untouched[row_of[r], :, pos[r]:pos[r] + lengths[r]] = False
    assert np.array_equal(key[untouched], before[untouched])
    # the attention: over what the cache holds after the writes, to float32 rounding of the description's order
    assert np.allclose(got, attend_reference(qkv, row_of, pos, lengths, key, value), rtol=1e-4, atol=1e-4)
    for r in range(len(row_of)):  # a right-padded chunk's tokens past the row's length: 0, nothing written
        assert not got[r, lengths[r]:].any()


@pytest.mark.parametrize("cache", CACHES)
def test_a_token_attends_the_same_alone_in_a_chunk_among_rows_on_any_thread_count_and_path(cache):
    """Plain decoding's token alone against the same token in a prefill chunk and among a step's rows."""
    qkv, row_of, pos, lengths, key, value = case(cache, rows=4, chunk=6, seed=1)
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


@pytest.mark.parametrize("hd, cache", [(40, "float16"), (144, "float32"), (160, "int8"), (128, "float16")])
def test_head_sizes_of_every_register_split_attend_the_same_on_every_path(hd, cache):
    """Head sizes the vector paths split differently (hd / 16 odd: AVX2's tail; values past 128: AVX-512's second
    pass), over more positions than a register holds: every path, alone and in a chunk, gives the same bits."""
    rng = np.random.default_rng(hd)
    heads, kv_heads, positions, rows, chunk = 2, 1, 90, 2, 6
    qkv = rng.standard_normal((rows, chunk, (heads + 2 * kv_heads) * hd)).astype(np.float32)
    if cache == "int8":
        width = native.kv_row_width("int8", hd)
        key = rng.integers(0, 256, (rows, kv_heads, positions, width), dtype=np.uint8)
        key[..., :4 * (hd // 32)] = np.full((rows, kv_heads, positions, hd // 32), 0.02, np.float32).view(np.uint8)
    else:
        key = rng.standard_normal((rows, kv_heads, positions, hd)).astype(cache)
    value = key[::-1].copy()
    row_of, pos = np.arange(rows, dtype=np.int64), np.array([70, 3], np.int64)
    runs = {}
    for path in PATHS:
        attention = KERNEL.attention_bound(heads=heads, kv_heads=kv_heads, head_dim=hd, inv_freq=contract.rotary_inv_freq(hd, THETA),
                                           positions=positions, path=path)
        k, v = key.copy(), value.copy()
        runs[path, "chunk"] = attention(qkv, row_of, pos, np.full(rows, chunk, np.int64), k, v)
        k, v = key.copy(), value.copy()
        runs[path, "alone"] = np.stack([np.concatenate([attention(np.ascontiguousarray(qkv[r:r + 1, i:i + 1]), row_of[r:r + 1],
                                                                  pos[r:r + 1] + i, np.ones(1, np.int64), k, v)[0]
                                                        for i in range(chunk)]) for r in range(rows)])
    assert np.isfinite(runs[PATHS[0], "chunk"]).all() and np.abs(runs[PATHS[0], "chunk"]).max() > 0
    for name, out in runs.items():
        assert np.array_equal(out, runs[PATHS[0], "chunk"]), name


def test_bad_arguments_are_refused_not_run():
    qkv, row_of, pos, lengths, key, value = case("float16")
    attention = bound()
    with pytest.raises(KernelError, match="code -2"):  # past the cache's positions
        attention(qkv, row_of, np.full(3, T - 1, np.int64), np.full(3, 5, np.int64), key, value)
    with pytest.raises(KernelError, match="code -2"):  # a cache row it does not have
        attention(qkv, np.array([0, 1, 9], np.int64), pos, lengths, key, value)
    with pytest.raises(KernelError, match="one dtype"):
        attention(qkv, row_of, pos, lengths, key, value.astype(np.float32))
    with pytest.raises(KernelError, match="qkv must be"):
        attention(qkv[:, :, :-1].copy(), row_of, pos, lengths, key, value)
    with pytest.raises(KernelError, match="int8: 72"):  # int8 rows of the wrong width
        attention(qkv, row_of, pos, lengths, *(np.zeros((5, KV_HEADS, T, HD), np.uint8) for _ in range(2)))
