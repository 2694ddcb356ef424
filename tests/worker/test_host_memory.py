"""Host memory of a CPU worker (raypaged.worker.host_memory): the KV cache on transparent huge pages,
freed activations kept in the heap."""

import platform
import subprocess
import sys

import pytest
import torch

from raypaged.worker import host_memory
from raypaged.worker.cache import KVCache
from raypaged.worker.host_memory import HUGE_PAGE_BYTES, huge_pages_available, retain_freed_memory, zeros_on_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off on this machine")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_start_on_a_huge_page_and_are_zero(dtype):
    shape = (2, 3, 37, 4, 16, 8)  # not a whole number of huge pages
    tensor = zeros_on_huge_pages(shape, dtype)
    assert (tensor.shape, tensor.dtype, tensor.is_contiguous()) == (shape, dtype, True)
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not tensor.to(torch.float32).any()


@needs_thp
def test_the_memory_is_backed_by_huge_pages():
    """Also where malloc keeps freed blocks in the heap (a CPU worker's process): the cache is a fresh
    mapping, never heap pages already faulted in small."""
    retain_freed_memory()
    torch.empty(24 << 20, dtype=torch.uint8).fill_(1)  # heap pages, faulted in small and freed
    tensor = zeros_on_huge_pages((8, HUGE_PAGE_BYTES // 4), torch.float32)  # 16 MiB
    assert _anon_huge_kib(tensor.data_ptr()) >= 8 * HUGE_PAGE_BYTES // 1024 // 2  # most of it, at least


def test_without_huge_pages_it_is_plain_zeros(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "_THP_MODE", mode)

    def refuse(*args, **kwargs):
        raise AssertionError("a mapping made with huge pages off")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)
    assert not huge_pages_available()
    tensor = zeros_on_huge_pages((3, 5), torch.float32)
    assert torch.equal(tensor, torch.zeros(3, 5))


@needs_thp
def test_the_cpu_kv_cache_lies_on_huge_pages():
    cache = KVCache(2, 10, 4, (2, 16, 8), torch.float32, torch.device("cpu"))
    assert cache.device_blocks.shape == (2, 2, 10, 2, 16, 8)
    assert cache.device_blocks.data_ptr() % HUGE_PAGE_BYTES == 0 and not cache.device_blocks.any()
    assert torch.equal(cache.layers[1][0], cache.device_blocks[1, 0])


_HEAP_SCRIPT = """
import ctypes, resource, sys
from raypaged.worker.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
block = libc.malloc(16 << 20)
print(bool(ctypes.c_size_t.from_address(block - 8).value & 2))  # glibc's IS_MMAPPED bit of the chunk
libc.memset(block, 1, 16 << 20)
libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    block = libc.malloc(16 << 20)
    libc.memset(block, 1, 16 << 20)
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_activations_stay_in_the_heap_for_the_next_step():
    """A 16 MiB block (a step's activation) comes from a fresh mapping by default; once freed memory
    is retained it comes from the heap, and allocating it again after freeing faults in no page."""

    def run(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True, check=True)
        mmapped, faults = out.stdout.split()
        return mmapped, int(faults)

    assert run("default")[0] == "True"
    assert run("retain") == ("False", 0)
