"""host.build and host.prebuild: a kernel's host build compiled into the cache once, whoever asks first, and
loaded only by host.module (tests/prebuild.py warms the cache with them while the first tests run)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from raypaged.kernels import host, loader

pytestmark = pytest.mark.skipif(host.compiler() is None, reason="needs a C++ compiler on an x86-64 host")

SOURCE = """extern "C" __global__ void add_one(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}"""


@pytest.fixture
def compiles(tmp_path, monkeypatch) -> list[list[str]]:
    """A fresh cache, and the compiler commands run into it (not the preprocessor's -E runs, nor the builds
    tests/prebuild.py's thread may be making for the suite's cache)."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path))
    seen: list[list[str]] = []
    real = subprocess.run

    def run(command, *args, **kwargs):
        if "-E" not in command and str(tmp_path) in command[-1]:
            seen.append(list(command))
        return real(command, *args, **kwargs)

    monkeypatch.setattr(host.subprocess, "run", run)
    return seen


def test_prebuild_compiles_at_the_lowest_priority_without_loading_and_module_reuses_it(compiles, tmp_path):
    host.prebuild([SOURCE])
    [command] = compiles
    assert command[:3] == ["nice", "-n", "19"] and "-fsanitize=address" not in command
    [library] = (tmp_path / "host_kernels").glob("*.so")
    assert str(library) not in Path("/proc/self/maps").read_text()  # built, not loaded
    x = torch.zeros(5)
    host.function(SOURCE, "add_one")((1,), (32,), (loader.device_pointer(x), np.int32(5)))
    assert torch.equal(x, torch.ones(5))
    assert len(compiles) == 1  # the prebuilt library, not a second compile
    assert str(library) in Path("/proc/self/maps").read_text()


def test_prebuild_makes_the_sanitized_build_too_when_asked(compiles):
    host.prebuild([SOURCE], (None, "address"))
    assert ["-fsanitize=address" in command for command in compiles] == [False, True]
    host.prebuild([SOURCE], (None, "address"))
    assert len(compiles) == 2  # both cached


def test_a_build_asked_for_while_another_thread_makes_it_waits_for_that_one(compiles, tmp_path):
    barrier = threading.Barrier(3)
    built: list[Path] = []

    def ask() -> None:
        barrier.wait()
        built.append(host.build(SOURCE, ("N=3",)))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(compiles) == 1 and len(set(built)) == 1 and built[0].exists()
    assert sorted(p.suffix for p in (tmp_path / "host_kernels").iterdir()) == [".lock", ".so"]
