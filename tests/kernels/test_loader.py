"""The text handed to NVRTC at run time is self-contained."""

import pytest

from raypaged.kernels import loader

SOURCES = sorted(path.name for path in loader.KERNEL_DIR.glob("*.cu"))


@pytest.mark.parametrize("name", SOURCES)
def test_runtime_source_inlines_common_header_and_includes_nothing(name):
    text = loader.kernel_source(name)
    assert "#include" not in text  # NVRTC gets no include path and needs no CUDA headers
    assert text.count("#define RAYPAGED_COMMON_CUH") == 1


def test_sources_are_found_where_the_package_is():
    assert SOURCES == [
        "copy_blocks.cu",
        "fused_ops.cu",
        "lora_bgmv.cu",
        "paged_attention.cu",
        "paged_prefill.cu",
        "reshape_and_cache.cu",
        "w4a16.cu",
    ]


def test_a_built_wheel_carries_the_kernel_sources(tmp_path):
    """A non-editable install (pip install raypaged[cuda]) must find kernels/*.cu too."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("raypaged-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in [*SOURCES, "common.cuh", "fp8.cuh"]:
        assert f"raypaged/kernels/cuda/{source}" in names
    assert {"raypaged/kernels/host_runtime.h", "raypaged/kernels/host_device.h"} <= names  # the host build


@pytest.mark.parametrize("name", ["reshape_and_cache.cu", "paged_attention.cu", "paged_prefill.cu"])
def test_runtime_source_inlines_the_fp8_header_once(name):
    text = loader.kernel_source(name)
    assert text.count("#define RAYPAGED_FP8_CUH") == 1 and text.count("#define RAYPAGED_COMMON_CUH") == 1
    assert text.index("#define RAYPAGED_COMMON_CUH") < text.index("#define RAYPAGED_FP8_CUH")  # in include order


def test_headers_are_inlined_where_first_included_and_edits_change_the_text(tmp_path, monkeypatch):
    """A header included by a header is inlined too, each once; cupy keys its cache by this text."""
    (tmp_path / "common.cuh").write_text("// common v1\n")
    (tmp_path / "fp8.cuh").write_text('#include "common.cuh"\n// fp8\n')
    (tmp_path / "k.cu").write_text('#include "fp8.cuh"  // trailing comment\n#include "common.cuh"\nkernel\n')
    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path)
    before = loader.kernel_source("k.cu")
    assert before == "// common v1\n\n// fp8\n\n\nkernel\n"
    (tmp_path / "common.cuh").write_text("// common v2\n")
    assert loader.kernel_source("k.cu") != before
    (tmp_path / "k.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(ValueError, match="^k.cu includes 'missing.cuh', which is not in "):
        loader.kernel_source("k.cu")
