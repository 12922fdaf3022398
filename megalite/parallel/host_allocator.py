"""How the C library hands out host memory to a training process: large blocks mapped on their own.

glibc's malloc serves a block of at least its mmap threshold with a mapping of its own, given back to the
system when freed; smaller blocks come from its heap, which keeps freed memory for reuse and can return only
the free space at its top. The threshold starts at 128 KiB and by default rises to the size of each mapped
block freed (up to 32 MiB), so after the first bucket-sized buffer is freed every later one comes from the
heap. Training frees such buffers many times a step: ZeRO-3 a layer's gathered parameters twice per micro
batch and a gradient bucket once (and gloo copies each reduce-scatter's input), ZeRO-2 its gradient buckets.
In the heap the holes they leave are split by the small allocations between them, so the heap grows while
little is alive in it. On a 12.9M-parameter GPT-2 shape on 2 gloo ranks (docs/benchmarks.md), ZeRO-3 peaked
at 782 MiB resident against ZeRO-1's 557, with 245 MiB free inside the heap after a step, though the tensors
alive at its peak were fewer than ZeRO-1's (tests/test_zero.py counts them). Fixing the threshold stops the
rise: blocks of `MAPPED_FROM` bytes and more are mapped and returned when freed (ZeRO-3 then peaks at 528 MiB,
below ZeRO-1's 537). The price is a fresh, zeroed mapping for each such block, which stage 2 paid already for
its buckets above 32 MiB.

A GPU's memory has its own caching allocator; on a GPU run this governs only the host's share (the data, the
offloaded optimizer state is pinned by CUDA's host allocator). Other C libraries are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

MAPPED_FROM = 1 << 20  # bytes: blocks this large or larger get a mapping of their own
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h, glibc 2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc() -> ctypes.CDLL | None:
    return ctypes.CDLL(ctypes.util.find_library("c")) if platform.libc_ver()[0] == "glibc" else None


def map_large_blocks() -> bool:
    """Give host blocks of MAPPED_FROM bytes or more mappings of their own, returned to the system when freed;
    returns whether the C library took the setting (glibc does; others are left alone)."""
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_FROM) == 1


def heap_free_bytes() -> int | None:
    """The bytes free inside the C library's heap: memory this process holds resident though nothing uses it
    (None where the C library does not say: not glibc, or one older than 2.33)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().fordblks
