"""Which attention backend runs, and the exact reasons the CUDA kernels or the CPU decode kernel cannot
(no GPU needed)."""

import pytest
import torch

from raypaged.attention import cpu_ops
from raypaged.attention.backend import CPU, TORCH, cpu_unsupported_reason, cuda_unsupported_reason, select_backend

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
    cpu = torch.device("cpu")
    assert select_backend("torch", CUDA, 64, 16) is TORCH
    assert select_backend("torch", cpu, 64, 16) is TORCH
    assert select_backend("auto", cpu, 64, 16) is CPU  # this machine has a C compiler
    assert select_backend("cpu", cpu, 64, 16) is CPU
    assert select_backend("auto", cpu, 64, 16, torch.bfloat16) is TORCH  # the kernel reads float32 only
    assert select_backend("auto", cpu, 64, 16, torch.float32, torch.float8_e4m3fn) is CPU  # fp8 K/V widened in C
    assert select_backend("auto", cpu, 64, 16, torch.float32, torch.float8_e5m2) is TORCH
    assert select_backend("auto", cpu, 64, 16, torch.float32, torch.bfloat16) is CPU  # a bf16 model's, widened in C
    with pytest.raises(
        ValueError,
        match=r"^attention_backend 'cpu' cannot run: the KV cache is float8_e5m2 \(the "
        r"kernels read float32, float8_e4m3fn and bfloat16 caches\)$",
    ):
        select_backend("cpu", cpu, 64, 16, torch.float32, torch.float8_e5m2)
    assert select_backend("auto", CUDA, 64, 128) is TORCH  # a block size with no kernel falls back
    with pytest.raises(ValueError, match="^attention_backend 'cuda' cannot run: block size 128 has no kernel"):
        select_backend("cuda", CUDA, 64, 128)
    with pytest.raises(
        ValueError,
        match=r"^attention_backend 'cpu' cannot run: the model runs in bfloat16 \(the "
        r"kernel reads float32\)$",
    ):
        select_backend("cpu", cpu, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="^attention_backend 'cpu' cannot run: the device is cuda$"):
        select_backend("cpu", CUDA, 64, 16)
    with pytest.raises(ValueError, match="^attention_backend must be one of auto, torch, cpu, cuda, got 'flash'$"):
        select_backend("flash", CUDA, 64, 16)


def test_auto_on_cpu_without_a_compiler_runs_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_ops.library.cache_clear()
    try:
        assert cpu_unsupported_reason(torch.device("cpu"), torch.float32) == (
            "no C compiler found (set $CC, or install gcc)"
        )
        with caplog.at_level("WARNING", logger="raypaged"):
            assert select_backend("auto", torch.device("cpu"), 64, 16) is TORCH
        assert caplog.messages == [
            "paged attention runs in torch, not the CPU kernels: no C compiler found (set $CC, or install gcc)"
        ]
        with pytest.raises(ValueError, match=r"^attention_backend 'cpu' cannot run: no C compiler found"):
            select_backend("cpu", torch.device("cpu"), 64, 16)
    finally:
        cpu_ops.library.cache_clear()


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
