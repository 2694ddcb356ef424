"""kernels/fp8.cuh's fp8 e4m3 conversions, built as host code (the same text the kernels compile), against torch:
widening every byte, narrowing a sweep of floats (every fp8 value, the ties between them, the saturation range,
infinities, NaN, subnormals, random floats over many exponents) bit for bit, and the packed fp16 widening the decode
and prefill kernels use. Built twice where the compilers exist: as plain C++ (the host compiler) and as CUDA source
through nvcc's host pass (the ``__host__ __device__`` functions the kernels inline)."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
WRAPPER = """
#include "fp8.cuh"
extern "C" {
void rp_widen(const unsigned char* in, float* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = fp8_e4m3_to_f32(in[i]);
}
void rp_narrow(const float* in, unsigned char* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = f32_to_fp8_e4m3(in[i]);
}
void rp_widen4_div256(const unsigned* in, unsigned* even, unsigned* odd, long n) {
  for (long i = 0; i < n; ++i) fp8x4_to_f16x4_div256(in[i], &even[i], &odd[i]);
}
}
"""


def host_compiler() -> str | None:
    """``$CXX``, else the first of c++, g++, clang++ on the PATH."""
    if cxx := os.environ.get("CXX"):
        return shutil.which(cxx)
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def build(kind: str, tmp: Path) -> ctypes.CDLL:
    if kind == "c++":
        compiler = host_compiler()
        if compiler is None:
            pytest.skip("no C++ compiler found (set $CXX, or install g++)")
        source = tmp / "fp8_wrapper.cpp"
        command = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"]
    else:
        compiler = shutil.which("nvcc")
        if compiler is None:
            pytest.skip("nvcc is not installed")
        source = tmp / "fp8_wrapper.cu"
        command = [compiler, "-O2", "-Werror", "all-warnings", "-shared", "-Xcompiler", "-fPIC"]
    source.write_text(WRAPPER)
    library = tmp / f"fp8_{kind.replace('+', 'p')}.so"
    proc = subprocess.run(
        [*command, "-I", str(KERNEL_DIR), str(source), "-o", str(library)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "warning" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    lib = ctypes.CDLL(str(library))
    pointer, count = ctypes.c_void_p, ctypes.c_long
    lib.rp_widen.argtypes = (pointer, pointer, count)
    lib.rp_narrow.argtypes = (pointer, pointer, count)
    lib.rp_widen4_div256.argtypes = (pointer, pointer, pointer, count)
    for function in (lib.rp_widen, lib.rp_narrow, lib.rp_widen4_div256):
        function.restype = None
    return lib


@pytest.fixture(scope="module", params=["c++", "nvcc"])
def lib(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(f"fp8_{request.param.replace('+', 'p')}"))


def widen(lib, codes: np.ndarray) -> np.ndarray:
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    out = np.empty(codes.shape, dtype=np.float32)
    lib.rp_widen(codes.ctypes.data, out.ctypes.data, codes.size)
    return out


def narrow(lib, values: np.ndarray) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(values.shape, dtype=np.uint8)
    lib.rp_narrow(values.ctypes.data, out.ctypes.data, values.size)
    return out


def torch_widen(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def torch_narrow(values) -> np.ndarray:
    if not isinstance(values, torch.Tensor):
        values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def assert_same_floats(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bits, except that any NaN matches any NaN."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


ALL_CODES = np.arange(256, dtype=np.uint8)
FINITE_CODES = ALL_CODES[(ALL_CODES & 0x7F) != 0x7F]


def test_widening_every_byte_is_torchs(lib):
    assert_same_floats(widen(lib, ALL_CODES), torch_widen(ALL_CODES))
    assert np.isnan(widen(lib, np.array([0x7F, 0xFF]))).all()
    assert widen(lib, np.array([0x7E, 0x01, 0x80]).astype(np.uint8)).tolist() == [448.0, 2.0**-9, -0.0]


def sweep() -> np.ndarray:
    """Every fp8 value, the midpoints (ties) and quarter points between neighbours, the saturation range,
    infinities, NaN, float32 subnormals, and random floats over exponents 2^-40..2^40."""
    values = torch_widen(FINITE_CODES).astype(np.float64)
    positive = np.unique(values[values >= 0])
    ties = (positive[:-1] + positive[1:]) / 2
    quarters = np.concatenate([positive[:-1] + (positive[1:] - positive[:-1]) * f for f in (0.25, 0.75)])
    near_ties = np.concatenate([np.nextafter(ties.astype(np.float32), np.float32(d)) for d in (0, np.inf)])
    saturation = np.concatenate([np.linspace(448.0, 470.0, 2201), [463.99, 464.0, 464.01, 479.99, 480.0, 1e4, 3e38]])
    specials = np.array([np.inf, np.nan, 0.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-6, 2.0**-6 - 2.0**-10])
    subnormal32 = np.array([1e-45, 1e-40, 1.1754942e-38], dtype=np.float32)
    rng = np.random.default_rng(0)
    mantissas = rng.uniform(1.0, 2.0, 20000)
    exponents = rng.integers(-40, 41, 20000)
    random = mantissas * np.exp2(exponents)
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    magnitudes = np.concatenate(
        [positive, ties, quarters, near_ties, saturation, specials, subnormal32, random]
    ).astype(np.float32)
    return np.concatenate([magnitudes, -magnitudes, random_bits, np.float32([-np.nan])]).astype(np.float32)


def test_narrowing_is_torchs_bit_for_bit(lib):
    values = sweep()
    assert np.array_equal(narrow(lib, values), torch_narrow(values))


def test_narrowing_rounds_ties_to_even_and_saturates(lib):
    got = narrow(lib, np.float32([2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 449.0, 464.0, 470.0, np.inf, -np.inf]))
    # 2^-10: between 0 and 2^-9, even 0; 3 * 2^-10: between 2^-9 and 2^-8, even 2^-8 (code 2); 1.0625: between
    # 1 (0x38) and 1.125 (0x39), even 0x38; 1.1875: between 1.125 and 1.25 (0x3a), even 0x3a
    assert got.tolist() == [0x00, 0x02, 0x38, 0x3A, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    nan = narrow(lib, np.float32([np.nan, -np.nan]))
    assert nan.tolist() == torch_narrow(np.float32([np.nan, -np.nan])).tolist()
    assert (nan & 0x7F).tolist() == [0x7F, 0x7F]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_narrowing_half_precision_rows_through_float32_is_torchs(lib, dtype):
    """The cache write widens an fp16 or bf16 row element to float32 (exactly) and narrows that: the same bits as
    torch's narrowing of the half-precision tensor itself, over every half-precision bit pattern."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    assert np.array_equal(narrow(lib, every.float().numpy()), torch_narrow(every))


