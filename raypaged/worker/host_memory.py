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
:func:`retain_freed_memory` keeps them in the heap instead (345k faults; 3-4 % more tokens/s).
"""

from __future__ import annotations

import ctypes
import logging
import math
import platform
import sys
from pathlib import Path

import torch

logger = logging.getLogger("raypaged")

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
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
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, its memory starting on a huge-page boundary and
    marked for huge pages before it is first written (up to a page more is allocated for the alignment
    and up to another to end on a whole page)."""
    if not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    nbytes = numel * itemsize
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # whole huge pages
    raw = torch.empty(length + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    if _madvise(raw.data_ptr() + offset, length) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): the KV cache stays on ordinary pages",
                     ctypes.get_errno())
    return raw[offset:offset + nbytes].view(dtype).view(shape).zero_()


def retain_freed_memory() -> bool:
    """Make glibc's malloc keep freed activations for the next step (:data:`MALLOC_SETTINGS`) in this
    process; False where the C library is not glibc (nothing changes)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = _libc().mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(parameter, value) == 1 for parameter, value in MALLOC_SETTINGS.items())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _madvise(address: int, length: int) -> int:
    madvise = _libc().madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(address, length, _MADV_HUGEPAGE)
