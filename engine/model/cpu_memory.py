"""Keep freed memory in the process on Linux/glibc.

glibc hands large blocks (above a few MB) straight back to the kernel when they are freed,
so every step's big temporaries (gathered KV, prefill activations) are page-faulted in
again, zero-filled, the next step: on CPU that costs more than the attention math itself.
Raising the mmap and trim thresholds makes those blocks reusable. It is process-wide, as
an allocator choice (jemalloc, tcmalloc) would be."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # never give the heap's top back to the kernel

_done = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once; False where there is no glibc (nothing changes)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done
