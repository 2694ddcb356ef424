"""The CPU KV cache on transparent huge pages (raypaged.worker.host_memory)."""

import pytest
import torch

from raypaged.worker import host_memory
from raypaged.worker.cache import KVCache
from raypaged.worker.host_memory import HUGE_PAGE_BYTES, huge_pages_available, zeros_on_huge_pages

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
    tensor = zeros_on_huge_pages((8, HUGE_PAGE_BYTES // 4), torch.float32)  # 16 MiB
    assert _anon_huge_kib(tensor.data_ptr()) >= 8 * HUGE_PAGE_BYTES // 1024 // 2  # most of it, at least


def test_without_huge_pages_it_is_plain_zeros(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "_THP_MODE", mode)

    def refuse(*args):
        raise AssertionError("madvise called with huge pages off")

    monkeypatch.setattr(host_memory, "_madvise", refuse)
    assert not huge_pages_available()
    tensor = zeros_on_huge_pages((3, 5), torch.float32)
    assert torch.equal(tensor, torch.zeros(3, 5))


@needs_thp
def test_the_cpu_kv_cache_lies_on_huge_pages():
    cache = KVCache(2, 10, 4, (2, 16, 8), torch.float32, torch.device("cpu"))
    assert cache.device_blocks.shape == (2, 2, 10, 2, 16, 8)
    assert cache.device_blocks.data_ptr() % HUGE_PAGE_BYTES == 0 and not cache.device_blocks.any()
    assert torch.equal(cache.layers[1][0], cache.device_blocks[1, 0])
