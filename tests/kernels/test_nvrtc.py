"""Every kernel source compiles under NVRTC, the compiler cupy.RawModule runs on the GPU machine, as the loader
hands it over (headers inlined, ``-std=c++17``), for the H200's sm_90: no device is needed, only libnvrtc (the
``nvidia-cuda-nvrtc`` wheel of the test extras). tests/kernels/test_compile.py compiles them with nvcc for sm_80
and sm_90."""

import ctypes
import functools
import importlib.util
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from raypaged.kernels import host, loader
from tests.kernels.test_compile import SOURCES


def libnvrtc() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        for path in sorted(Path(base).glob("cu*/lib/libnvrtc.so*")):
            return ctypes.CDLL(str(path))
    return None


NVRTC = libnvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="needs libnvrtc (pip install nvidia-cuda-nvrtc)")


def compile_with_nvrtc(source: str, options: list[str]) -> tuple[int, str, bytes]:
    """(NVRTC's result code, its log, the cubin)."""
    assert NVRTC is not None
    program = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None) == 0
    try:
        flags = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = NVRTC.nvrtcCompileProgram(program, len(options), flags)
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(program, log)
        cubin = b""
        if result == 0:
            assert NVRTC.nvrtcGetCUBINSize(program, ctypes.byref(size)) == 0
            buffer = ctypes.create_string_buffer(size.value)
            assert NVRTC.nvrtcGetCUBIN(program, buffer) == 0
            cubin = buffer.raw
        return result, log.value.decode(errors="replace"), cubin
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(program))


def compile_source(source: str) -> tuple[int, str, bytes]:
    return compile_with_nvrtc(loader.kernel_source(source), ["-std=c++17", "-arch=sm_90"])


@functools.cache
def compiled() -> dict[str, tuple[int, str, bytes]]:
    """Every source compiled for sm_90, in as many processes as there are cores (NVRTC compiles one program
    at a time per process), largest first."""
    order = sorted(SOURCES, key=lambda source: -len(loader.kernel_source(source)))
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(order, pool.map(compile_source, order)))


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_under_nvrtc_as_cupy_loads_it(source):
    """No error or warning, and the cubin holds every extern "C" kernel the source defines (the names the host
    build finds after the preprocessor, so a kernel lost to a macro on either side shows)."""
    text = loader.kernel_source(source)
    result, log, cubin = compiled()[source]
    assert result == 0, log
    assert "warning" not in log.lower(), log
    names = host.kernel_names(text) if host.compiler() else []
    missing = [name for name in names if b"\0" + name.encode() + b"\0" not in cubin]
    assert not missing, missing
