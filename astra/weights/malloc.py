"""Keeps freed heap memory in the process instead of handing it back to the kernel.

The weight streams allocate and free a few MiB per message (gRPC's receive
buffers, the bytes of each chunk). glibc serves such sizes with fresh
mappings, or trims the heap when they are freed, so every message faults in
new zeroed pages; on a VM a page fault costs more than copying the page.
Raising glibc's mmap and trim thresholds (mallopt) makes those blocks come
back from the heap already faulted. Process-wide, once, and only where glibc
is the allocator; a no-op elsewhere. The process keeps at most the trim
threshold of free memory mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed: blocks below it come from the heap
TRIM_THRESHOLD = 256 << 20  # free memory kept before the heap is trimmed

_done = False
_lock = threading.Lock()


def keep_freed_memory() -> bool:
    """Sets the thresholds once per process; True when glibc took them."""
    global _done
    with _lock:
        if _done:
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
        return _done
