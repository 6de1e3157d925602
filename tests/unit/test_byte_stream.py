"""The memory floor the kernel's rows are measured against (speedc/bench/floor.py byte_stream)."""

from __future__ import annotations

import numpy as np
import pytest

from speedc.bench.floor import byte_stream


@pytest.mark.parametrize("threads", [1, 3])
def test_byte_stream_reads_every_word_once(threads):
    """The memory floor beside the kernel's rows: every 8-byte word of every array read once, however the
    arrays split across threads (a tail under 8 bytes is not a word): the checksum is their sum mod 2^64."""
    rng = np.random.default_rng(2)
    arrays = [rng.integers(0, 256, size, dtype=np.uint8) for size in (8 * 1001, 8 * 7 + 5, 3)]
    arrays.append(rng.standard_normal((5, 9), dtype=np.float32))  # scales: 180 bytes, 22 words
    expected = sum(int(word) for a in arrays for word in np.frombuffer(a.tobytes()[:a.nbytes // 8 * 8], np.uint64))
    with byte_stream(arrays, threads) as stream:
        assert stream() == stream() == expected % 2 ** 64
