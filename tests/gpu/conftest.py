import pytest

from raypaged.kernels import host
from tests.gpu import ON_HOST


@pytest.fixture(autouse=True)
def kernels_on_host():
    """Without a CUDA device the kernel wrappers take CPU tensors and run the kernels built for the host."""
    with host.on_host(ON_HOST):
        yield
