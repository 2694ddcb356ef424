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
    for source in [*SOURCES, "common.cuh"]:
        assert f"raypaged/kernels/cuda/{source}" in names
