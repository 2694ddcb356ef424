"""Every wrapper checks its arguments before importing cupy: no test here leaves cupy imported."""

import sys

import pytest


@pytest.fixture(autouse=True)
def no_cupy_import():
    loaded = "cupy" in sys.modules
    yield
    assert ("cupy" in sys.modules) == loaded, "a wrapper imported cupy before failing its checks"
