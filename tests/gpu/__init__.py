"""Tests that need a CUDA device and cupy; every module here sets ``pytestmark = NEEDS_CUDA_AND_CUPY``."""

import importlib.util

import pytest
import torch

NEEDS_CUDA_AND_CUPY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy (pip install raypaged[cuda])"),
]
