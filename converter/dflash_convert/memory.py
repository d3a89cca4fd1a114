"""Process-level allocator tuning for the CLI (glibc only; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_chunks() -> bool:
    """Let glibc reuse freed chunk buffers instead of unmapping and re-faulting them.

    By default glibc serves every allocation above 128 KB with a fresh mmap and
    unmaps it on free, so each multi-MB chunk buffer is page-faulted again:
    measured on the 1 GB benchmark, this halves conversion speed. Serve up to
    32 MB (glibc's maximum) from the heap and keep up to 512 MB of free heap.
    Called by the CLI only (it changes the whole process's allocator).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (e.g. musl)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 512 << 20) == 1
    return bool(ok)
