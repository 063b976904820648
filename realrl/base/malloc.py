"""glibc's malloc held to fixed thresholds in a long-lived process with large, short-lived tensors.

By default glibc serves an allocation above its mmap threshold (128 KiB at start) with a fresh
mmap, and gives it back to the kernel when freed, so the next one faults its pages in again
(a minor fault and a zeroed page each 4 KiB). The threshold rises only when such a block is freed,
so whether a decode step's temporaries (~180 KB and up on the tiny models) fault each time depends
on what the process happened to allocate before. `hold_malloc` fixes the thresholds once: blocks
under `mmap_threshold` come from the heap, and the heap keeps up to `trim_threshold` of free
memory instead of returning it. A no-op where libc has no `mallopt` (not glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def hold_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 128 << 20) -> bool:
    """Set glibc's mmap and trim thresholds (bytes); whether they were set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
