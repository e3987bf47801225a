"""Keep freed memory in the process for reuse (glibc), so that a round's updates do not page-fault.

A round holds every client's update until it aggregates them, then frees them all. glibc's malloc
gives such a block back to the operating system (``munmap``, or trimming the top of the heap), so
the next round's updates land in fresh pages, and each first touch of a page is a page fault the
kernel serves by zeroing it. Measured on a 2-core Xeon (MLP 784-200-10, 636 kB of weights, rounds
of one-step clients at batch 32): 140-250 minor page faults per client, costing 0.1-0.45 ms of a
client's 1.1 ms; with the two settings below there were none. A real run: docs/performance/speed.md.

Evaluation pays the same way: a forward pass of the default CNN over a 1024-row batch allocates
activations of about 100 MB each, above glibc's largest default threshold (32 MiB), so each one was a
fresh ``mmap`` the kernel zero-filled page by page: forward passes ran at 1,250-1,450 rows/s per process
on two cores, and at 1,700-2,300 with the threshold at 1 GiB (docs/performance/floor.md).

[`keep_freed_memory()`][fedmerge.engines.memory.keep_freed_memory] fixes glibc's mmap threshold at 1 GiB
(blocks up to that size come from the heap; a glibc that refuses it, older than 2.26, gets its own
maximum, 32 MiB) and raises its trim threshold, so freed blocks stay in the process and are reused. The
process then keeps its peak memory until it exits, as jemalloc or tcmalloc would. Worker processes
are forked, so they inherit the settings. Other C libraries (macOS, musl) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1024 * 1024 * 1024  # an evaluation batch's activations (100 MB for the CNN at 1024 rows) fit
FALLBACK_MMAP_THRESHOLD = 32 * 1024 * 1024  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: what an old glibc accepts
TRIM_THRESHOLD = 2**31 - 1  # an int; a whole round's updates (up to 2 GiB) stay for the next round

_applied: bool | None = None
mmap_threshold: int | None = None  # the threshold glibc accepted, once applied


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (once per process); True when it applies."""
    global _applied
    if _applied is None:
        _applied = _mallopt()
        if _applied:
            log.debug("glibc malloc: mmap threshold %d, trim threshold %d", mmap_threshold, TRIM_THRESHOLD)
    return _applied


def _mallopt() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl and macOS have other settings)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Fixing the mmap threshold also stops glibc from adjusting both thresholds by itself.
    global mmap_threshold
    mmap_threshold = next((n for n in (MMAP_THRESHOLD, FALLBACK_MMAP_THRESHOLD) if mallopt(_M_MMAP_THRESHOLD, n)), None)
    return mmap_threshold is not None and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
