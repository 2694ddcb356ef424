"""The text handed to NVRTC at run time is self-contained."""

import pytest

from raypaged.kernels import loader

SOURCES = sorted(path.name for path in loader.KERNEL_DIR.glob("*.cu"))


@pytest.mark.parametrize("name", SOURCES)
def test_runtime_source_inlines_common_header_and_includes_nothing(name):
    text = loader.kernel_source(name)
    assert "#include" not in text  # NVRTC gets no include path and needs no CUDA headers
    assert text.count("#define RAYPAGED_COMMON_CUH") == 1

