"""The CUDA kernels run on the host CPU: ``kernels/*.cu`` compiled with the host C++ compiler after
``host_runtime.h``, which runs each CUDA thread as a fiber (barriers, warp shuffles, shared memory and the
tensor-core fragments as the PTX ISA defines them). For testing the kernels and their wrappers where there is
no GPU: slow, and not a performance model.

``RAYPAGED_KERNELS_ON_HOST=1`` (or ``on_host()``) makes the wrappers in ``raypaged.kernels`` take CPU tensors
and run their kernels here, with the launch arguments cupy would pass (a Python int as 8 bytes, a float as a
double, numpy scalars as their type): an argument whose size or kind differs from the kernel's parameter is an
error naming both, where a GPU would read the wrong bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from raypaged import envs

RUNTIME = Path(__file__).with_name("host_runtime.h")  # which includes host_device.h
HEADERS = (RUNTIME, RUNTIME.with_name("host_device.h"))
ENV = "RAYPAGED_KERNELS_ON_HOST"
SANITIZE_ENV = "RAYPAGED_HOST_KERNELS_SANITIZE"
# the properties wrappers ask a device for: an H200's (the code paths of sm_90 are the ones compiled)
CAPABILITY = (9, 0)
MULTIPROCESSORS = 132

# an extern "C" kernel: its __launch_bounds__' first argument (the most threads a block may have), its name
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\(([^,)]*)[^)]*\)\s*)?(\w+)\s*\(')
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")
_NUMPY_TYPES = {np.dtype(c).type for c in "?bhilqBHILQefd"}  # the scalar types cupy passes by value
_DONE, _BAD_ARGUMENTS, _REFUSED = 0, 2, 3  # a launch's status (host_runtime.h's Status); 1: the kernel failed


class _State:
    enabled = envs.kernels_on_host()


def enabled() -> bool:
    return _State.enabled


def set_enabled(enable: bool) -> None:
    """From now on the kernel wrappers run on CPU tensors here (``enable``) or on a CUDA device."""
    _State.enabled = enable


@contextlib.contextmanager
def on_host(enable: bool = True) -> Iterator[None]:
    """Within the block, the kernel wrappers run on CPU tensors here (``enable``) or on a CUDA device."""
    before = _State.enabled
    set_enabled(enable)
    try:
        yield
    finally:
        set_enabled(before)


def device_type() -> str:
    """The device type of the tensors the kernels take: cpu here, else cuda."""
    return "cpu" if _State.enabled else "cuda"


def compiler() -> str | None:
    """The host C++ compiler ($CXX, c++ or g++), on an x86-64 host (the runtime switches fibers in its assembly)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


class HostKernel:
    """One ``extern "C" __global__`` kernel of a host-compiled module, called as a ``cupy.RawKernel`` is."""

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        try:
            self._launch = getattr(library, f"rp_host_launch_{name}")
        except AttributeError:
            raise AttributeError(f"no kernel {name!r} in the module") from None
        self.name = name

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        dims = [(tuple(dims) + (1, 1, 1))[:3] for dims in (grid, block)]
        if min(dims[0] + dims[1]) < 0:
            raise ValueError(f"{self.name}: a grid of {dims[0]} blocks of {dims[1]} threads")
        values = [_by_value(a) for a in args]
        buffers = [ctypes.create_string_buffer(v.tobytes(), v.itemsize) for v in values]
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(b) for b in buffers])
        sizes = (ctypes.c_size_t * max(1, len(values)))(*[v.itemsize for v in values])
        kinds = "".join("f" if v.dtype.kind == "f" else "i" for v in values).encode() + b"\0"
        error = ctypes.create_string_buffer(1024)
        status = self._launch(
            (ctypes.c_uint * 3)(*dims[0]),
            (ctypes.c_uint * 3)(*dims[1]),
            ctypes.c_size_t(shared_mem),
            pointers,
            sizes,
            kinds,
            len(values),
            error,
            ctypes.c_size_t(len(error)),
        )
        if status == _BAD_ARGUMENTS:
            raise TypeError(error.value.decode())
        if status == _REFUSED:
            raise ValueError(error.value.decode())
        if status != _DONE:
            raise RuntimeError(f"{self.name}: {error.value.decode()}")


def _by_value(arg: object) -> np.generic:
    """An argument as cupy passes it to a kernel (``cupy/_core/_kernel``'s rule for scalars)."""
    if arg is None:
        return np.uint64(0)
    if type(arg) not in _NUMPY_TYPES:
        if isinstance(arg, int):  # bool too, as cupy checks int first
            return np.int64(arg)
        if isinstance(arg, float):
            return np.float64(arg)
        raise TypeError(f"unsupported kernel argument type {type(arg).__name__}")
    return arg  # type: ignore[return-value]


def expand(source: str, defines: tuple[str, ...] = ()) -> str:
    """A .cu text preprocessed as the host build sees it (its macros expanded; the runtime's names, such as
    ``__global__``, left for the runtime header to define)."""
    flags = ["-DRP_HOST_EMULATION", "-D__CUDA_ARCH__=900", "-D__CUDACC_RTC__", *(f"-D{d}" for d in defines)]
    result = subprocess.run(
        [_require_compiler(), "-E", "-P", "-x", "c++", *flags, "-"], input=source, capture_output=True, text=True
    )
    if result.returncode:
        raise RuntimeError(f"preprocessing the kernels failed:\n{result.stderr[-4000:]}")
    return result.stdout


