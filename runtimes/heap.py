"""The process heap: freed memory handed back to the OS.

glibc keeps the pages that free() returns, per arena (one per thread that allocates), and gives them back
only from the top of the heap. A server whose requests come and go (a grammar compiled and dropped, a
megabyte body parsed, a pool row's buffers) then holds its high-water mark for good; malloc_trim(0) returns
every free page of every arena. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_trim = None  # libc's malloc_trim once looked up (False: none here)


def return_freed_memory() -> None:
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)
