"""The host builds of the CUDA kernels compiled while the first tests run (hooks that ``tests/conftest.py`` takes).

A fresh machine compiles each kernel source for the host when a test first launches it: about 16 s for the seven
sources, 29 s more built with AddressSanitizer for tests/kernels/test_host_asan.py, each on one core while the
other waits. A run that collects those tests starts a thread that compiles them into the cache at the lowest CPU
priority (``host.prebuild``) on the core the first tests leave idle; a test that needs a build being made waits
for it (``host.build``'s lock) rather than compiling it again.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from raypaged import envs
from raypaged.kernels import host, loader

_USERS = ("tests/gpu/", "tests/kernels/")  # where tests launch the kernels on the host
_ASAN_USER = "tests/kernels/test_host_asan.py"
_threads: list[threading.Thread] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    paths = {item.nodeid.split("::")[0] for item in session.items}
    if session.config.option.collectonly or envs.host_kernels_sanitize() or host.compiler() is None:
        return  # a sanitized run (test_host_asan's own) builds its few kernels as its tests ask
    if not any(path.startswith(_USERS) for path in paths):
        return
    flavours: tuple[str | None, ...] = (None, "address") if _ASAN_USER in paths and host.asan_runtime() else (None,)
    sources = [loader.kernel_source(path.name) for path in sorted(loader.KERNEL_DIR.glob("*.cu"))]
    directory = host.cache_folder()  # now: a test may point $RAYPAGED_CACHE_DIR elsewhere meanwhile
    thread = threading.Thread(target=_prebuild, args=(sources, flavours, directory), name="prebuild-host-kernels")
    thread.start()
    _threads.append(thread)


def _prebuild(sources: list[str], flavours: tuple[str | None, ...], directory: Path) -> None:
    try:
        host.prebuild(sources, flavours, directory)
    except Exception:  # the test that launches the kernel builds it again and reports the error
        logging.getLogger("raypaged").exception("prebuilding the host kernels failed")


def pytest_sessionfinish(session: pytest.Session) -> None:
    for thread in _threads:  # no compiler left running after the session
        thread.join()