def test_packed_fp16_widening_is_exact(lib):
    """fp8x4_to_f16x4_div256: four bytes as fp16 halves of value / 256, which the kernels multiply by 256 in fp16
    (exact, as numpy's fp16 multiply checks here); every byte in every position of the word."""
    rng = np.random.default_rng(1)
    words = []
    for position in range(4):
        others = rng.integers(0, 256, (256, 4), dtype=np.uint32)
        others[:, position] = np.arange(256)
        words.append(others[:, 0] | others[:, 1] << 8 | others[:, 2] << 16 | others[:, 3] << 24)
    words = np.ascontiguousarray(np.concatenate(words), dtype=np.uint32)
    even, odd = np.empty_like(words), np.empty_like(words)
    lib.rp_widen4_div256(words.ctypes.data, even.ctypes.data, odd.ctypes.data, words.size)
    # element order: even = (0, 2), odd = (1, 3), the lower element in the lower half
    halves = np.stack([even & 0xFFFF, odd & 0xFFFF, even >> 16, odd >> 16], axis=1).astype(np.uint16)
    values = (halves.view(np.float16) * np.float16(256)).astype(np.float32)
    codes = words[:, None] >> (8 * np.arange(4, dtype=np.uint32)) & 0xFF
    assert_same_floats(values.ravel(), torch_widen(codes.ravel().astype(np.uint8)))