def kernel_names(source: str, defines: tuple[str, ...] = ()) -> list[str]:
    """The ``extern "C" __global__`` kernels of a .cu text."""
    return list(dict.fromkeys(match[2] for match in _KERNEL.finditer(expand(source, defines))))


def host_source(source: str, defines: tuple[str, ...] = ()) -> str:
    """The translation unit: the runtime, then the preprocessed kernel text (dynamic shared memory as the launch's
    buffer) with a launcher after each kernel, in the kernel's own namespace."""
    text = _EXTERN_SHARED.sub(r"\1* \2 = static_cast<\1*>(rp_host::dynamic_shared());", expand(source, defines))
    pieces, done = [f'#include "{RUNTIME}"\n'], 0
    for match in _KERNEL.finditer(text):
        end = _body_end(text, text.index("{", match.end()))
        bound, name = match[1] or "1024", match[2]
        pieces += [
            text[done:end],
            f'\nextern "C" int rp_host_launch_{name}(const unsigned* grid, const unsigned* block, size_t shared, '
            f"void** args, const size_t* sizes, const char* kinds, int nargs, char* error, size_t error_bytes) {{\n"
            f'  return rp_host::launch_kernel({name}, "{name}", {bound}, grid, block, shared, args, sizes, kinds, '
            f"nargs, error, error_bytes);\n}}\n",
        ]
        done = end
    pieces.append(text[done:])
    return "".join(pieces)


def _body_end(text: str, open_brace: int) -> int:
    """The index just past the brace that closes the one at ``open_brace`` (preprocessed text: no comments)."""
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("a kernel's body does not close")


def module(source: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The host build of a kernel source (cached on disk by the text's hash, like the CPU kernels); with
    ``$RAYPAGED_HOST_KERNELS_SANITIZE=address`` built with AddressSanitizer, so that a kernel's read or write
    outside a tensor (which a GPU may let pass) stops the process with a report naming the kernel."""
    sanitize = envs.host_kernels_sanitize()
    if sanitize and not asan_loaded():
        raise RuntimeError(
            f"{SANITIZE_ENV}=address needs AddressSanitizer's runtime loaded before Python's libraries: start "
            f"Python with LD_PRELOAD={asan_runtime() or 'libasan.so'} (and ASAN_OPTIONS=detect_leaks=0)"
        )
    return _module(source, defines, sanitize)


def asan_runtime() -> str | None:
    """The host compiler's AddressSanitizer runtime (for LD_PRELOAD), if it has one."""
    cxx = compiler()
    if cxx is None:
        return None
    found = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def asan_loaded() -> bool:
    return "libasan" in Path("/proc/self/maps").read_text()


@functools.cache
def _module(source: str, defines: tuple[str, ...], sanitize: str | None) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source, defines, sanitize)))


def cache_folder() -> Path:
    """Where the host builds are cached: ``host_kernels`` in ``$RAYPAGED_CACHE_DIR`` (or its default)."""
    return envs.cache_dir() / "host_kernels"


def build(
    source: str,
    defines: tuple[str, ...] = (),
    sanitize: str | None = None,
    nice: bool = False,
    directory: Path | None = None,
) -> Path:
    """The host build of a kernel source in the cache (compiled there first if it is not yet): the library
    :func:`module` loads. One process or thread compiles a build at a time (a lock file beside it), so a build
    another one is making is waited for, not made twice. ``nice``: the compiler runs at the lowest CPU priority
    (:func:`prebuild`); ``directory``: the builds' folder, if not :func:`cache_folder` now."""
    unit = host_source(source, defines)
    flags = ["-std=c++17", "-O2", "-march=native", "-fPIC", "-shared", "-w"]
    if sanitize:
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"]
    key = hashlib.sha256("\0".join([unit, *(h.read_text() for h in HEADERS), *flags]).encode()).hexdigest()[:24]
    directory = directory or cache_folder()
    library = directory / f"{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built meanwhile by whoever held the lock
            return library
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            unit_path = Path(scratch) / "unit.cpp"
            unit_path.write_text(unit)
            built = Path(scratch) / "unit.so"
            command = [_require_compiler(), *flags, str(unit_path), "-o", str(built)]
            result = subprocess.run(["nice", "-n", "19", *command] if nice else command, capture_output=True)
            if result.returncode:
                raise RuntimeError(f"host build of the kernels failed:\n{result.stderr.decode()[-4000:]}")
            os.replace(built, library)
    return library


def prebuild(sources: list[str], sanitize: tuple[str | None, ...] = (None,), directory: Path | None = None) -> None:
    """Compile the host builds of ``sources`` (kernel texts) into ``directory`` (else :func:`cache_folder` now),
    once for each ``sanitize`` value, at the lowest CPU priority, loading none: for a thread that warms the cache
    while other work runs (the test suite's first minutes)."""
    directory = directory or cache_folder()
    for flavour in sanitize:
        for source in sources:
            build(source, (), flavour, nice=True, directory=directory)


def function(source: str, kernel_name: str, defines: tuple[str, ...] = ()) -> HostKernel:
    library = module(source, tuple(defines))
    return HostKernel(library, kernel_name)


def _require_compiler() -> str:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"{ENV}=1 needs a C++ compiler (c++ or g++, or $CXX) on an x86-64 host")
    return cxx
