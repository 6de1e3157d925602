"""runtimes/heap.py: memory freed inside the heap goes back to the OS (glibc's malloc_trim)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from speedc.runtimes.heap import return_freed_memory


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"), reason="glibc only")
def test_freed_heap_pages_go_back_to_the_os():
    """200 MB in 100 KB blocks (below glibc's mmap threshold: inside the heap), all freed but the last, which
    pins the heap's top: glibc keeps the freed pages (RSS stays up) until return_freed_memory."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = 100 << 10
    blocks = [libc.malloc(block) for _ in range(2000)]
    for address in blocks:
        ctypes.memset(address, 1, block)
    for address in blocks[:-1]:
        libc.free(address)
    kept = rss_mb()
    return_freed_memory()
    returned = rss_mb()
    libc.free(blocks[-1])
    assert kept - returned > 150, (kept, returned)
