"""Which attention backend runs, and the exact reasons the CUDA kernels cannot (no GPU needed)."""

import pytest
import torch

from raypaged.attention.backend import TORCH, cuda_unsupported_reason, select_backend

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("device", "head_size", "block_size", "reason"),
    [
        (torch.device("cpu"), 64, 16, "the device is cpu"),
        (CUDA, 48, 16, "head size 48 has no kernel (supported: 64, 80, 96, 128)"),
        (CUDA, 64, 64, "block size 64 has no kernel (supported: 8, 16, 32)"),
    ],
)
def test_reasons_the_kernels_cannot_run(device, head_size, block_size, reason):
    assert cuda_unsupported_reason(device, head_size, block_size) == reason


def test_selection():
    assert select_backend("torch", CUDA, 64, 16) is TORCH
    assert select_backend("auto", torch.device("cpu"), 64, 16) is TORCH
    assert select_backend("auto", CUDA, 64, 128) is TORCH  # a block size with no kernel falls back
    with pytest.raises(ValueError, match="^attention_backend 'cuda' cannot run: block size 128 has no kernel"):
        select_backend("cuda", CUDA, 64, 128)
    with pytest.raises(ValueError, match="^attention_backend must be one of auto, torch, cuda, got 'flash'$"):
        select_backend("flash", CUDA, 64, 16)


def test_the_cuda_decode_gets_the_models_strided_query_packed(monkeypatch):
    """The model's q is a view of its fused qkv rows; the decode kernel is handed a packed copy."""
    from raypaged import kernels
    from raypaged.attention.backend import cuda_backend

    seen = []
    monkeypatch.setattr(kernels, "paged_attention_decode", lambda query, *args: seen.append(query) or query)
    qkv = torch.randn(3, 4 * 8 + 2 * 2 * 8)
    query = qkv[:, :32].view(3, 4, 8)
    assert not query.is_contiguous()
    out = cuda_backend().decode(query, None, None, None, None, 0.5)
    assert seen[0].is_contiguous() and torch.equal(seen[0], query) and out is seen[0]
