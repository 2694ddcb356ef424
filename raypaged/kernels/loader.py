"""Compile kernels/*.cu with cupy.RawModule once per process and device, and launch on torch's stream.

cupy is imported here only, lazily, after the wrappers' argument checks have passed.
NVRTC compiles for the current device's architecture (cupy picks ``-arch`` from it), and
cupy keeps the binary in its on-disk kernel cache across processes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
_INCLUDE = '#include "common.cuh"'
# cupy has no bfloat16: tensors cross as same-width integers (zero-copy views)
_AS_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def kernel_source(name: str) -> str:
    """The .cu text with common.cuh inlined, so cupy's source-keyed cache sees header edits."""
    text = (KERNEL_DIR / name).read_text()
    return text.replace(_INCLUDE, (KERNEL_DIR / "common.cuh").read_text())


@functools.cache
def _module(name: str, device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=kernel_source(name), options=("-std=c++17",))
        module.compile()
    return module


def function(file_name: str, kernel_name: str, device: torch.device):
    """The compiled kernel ``kernel_name`` from ``kernels/<file_name>`` for ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _module(file_name, index).get_function(kernel_name)


def as_cupy(tensor: torch.Tensor):
    """Zero-copy cupy view of a CUDA tensor through ``__cuda_array_interface__``."""
    import cupy

    return cupy.asarray(tensor.view(_AS_INT.get(tensor.dtype, tensor.dtype)))


def host_device_pointer(tensor: torch.Tensor) -> np.uint64:
    """The device-side address of a pinned host tensor (mapped under unified addressing)."""
    import cupy

    return np.uint64(cupy.cuda.runtime.hostGetDevicePointer(tensor.data_ptr(), 0))


def launch(kernel, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           shared_mem: int = 0) -> None:
    """Run ``kernel`` on torch's current stream of ``device``."""
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        kernel(grid, block, args, shared_mem=shared_mem)
