"""The kernels built for the host under AddressSanitizer (``RAYPAGED_HOST_KERNELS_SANITIZE=address``): a read
outside a tensor, which a GPU may let pass with a garbage value, stops the process with a report naming the
kernel; and the kernels' own tests run clean under it (a few cases of each kernel here, every case with
``--soak``). Each run is a subprocess started with the sanitizer's runtime preloaded, as it must be."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raypaged.kernels import host

ASAN = host.asan_runtime()
pytestmark = pytest.mark.skipif(ASAN is None, reason="needs a C++ compiler with AddressSanitizer")
ROOT = Path(__file__).resolve().parents[2]

OUT_OF_BOUNDS = r'''
import numpy as np, torch
from raypaged.kernels import host, loader

source = """extern "C" __global__ void past_the_end(float* out, const float* x, int n) {
  out[threadIdx.x] = x[n - 16 + threadIdx.x];
}"""
x, out = torch.randn(1000), torch.zeros(32)
args = (loader.device_pointer(out), loader.device_pointer(x), np.int32(1000))
host.function(source, "past_the_end")((1,), (32,), args)
print("not reported")
'''


def sanitized(**extra: str) -> dict[str, str]:
    assert ASAN is not None
    return {
        **os.environ,
        "LD_PRELOAD": ASAN,
        "ASAN_OPTIONS": "detect_leaks=0",
        host.SANITIZE_ENV: "address",
        **extra,
    }


def test_a_read_past_a_tensors_end_is_reported_with_the_kernels_name():
    run = subprocess.run(
        [sys.executable, "-c", OUT_OF_BOUNDS], cwd=ROOT, env=sanitized(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0 and "not reported" not in run.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in run.stderr
    assert "READ of size 4" in run.stderr and " in past_the_end " in run.stderr
    assert "0 bytes to the right of 4000-byte region" in run.stderr


def test_the_sanitizer_needs_its_runtime_preloaded(monkeypatch):
    monkeypatch.setenv(host.SANITIZE_ENV, "address")
    with pytest.raises(RuntimeError, match=rf"needs AddressSanitizer's runtime .* LD_PRELOAD={ASAN}"):
        host.function('extern "C" __global__ void nothing() {}', "nothing")


# one case of each kernel family (every dtype and path of the varlen prefill); --soak: every test of tests/gpu,
# the engine's mixed steps over the host-built kernels among them
FEW = (
    "decode_gqa_matches_torch and 128-16 or reshape_and_cache_writes or copy_blocks_copy or gather_blocks or "
    "prefill_matches_torch and chunk or mixed_spans and 128-16 or rms_norm_matches and 7-576 or silu_and_mul and "
    "33-1536 or rotary_and_cache_equals and 128-16 or bgmv_equals and 576-1536 and 16 or kernels_equal_the_formats "
    "and 1536x576-g128 or narrows_as_torch and 128 or over_fp8_matches_torch and 128-16"
)


def test_the_kernels_tests_run_clean_under_the_sanitizer(soak):
    selection = [] if soak else ["-k", FEW]
    # --soak: the selection's cases whether or not the pairwise cover of CI holds them
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--soak", "tests/gpu", *selection]
    run = subprocess.run(command, cwd=ROOT, env=sanitized(), capture_output=True, text=True, timeout=1800)
    assert "AddressSanitizer" not in run.stderr + run.stdout, (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert " passed" in run.stdout
