"""Host memory for a CPU worker: the KV cache on transparent huge pages, and freed activations kept.

Paged attention reads each sequence's K/V a block at a time from blocks scattered over the whole
pool: one 4 KiB page per block and head, so with ordinary pages nearly every block read misses
the TLB as well as the caches. On 2 AVX-512 AMD EPYC cores, SmolLM2's decode attention over a
1 GiB pool read 14 GB/s on 2 MiB pages against 11.7 on 4 KiB ones (20.6 against 15.1 with the
kernel's prefetching). Linux hands out huge pages for a range the process marks with
``madvise(MADV_HUGEPAGE)`` when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise``; elsewhere the memory is the same, on ordinary pages.

A step's activations are freed and allocated again every step. glibc's malloc serves blocks above
its mmap threshold (128 KiB, rising to at most 32 MiB as such blocks are freed) from fresh
mappings and hands freed heap tops back to the kernel, so each step faulted in and zeroed its
activations page by page again: about a million page faults in a W6 quick run of SmolLM2.
:func:`retain_freed_memory` keeps them in the heap instead (317k faults; 2-4 % more tokens/s in
alternating runs).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger("raypaged")

HUGE_PAGE_BYTES = 2 << 20
# glibc mallopt parameters and the values retain_freed_memory sets
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_SETTINGS = {
    _M_MMAP_THRESHOLD: 32 << 20,  # blocks up to 32 MiB (glibc's most) come from the heap
    _M_TRIM_THRESHOLD: 128 << 20,  # a free heap top is handed back once it exceeds 128 MiB
    _M_TOP_PAD: 64 << 20,  # the heap grows 64 MiB at a time
}
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this kernel gives a range marked ``MADV_HUGEPAGE`` transparent huge pages."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU in a fresh private mapping (never reused heap
    pages, whatever malloc's settings), starting on a huge-page boundary and marked for huge pages
    before it is first written (up to a page more is mapped for the alignment, and up to another
    to end on a whole page). The tensor keeps the mapping alive."""
    if not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # whole huge pages
    mapping = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, length)
    except OSError as e:
        logger.debug("madvise(MADV_HUGEPAGE) failed (%s): the KV cache stays on ordinary pages", e)
    return raw[offset : offset + nbytes].view(dtype).view(shape).zero_()


def retain_freed_memory() -> bool:
    """Make glibc's malloc keep freed activations for the next step (:data:`MALLOC_SETTINGS`) in this
    process; False where the C library is not glibc (nothing changes)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in MALLOC_SETTINGS.items())
