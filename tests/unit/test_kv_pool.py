"""runtimes/backends/kv_pool.py: the one KV-cache pool both backends hold. Its sizes, its hysteresis, a
growth that does not fit, and row moves and copies, on numpy buffers (the ONNX backend's; the PyTorch
backend's are the same calls on tensors, tests/numeric/test_torch_batch_backend.py)."""

from __future__ import annotations

import numpy as np
import pytest

from speedc.errors import GenerationError, OutOfMemory
from speedc.format.cache_layout import CODA, CORE
from speedc.runtimes.backends.kv_pool import KVPool


def shapes(length: int, width: int) -> dict:
    return {CORE: (2, 2, width, 1, length + 1, 4), CODA: (1, 2, width, 1, length + 1, 4)}


def pool(**limits) -> KVPool:
    return KVPool(shapes, lambda shape: np.zeros(shape, np.float32), 4,
                  **{"max_batch": 4, "capacity": 256, "min_length": 8, "shrink_after": 3, **limits})


def test_it_grows_at_once_and_shrinks_only_after_calls_in_a_row_ask_for_less():
    kv = pool()
    assert kv.reserve(5, 1) and (kv.length, kv.width) == (8, 1) and kv.key.shape == (2, 2, 1, 1, 9, 4)
    assert kv.reserve(100, 3) and (kv.length, kv.width) == (104, 4)  # within an eighth; a power of two
    assert not kv.would_grow(100, 3) and kv.would_grow(105, 1) and not kv.would_grow(1, 9)  # max_batch caps W
    kv.key[0, 0, 1, 0, :3] = 7.0
    assert [kv.reserve(10, 2) for _ in range(3)] == [False, False, True]  # the third call in a row shrinks it
    assert (kv.length, kv.width) == (10, 2) and (kv.key[0, 0, 1, 0, :3] == 7.0).all()  # occupied rows kept
    assert not kv.reserve(10)  # the same size: nothing
    assert kv.reserve(40) and (kv.length, kv.width) == (40, 2)  # a growth: at once
    with pytest.raises(GenerationError, match="exceed the KV-cache row of 256"):
        kv.reserve(300, 1)


def test_a_growth_that_does_not_fit_leaves_the_pool_intact():
    sizes = []

    def zeros(shape):
        if shape[4] > 65:
            raise MemoryError
        sizes.append(shape)
        return np.zeros(shape, np.float32)

    kv = KVPool(shapes, zeros, 4, max_batch=4, capacity=1024, where=" on the test device")
    kv.reserve(64, 2)
    before = kv.key
    with pytest.raises(OutOfMemory, match=r"cannot grow to 128 positions x 2 pool rows \(0 MiB on the test device\)"):
        kv.reserve(128, 2)
    assert kv.key is before and (kv.length, kv.width) == (64, 2)


def test_rows_move_and_copy_in_every_phase():
    kv = pool()
    kv.reserve(16, 2)
    for buffer in (*kv.buffers[CORE], *kv.buffers[CODA]):
        buffer[:, :, 1] = np.arange(17, dtype=np.float32)[None, None, None, :, None]
    kv.move(1, 0, length=5)
    assert (kv.value[:, :, 0, :, :5] == kv.value[:, :, 1, :, :5]).all() and not kv.value[:, :, 0, :, 5:].any()
    assert (kv.phase_buffers[CODA][1][:, :, 0, :, :5] == np.arange(5)[None, None, None, :, None]).all()
    saved = kv.read_rows(1, 6)
    assert len(saved) == 4 and all(rows.shape[3] == 6 for rows in saved)
    kv.free()
    assert kv.key is None and (kv.length, kv.width) == (0, 0)
    kv.reserve(16, 2)
    kv.write_rows(0, saved, 6)
    assert (kv.key[:, :, 0, :, :6] == np.arange(6)[None, None, None, :, None]).all() and not kv.key[:, :, 0, :, 6:].any()
