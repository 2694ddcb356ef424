"""Compile kernels/*.cu with cupy.RawModule once per process and device, and launch on torch's stream.

cupy is imported here only, lazily, after the wrappers' argument checks have passed. With
``RAYPAGED_KERNELS_ON_HOST=1`` (``raypaged.kernels.host``) the same kernels are built for the CPU and run
there on CPU tensors, for tests without a GPU.
NVRTC compiles for the current device's architecture (cupy picks ``-arch`` from it), and
cupy keeps the binary in its on-disk kernel cache across processes.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from raypaged.kernels import host

# a link to the repository's kernels/ in a checkout, the sources themselves in an installed wheel
KERNEL_DIR = Path(__file__).parent / "cuda"
_INCLUDE = re.compile(r'^#include "([^"]+)"[^\n]*$', re.MULTILINE)
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
FP8_CACHE_SUFFIX = "_fp8"  # the kernels reading or writing an fp8 e4m3 KV cache: the name of the model-dtype one + this


def kernel_source(name: str) -> str:
    """The .cu text with the headers it includes from kernels/ (common.cuh, fp8.cuh, and what they include)
    inlined, each once where it is first included, so NVRTC needs no include path and cupy's source-keyed cache
    sees header edits."""
    inlined: set[str] = set()

    def inline(match: re.Match) -> str:
        header = match[1]
        if not (KERNEL_DIR / header).is_file():
            raise ValueError(f"{name} includes {header!r}, which is not in {KERNEL_DIR}")
        if header in inlined:
            return ""
        inlined.add(header)
        return _INCLUDE.sub(inline, (KERNEL_DIR / header).read_text())

    return _INCLUDE.sub(inline, (KERNEL_DIR / name).read_text())


@functools.cache
def _module(name: str, device_index: int, defines: tuple[str, ...] = ()):
    import cupy

    with cupy.cuda.Device(device_index):
        options = ("-std=c++17", *(f"-D{d}" for d in defines))
        module = cupy.RawModule(code=kernel_source(name), options=options)
        module.compile()
    return module


def function(file_name: str, kernel_name: str, device: torch.device, defines: tuple[str, ...] = ()):
    """The compiled kernel ``kernel_name`` from ``kernels/<file_name>`` for ``device``;
    ``defines`` (``NAME=VALUE``) set a source's compile-time knobs (benchmarks)."""
    if host.enabled():
        return _host_function(file_name, kernel_name, tuple(defines))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _module(file_name, index, tuple(defines)).get_function(kernel_name)


@functools.cache
def _host_function(file_name: str, kernel_name: str, defines: tuple[str, ...]):
    """The kernel built for the host, once per process as ``_module`` is for a device."""
    return host.function(kernel_source(file_name), kernel_name, defines)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: a CUDA device where cupy is installed (the CPU on the host)."""
    if host.enabled():
        return device.type == "cpu"
    return device.type == "cuda" and importlib.util.find_spec("cupy") is not None


def on_device(tensor: torch.Tensor) -> bool:
    """Whether the kernels read ``tensor`` as device memory: a CUDA tensor (a CPU one when they run on the host)."""
    return tensor.device.type == host.device_type()


def capability(device: torch.device) -> tuple[int, int]:
    return host.CAPABILITY if host.enabled() else torch.cuda.get_device_capability(device)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The device's SM count (the wrappers size their grids by it)."""
    if host.enabled():
        return host.MULTIPROCESSORS
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def device_pointer(tensor: torch.Tensor) -> np.uint64:
    """A CUDA tensor as a kernel argument: its device address, passed by value (zero-copy).

    No cupy array is built: that costs microseconds per argument on every launch, and the
    wrappers have already checked dtype, shape, contiguity and device.
    """
    return np.uint64(tensor.data_ptr())


def host_device_pointer(tensor: torch.Tensor) -> np.uint64:
    """The device-side address of a pinned host tensor: under unified virtual addressing
    (every 64-bit CUDA platform) page-locked host memory is mapped at its host address."""
    if not tensor.is_pinned():
        raise ValueError("only pinned host memory is visible to the device")
    return np.uint64(tensor.data_ptr())


def launch(
    kernel, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
) -> None:
    """Run ``kernel`` on torch's current stream of ``device``."""
    if isinstance(kernel, host.HostKernel):
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _external_stream(torch.cuda.current_stream(index).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.cache
def _external_stream(pointer: int, device_index: int):
    """cupy's handle on one of torch's streams (also a capturing one, under CUDA graphs)."""
    import cupy

    return cupy.cuda.ExternalStream(pointer, device_index)
